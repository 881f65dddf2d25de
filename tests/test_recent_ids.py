"""`RecentIds`: the memory behind every engine's abort contract (see `Engine`)."""

from __future__ import annotations

from asyncroll.engines.base import RecentIds


def test_an_early_abort_is_taken_once_and_an_ended_id_is_never_aborted() -> None:
    ids = RecentIds()
    ids.abort_unknown("a")
    assert ids.take_early_abort("a") and not ids.take_early_abort("a")
    ids.ended("b")
    ids.abort_unknown("b")  # after it returned: nothing happens to it
    assert not ids.take_early_abort("b")
    assert not ids.take_early_abort("never-seen")


def test_memory_stays_bounded_and_keeps_the_newest_ids() -> None:
    ids = RecentIds(limit=8)
    for i in range(10_000):
        ids.ended(f"done-{i}")
        ids.abort_unknown(f"early-{i}")
    assert len(ids._ids) == 8
    assert ids.take_early_abort("early-9999") and not ids.take_early_abort("early-0")
