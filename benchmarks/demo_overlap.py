"""How much async generation overlaps training: the demo at max_staleness 0, 1 and 2.

Each setting runs `asyncroll demo` (real vLLM on the tiny model, GRPO in torch, weight sync every
step) for the same number of steps from the same seed, with early stopping off. Per setting:

- step s: median wall time per training step;
- trainer idle: share of wall time the trainer waited inside `produce_batch`;
- generation idle: share of wall time the producer had no group in flight (`idle_s`);
- ideal: the overlap bound. At max_staleness 0 nothing overlaps, so a step is generate (G, the
  trainer's wait) then train + weight sync (T, the rest of the step). Perfect overlap would make
  a step max(G, T) long, a speed-up of (G + T) / max(G, T).

    python benchmarks/demo_overlap.py            # 3 x 30 steps, ~2 min on 2 cores
    python benchmarks/demo_overlap.py --quick    # 3 x 10 steps
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from _common import DEFAULT_OUT, info_line, new_figure, print_section, run_info, save_outputs

from asyncroll.app.demo import DemoConfig, run_demo
from asyncroll.app.demo_report import StepRecord


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--quick", action="store_true", help="10 steps per setting")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    steps = 10 if args.quick else args.steps
    runs: dict[int, list[StepRecord]] = {}
    for staleness in args.staleness:
        with tempfile.TemporaryDirectory() as tmp:
            config = DemoConfig(steps=steps, max_staleness=staleness, out=tmp, solved_reward=0.0)
            print(f"max_staleness={staleness}: {steps} steps", file=sys.stderr, flush=True)
            runs[staleness] = asyncio.run(run_demo(config, progress=True))
    report(runs, args.out)
    return 0


def summarise(records: list[StepRecord]) -> dict[str, float]:
    steady = records[1:] or records  # the first step also waits for the first batch to fill
    wall = sum(r.wall_s for r in steady)
    return {
        "step_s": float(np.median([r.wall_s for r in steady])),
        "generate_s": float(np.median([r.wait_s for r in steady])),
        "rest_s": float(np.median([r.wall_s - r.wait_s for r in steady])),
        "trainer_idle": sum(r.wait_s for r in steady) / wall,
        "generation_idle": sum(r.idle_s for r in steady) / wall,
        "reward_end": float(np.mean([r.reward for r in records[-3:]])),
    }


def report(runs: dict[int, list[StepRecord]], out: Path) -> None:
    stats = {s: summarise(r) for s, r in runs.items()}
    base = stats.get(0)
    ideal_step = max(base["generate_s"], base["rest_s"]) if base else float("nan")
    bound = (base["generate_s"] + base["rest_s"]) / ideal_step if base else float("nan")
    rows: list[list[Any]] = []
    for s, st in stats.items():
        speedup = base["step_s"] / st["step_s"] if base else float("nan")
        rows.append([s, st["step_s"], f"{speedup:.2f}x", f"{st['trainer_idle']:.0%}",
                     f"{st['generation_idle']:.0%}", st["reward_end"]])  # fmt: skip
    text = "## Demo overlap: real vLLM on CPU, GRPO in torch, weight sync every step\n\n"
    text += info_line(run_info()) + "\n"
    text += print_section(
        "Per max_staleness (medians over steps 2..N)",
        ["max_staleness", "step s", "speed-up vs 0", "trainer idle", "generation idle",
         "reward, last 3"],
        rows,
    )  # fmt: skip
    if base:
        text += print_section(
            "Ideal overlap bound (from max_staleness 0)",
            ["generate G s", "train + sync T s", "ideal step max(G,T) s", "bound (G+T)/max"],
            [[base["generate_s"], base["rest_s"], ideal_step, f"{bound:.2f}x"]],
        )
    fig, axes = new_figure(1, 2, width=5.5, height=3.6)
    labels = [str(s) for s in stats]
    axes[0].bar(labels, [st["step_s"] for st in stats.values()], color="#1f77b4")
    if base:
        axes[0].axhline(ideal_step, color="k", linestyle="--", label="ideal max(G, T)")
        axes[0].legend()
    axes[0].set(title="median wall time per step", xlabel="max_staleness", ylabel="s")
    width = 0.38
    x = np.arange(len(labels))
    axes[1].bar(x - width / 2, [st["trainer_idle"] for st in stats.values()], width,
                label="trainer idle")  # fmt: skip
    axes[1].bar(x + width / 2, [st["generation_idle"] for st in stats.values()], width,
                label="generation idle")  # fmt: skip
    axes[1].set(title="idle share of wall time", xlabel="max_staleness", ylim=(0, 1))
    axes[1].set_xticks(x, labels)
    axes[1].legend()
    payload = {"summary": stats, "runs": {s: msgspec.to_builtins(r) for s, r in runs.items()}}
    save_outputs(out, "demo_overlap", fig, payload, text)


if __name__ == "__main__":
    sys.exit(main())
