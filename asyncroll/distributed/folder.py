"""The job's folder: where a failing rank writes its error for the others (ranks share one
machine), and who removes it.

A run that ends well removes it at its last barrier. A run that fails has no such moment: the
ranks end one after another, each reading the others' errors as it goes, and none of them can
wait for the rest. So the folder names its job's processes (pid and start time, which a reused
pid does not share), the rank that finds every other one gone removes it as it ends, and rank 0
of the next job on the machine removes any folder whose processes are all gone (two ranks
ending at the same moment may each see the other alive).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time
from pathlib import Path

import psutil

PREFIX = "asyncroll-ranks-"
_JOB = "job.json"


def make(pids: list[int]) -> Path:
    """A new folder for a job of these processes (rank order), after sweeping ended jobs'."""
    sweep()
    path = Path(tempfile.mkdtemp(prefix=PREFIX))
    (path / _JOB).write_text(json.dumps([[pid, _started(pid)] for pid in pids]))
    return path


def remove_if_last(path: Path, me: int, wait_s: float = 0.0) -> bool:
    """Remove the folder if every process of its job but `me` is gone, looking for up to
    `wait_s` (a rank whose sockets closed may still be ending); whether it was removed."""
    jobs = _jobs(path)
    deadline = time.monotonic() + wait_s
    while any(pid != me and _running(pid, started) for pid, started in jobs.items()):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    shutil.rmtree(path, ignore_errors=True)
    return True


def sweep() -> None:
    """Remove the folders of jobs whose processes are all gone."""
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        jobs = _jobs(path)
        if jobs and not any(_running(pid, started) for pid, started in jobs.items()):
            shutil.rmtree(path, ignore_errors=True)


def _jobs(path: Path) -> dict[int, float | None]:
    with contextlib.suppress(OSError, ValueError, TypeError):
        return {int(pid): started for pid, started in json.loads((path / _JOB).read_text())}
    return {}


def _started(pid: int) -> float | None:
    with contextlib.suppress(psutil.Error):
        return float(psutil.Process(pid).create_time())
    return None


def _running(pid: int, started: float | None) -> bool:
    try:
        process = psutil.Process(pid)
        return bool(
            process.status() != psutil.STATUS_ZOMBIE
            and (started is None or process.create_time() == started)
        )
    except psutil.NoSuchProcess:
        return False
