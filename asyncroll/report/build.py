"""Write the static report of a run: `index.html`, the page's own `report.js` and `report.css`,
and its data as scripts under `data/` (`run.js`, then `chunk-NNNNN.js` per chunk of steps).

The data are scripts that call the page's global loader (`asyncrollReport.run(...)`,
`asyncrollReport.chunk(...)`), not JSON files, because a page opened from disk (file://) may
add a `<script src>` but may not fetch a file: that is what lets the report open with no
server. The page adds a chunk's script when a group of it is shown, so a long run's page
loads its index and its curves only.
"""

from __future__ import annotations

import html
import os
import shutil
from importlib import resources
from pathlib import Path

import msgspec

from asyncroll.report.data import STEPS_PER_CHUNK, ChunkInfo, ReportData, read_report_data

REPORT_DIR = "report"
ASSETS = ("report.js", "report.css")
_encoder = msgspec.json.Encoder()


def build_report(
    run_dir: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    *,
    steps_per_chunk: int = STEPS_PER_CHUNK,
) -> Path:
    """Turn a run's record (`<run_dir>/record/`) into a static HTML report in `out` (default
    `<run_dir>/report/`) and return the path of its `index.html`, which opens from disk in a
    browser with no server and no network.

    `steps_per_chunk`: steps per data file the page loads on demand (the first view loads
    none). Raises `asyncroll.record.RecordError` naming the folder when the run has no record
    or its record holds no lines. A report already in `out` is replaced.
    """
    data = read_report_data(run_dir, steps_per_chunk)
    target = Path(out) if out is not None else Path(run_dir) / REPORT_DIR
    target.mkdir(parents=True, exist_ok=True)
    folder = target / "data"
    if folder.exists():
        shutil.rmtree(folder)  # a previous build's chunks would be loaded by nothing but linger
    folder.mkdir()
    data.summary.chunks = _write_chunks(data, folder)
    (folder / "run.js").write_bytes(
        b"asyncrollReport.run(" + _encoder.encode(data.summary) + b");\n"
    )
    assets = resources.files("asyncroll.report") / "assets"
    for name in ASSETS:
        (target / name).write_bytes((assets / name).read_bytes())
    page = (assets / "index.html").read_text(encoding="utf-8")
    title = html.escape(f"asyncroll report: {Path(run_dir).resolve().name}")
    index = target / "index.html"
    index.write_text(page.replace("{{title}}", title), encoding="utf-8")
    return index


def _write_chunks(data: ReportData, folder: Path) -> list[ChunkInfo]:
    chunks = []
    for chunk in sorted(data.groups.keys() | data.train.keys()):
        name = f"data/chunk-{chunk:05d}.js"
        groups = data.groups.get(chunk, [])
        body = b"".join((
            f"asyncrollReport.chunk({chunk},[".encode(),
            b",".join(groups),
            b"],[",
            b",".join(data.train.get(chunk, [])),
            b"]);\n",
        ))  # fmt: skip
        (folder / name.removeprefix("data/")).write_bytes(body)
        first = chunk * data.steps_per_chunk
        chunks.append(
            ChunkInfo(
                chunk=chunk,
                file=name,
                first_step=first,
                last_step=first + data.steps_per_chunk - 1,
                groups=len(groups),
                bytes=len(body),
            )
        )
    return chunks
