"""The job folder of `Ranks` (asyncroll.distributed.folder): a failed job's folder is removed
by the last rank out, or by the next job's rank 0 once every process of its job is gone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from asyncroll.distributed import folder


@pytest.fixture
def tmp_tempdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    return tmp_path


def _ended_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _job(tmp: Path, name: str, rows: list[list[object]] | None) -> Path:
    path = tmp / f"{folder.PREFIX}{name}"
    path.mkdir()
    (path / "rank1.error").write_text("RuntimeError: boom")
    if rows is not None:
        (path / "job.json").write_text(json.dumps(rows))
    return path


def test_the_next_job_sweeps_only_folders_whose_processes_all_ended(tmp_tempdir: Path) -> None:
    me = psutil.Process()
    ended = _job(tmp_tempdir, "ended", [[_ended_pid(), None], [_ended_pid(), None]])
    half = _job(tmp_tempdir, "half", [[_ended_pid(), None], [me.pid, me.create_time()]])
    making = _job(tmp_tempdir, "making", None)  # mkdtemp done, job.json not yet written
    # a pid that now belongs to another process (this one) than the rank that had it
    reused = _job(tmp_tempdir, "reused", [[me.pid, me.create_time() - 100.0]])
    new = folder.make([me.pid])
    assert not ended.exists() and not reused.exists()
    assert half.exists() and making.exists() and new.exists()
    assert json.loads((new / "job.json").read_text()) == [[me.pid, me.create_time()]]


def test_the_last_rank_out_removes_the_folder(tmp_tempdir: Path) -> None:
    me = psutil.Process()
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    try:
        path = folder.make([me.pid, other.pid])
        assert not folder.remove_if_last(path, me.pid)  # the other rank still runs
        assert path.exists()
    finally:
        assert other.stdin is not None
        other.stdin.close()
        other.wait(timeout=30)
    assert folder.remove_if_last(path, me.pid)
    assert not path.exists()
