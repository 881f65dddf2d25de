"""`on_drop` callbacks, sync and async, and the hostile ones: raising, hanging, ignoring their
cancellation, falling behind (SimEngine: a simulation)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from asyncroll import DropRecord, ProducerError, PutOutcome
from asyncroll._core import drops
from tests.test_producer import consume_all, make_producer

SIM = {"fail_rate": 0.3, "seed": 5}


def dropped(producer: Any) -> int:
    c = producer.progress.counters
    return int(c.failed_groups + c.filtered_groups + c.expired_groups)


async def test_async_callback_gets_every_record_and_never_blocks_landing() -> None:
    """The callback waits until the trainer has taken every batch: had landing waited on it,
    nothing would be consumed (the test's timeout would fail it)."""
    consumed = asyncio.Event()
    records: list[DropRecord] = []

    async def on_drop(record: DropRecord) -> None:
        await consumed.wait()
        records.append(record)

    producer = make_producer(
        120, sim=SIM, filter="nonzero_std", on_drop=on_drop, on_drop_timeout_s=3600.0
    )
    async with producer:
        groups = await consume_all(producer, 8)
        assert producer._drops.pending > 0 and not records  # queued, not delivered yet
        consumed.set()
    producer.check_ledger()
    assert groups and len(records) == dropped(producer) > 10
    assert {r.outcome for r in records} == {PutOutcome.DROPPED_FAILED, PutOutcome.DROPPED_FILTERED}
    assert len({r.uid for r in records}) == len(records)
    assert producer._drops.skipped == 0


async def test_async_records_arrive_in_landing_order(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[int] = []

    async def on_drop(record: DropRecord) -> None:
        await asyncio.sleep(0)  # a callback that suspends (the case under test), no wait
        seen.append(record.uid)

    caplog.set_level(logging.DEBUG, logger="asyncroll.producer")
    producer = make_producer(100, sim=SIM, on_drop=on_drop)
    async with producer:
        await consume_all(producer, 8)
    landed = [int(r.args[0]) for r in caplog.records if "dropped_" in r.getMessage()]  # type: ignore[index, call-overload]
    assert seen == landed and len(seen) > 10


async def test_async_callback_past_its_deadline_is_skipped_and_the_run_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def hangs(record: DropRecord) -> None:
        await asyncio.Event().wait()

    producer = make_producer(60, sim=SIM, on_drop=hangs, on_drop_timeout_s=0.01)
    async with producer:
        groups = await consume_all(producer, 8)
    assert producer.error is None and groups
    assert producer._drops.delivered == 0 and producer._drops.skipped == dropped(producer) > 5
    assert any("passed on_drop_timeout_s" in r.getMessage() for r in caplog.records)


async def test_async_callback_that_ignores_cancellation_stops_the_producer() -> None:
    release = asyncio.Event()

    async def stubborn(record: DropRecord) -> None:
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue

    producer = make_producer(60, sim=SIM, on_drop=stubborn, on_drop_timeout_s=0.01)
    try:
        with pytest.raises(ProducerError, match="ignored its cancellation"):
            async with producer:
                await consume_all(producer, 8)
    finally:
        release.set()
    assert "stubborn" in (producer.error or "")


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_callback_that_raises_stops_the_producer_with_its_name(kind: str) -> None:
    def broken(record: DropRecord) -> None:
        raise KeyError("no such prompt")

    async def broken_async(record: DropRecord) -> None:
        raise KeyError("no such prompt")

    callback = broken if kind == "sync" else broken_async
    producer = make_producer(60, sim=SIM, on_drop=callback)
    with pytest.raises(ProducerError, match=r"on_drop callback .*broken.* raised KeyError"):
        async with producer:
            await consume_all(producer, 8)
    producer.check_ledger()  # the accounting was done before the callback ran


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_callback_raising_a_base_exception_stops_the_producer(kind: str) -> None:
    """Not only an `Exception`: a sync callback's `BaseException` subclass escaped the landing
    (the group's task died with it, unnoticed until the end of the run, and the landing's
    wake-up was lost), so the run went on as if the callback had worked."""

    class Abort(BaseException):
        pass

    def broken(record: DropRecord) -> None:
        raise Abort("drop log closed")

    async def broken_async(record: DropRecord) -> None:
        raise Abort("drop log closed")

    callback = broken if kind == "sync" else broken_async
    producer = make_producer(60, sim=SIM, on_drop=callback)
    with pytest.raises(ProducerError, match=r"on_drop callback .*broken.* raised Abort"):
        async with producer:
            await consume_all(producer, 8)
    producer.check_ledger()


async def test_plain_function_returning_a_coroutine_is_refused() -> None:
    async def later(record: DropRecord) -> None:
        pass

    producer = make_producer(60, sim=SIM, on_drop=lambda record: later(record))
    with pytest.raises(ProducerError, match="declare it `async def`"):
        async with producer:
            await consume_all(producer, 8)


async def test_a_callback_far_behind_skips_records_instead_of_growing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(drops, "MAX_PENDING", 3)
    consumed = asyncio.Event()
    records: list[DropRecord] = []

    async def slow(record: DropRecord) -> None:
        await consumed.wait()
        records.append(record)

    producer = make_producer(100, sim=SIM, on_drop=slow, on_drop_timeout_s=3600.0)
    async with producer:
        await consume_all(producer, 8)
        queued = producer._drops.pending
        consumed.set()
    assert 0 < queued <= 3
    assert len(records) == queued + 1  # the one the callback was waiting on, and the queue
    assert producer._drops.skipped == dropped(producer) - len(records) > 0
    assert any("falls behind" in r.getMessage() for r in caplog.records)


def test_on_drop_must_be_callable_and_its_deadline_positive() -> None:
    with pytest.raises(ValueError, match="on_drop must be callable"):
        make_producer(1, on_drop="print")
    with pytest.raises(ValueError, match="on_drop_timeout_s=0"):
        make_producer(1, on_drop_timeout_s=0)
