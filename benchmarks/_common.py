"""Shared helpers of the benchmarks: run metadata, tables, figures, timing, slopes.

Every benchmark prints its results as a Markdown table (so a run can be pasted into
`benchmarks/README.md` as it is) and saves a PNG and a JSON next to it, stamped with the date,
the commit and the machine, so a number can always be traced to the code that produced it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: benchmarks run in CI and over ssh

import matplotlib.pyplot as plt
import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results"
MIB = 1 << 20


def run_info() -> dict[str, Any]:
    """Where and on what a result was measured."""
    import msgspec

    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "commit": _commit(),
        "cpus": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)),
        "memory_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "msgspec": msgspec.__version__,
    }


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    # Changed tracked files make the stamp "+dirty"; committed results in DEFAULT_OUT do not.
    dirty = subprocess.run(
        [
            "git",
            "-C",
            str(ROOT),
            "status",
            "--porcelain",
            "--untracked-files=no",
            "--",
            ".",
            f":!{DEFAULT_OUT.relative_to(ROOT)}",
        ],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return out.stdout.strip() + ("+dirty" if dirty else "")


def info_line(info: dict[str, Any]) -> str:
    return (
        f"{info['date']} · commit {info['commit']} · {info['cpu_affinity']} of {info['cpus']} "
        f"CPUs · {info['memory_gib']} GiB · Python {info['python']} · numpy {info['numpy']} · "
        f"msgspec {info['msgspec']}"
    )


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; floats get 3 significant digits unless already formatted."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    for row, raw in zip(cells, rows, strict=True):
        padded = [
            c.rjust(w) if isinstance(v, (int, float)) else c.ljust(w)
            for c, v, w in zip(row, raw, widths, strict=True)
        ]
        lines.append("| " + " | ".join(padded) + " |")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "n/a"
        if value == 0 or 0.01 <= abs(value) < 1e5:
            return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
        return f"{value:.2e}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def print_section(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Print a titled table and return it (to go into the saved report)."""
    text = f"\n### {title}\n\n{markdown_table(headers, rows)}\n"
    print(text, flush=True)
    return text


def save_outputs(
    out_dir: Path, stem: str, fig: Any, payload: dict[str, Any], report: str
) -> list[Path]:
    """Write `<stem>.png`, `<stem>.json` and `<stem>.md` into `out_dir`; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.png", out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    fig.savefig(paths[0], dpi=110, bbox_inches="tight")
    plt.close(fig)
    paths[1].write_text(json.dumps(payload, indent=1, default=_json_default) + "\n")
    paths[2].write_text(report)
    for p in paths:
        print(f"wrote {p}", file=sys.stderr)
    return paths


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def best_time(fn: Callable[[], object], *, min_time_s: float, repeats: int = 5) -> float:
    """Seconds per call of `fn`: the best of `repeats` rounds of at least `min_time_s / repeats`
    each. The minimum is the least disturbed estimate on a shared machine (as `timeit` advises);
    the rounds' spread is noise from other processes, not a property of the code. A call
    slower than `min_time_s` is timed once after the warm-up (rounds would take minutes)."""
    start = time.perf_counter()
    fn()  # warm caches and allocator pools: the first call is not what a steady run pays
    if time.perf_counter() - start > min_time_s:
        repeats = 1
    round_s = min_time_s / repeats
    best = float("inf")
    for _ in range(repeats):
        n, start = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed >= round_s:
                break
        best = min(best, elapsed / n)
    return best


def slope(x: Sequence[float], y: Sequence[float]) -> float:
    """Least-squares slope of y over x (NaN with fewer than 3 points)."""
    if len(x) < 3:
        return float("nan")
    return float(np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)[0])


def rss_bytes() -> int:
    return int(psutil.Process().memory_info().rss)


def new_figure(
    nrows: int, ncols: int, *, width: float = 6.0, height: float = 4.2
) -> tuple[Any, list[Any]]:
    """A figure of nrows x ncols panels (flattened, row by row) whose layout leaves room for
    a suptitle."""
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False, layout="constrained"
    )
    return fig, list(axes.ravel())
