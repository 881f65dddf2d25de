"""What tests on several pytest-xdist workers need from a costly setup, made once a run.

The suite's lanes (`tests/conftest.py`) put tests on the workers that hold their session
engines; a module split between two lanes would otherwise build its module fixtures on both.
`made_once` writes such a fixture's result to a folder that every worker of the run shares,
under a file lock: the first worker to ask makes it, the others wait and read it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from filelock import FileLock

DEADLINE_S = 540.0  # for another worker's `make` (fresh vLLM engines on a loaded CPU)


def run_temp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This run's temporary folder that every xdist worker shares (each worker's own is in it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


async def made_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], Awaitable[None]]
) -> Path:
    """The folder `name` in `run_temp`, filled by `make` once a run: by the first worker to
    ask, while the others wait on a file lock (in a thread, so that the engines a waiting
    worker holds keep being served by its event loop). A folder whose `make` failed is made
    again from scratch by the next worker to ask."""
    root = run_temp(tmp_path_factory)
    folder, done = root / name, root / f"{name}.done"
    lock = FileLock(root / f"{name}.lock", thread_local=False)  # released on another thread
    await asyncio.to_thread(lock.acquire, timeout=DEADLINE_S)
    try:
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            await make(folder)
            done.touch()
    finally:
        lock.release()
    return folder
