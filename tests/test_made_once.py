"""`made_once`: a setup that tests on several xdist workers share is made by the first to ask,
once a run, and made again when it failed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.made_once import made_once, run_temp


def test_the_run_folder_is_shared_by_the_workers(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under xdist each worker's base temp is a folder of the run's own (popen-gw0, ...)."""
    base = tmp_path_factory.getbasetemp()
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    assert run_temp(tmp_path_factory) == base.parent
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert run_temp(tmp_path_factory) == base


async def test_made_by_the_first_caller_only(tmp_path_factory: pytest.TempPathFactory) -> None:
    calls: list[Path] = []

    async def make(folder: Path) -> None:
        calls.append(folder)
        (folder / "result").write_text(str(len(calls)))

    first = await made_once(tmp_path_factory, "once-test-first", make)
    again = await made_once(tmp_path_factory, "once-test-first", make)
    assert again == first and calls == [first]
    assert (first / "result").read_text() == "1"


async def test_a_failed_make_is_made_again_from_scratch(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """And its lock is released: the second call would wait out its deadline otherwise."""

    async def fails(folder: Path) -> None:
        (folder / "partial").write_text("half")
        raise RuntimeError("the fresh engine died")

    with pytest.raises(RuntimeError, match="died"):
        await made_once(tmp_path_factory, "once-test-failed", fails)

    async def make(folder: Path) -> None:
        assert not (folder / "partial").exists()
        (folder / "result").write_text("whole")

    folder = await made_once(tmp_path_factory, "once-test-failed", make)
    assert (folder / "result").read_text() == "whole"
