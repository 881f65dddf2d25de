"""Checkpoints: exact continuation, atomic files, clear refusals (SimEngine: a simulation)."""

from __future__ import annotations

import asyncio
import os
import struct
from pathlib import Path
from typing import Any

import msgspec
import pytest

from asyncroll import (
    CheckpointError,
    DropRecord,
    Producer,
    ProducerExhausted,
    PutOutcome,
    RolloutGroup,
    TaskMix,
)
from asyncroll._core.state import STATE_FORMAT, dumps, loads
from asyncroll.types import Prompt
from tests.test_producer import (
    VOCAB,
    SimEngine,
    consume_all,
    freeze_mid_sample,
    make_producer,
    parity_reward,
    prompts,
)


def ends(consumed: list[RolloutGroup], drops: list[DropRecord]) -> list[str]:
    out = [g.prompt_id for g in consumed]
    out += [d.prompt_id for d in drops if d.outcome is not PutOutcome.DROPPED_EXPIRED]
    return sorted(out)


async def test_state_dict_continues_the_run_exactly() -> None:
    sim = {"per_token_latency_s": 0.0005, "fail_rate": 0.1, "lengths": "uniform"}
    drops_a: list[DropRecord] = []
    a = make_producer(120, sim=sim, max_new_tokens=32, on_drop=drops_a.append, filter="nonzero_std")
    consumed_a: list[RolloutGroup] = []
    async with a:
        for _ in range(3):
            consumed_a += (await a.produce_batch(8)).groups
        await a.update_weights(None)
        await freeze_mid_sample(a.engine)  # a group to abort part-way, however late it comes
        async with a.pausing():  # abort mode: in-flight work lands as partials first
            state = loads(dumps(a.state_dict()))
            drops_before = list(drops_a)
        await a.engine.resume_generation()
    assert state.version == 1 and state.resume  # partial groups are in the checkpoint

    drops_b: list[DropRecord] = []
    b = make_producer(120, sim=sim, max_new_tokens=32, on_drop=drops_b.append, filter="nonzero_std")
    b.load_state_dict(state, weights=None)
    assert b.version == 1
    b.check_ledger()  # the loaded run is balanced before it starts
    async with b:
        consumed_b = await consume_all(b, 8)
    b.check_ledger()
    assert ends(consumed_a + consumed_b, drops_before + drops_b) == sorted(
        f"default/{i}" for i in range(120)
    )  # every prompt ended exactly once across the two runs
    c = b.progress.counters
    assert c.started_groups == 120 and c.consumed_groups == len(consumed_a) + len(consumed_b)
    assert c.reward_count > state.counters.reward_count  # counters continued, not restarted
    assert c.resumed_groups > state.counters.resumed_groups  # the partials were resumed


async def test_save_while_running_and_load_from_file(tmp_path: Path) -> None:
    sim = {"per_token_latency_s": 0.0005, "fail_rate": 0.1, "lengths": "uniform"}
    a = make_producer(100, sim=sim, max_new_tokens=32)
    async with a:
        await a.produce_batch(8)
        await a.save(tmp_path / "ckpt")
    state = loads((tmp_path / "ckpt").read_bytes())
    ended_before = state.counters.consumed_groups + state.counters.failed_groups
    drops_b: list[DropRecord] = []
    b = make_producer(100, sim=sim, max_new_tokens=32, on_drop=drops_b.append)
    b.load(tmp_path / "ckpt")
    b.check_ledger()
    async with b:
        consumed_b = await consume_all(b, 8)
    ended_after = ends(consumed_b, drops_b)
    assert len(set(ended_after)) == len(ended_after)  # none twice
    assert ended_before + len(ended_after) == 100  # none missing


async def test_a_cancelled_save_returns_only_once_its_file_is_settled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread cannot be stopped: a save cancelled while its thread writes must wait for the
    write before it goes on, or the file would change under a caller who already moved on
    (loaded it, or recorded which checkpoint it has). Seen in the chaos soak: a session ended
    during a save, the next one loaded the file the abandoned write had replaced."""
    from asyncroll import producer as producer_mod
    from tests.test_cancelled_writes import HeldWrite, ended_at_once

    held = HeldWrite(producer_mod.write_atomic)
    monkeypatch.setattr(producer_mod, "write_atomic", held)
    target = tmp_path / "ckpt"
    a = make_producer(60, sim={"per_token_latency_s": 0.0005}, max_new_tokens=32)
    async with a:
        await a.produce_batch(8)
        save = asyncio.create_task(a.save(target))
        assert await asyncio.to_thread(held.entered.wait, 60)
        save.cancel()
        ended_before_its_write = await ended_at_once(save)
        held.go.set()
        with pytest.raises(asyncio.CancelledError):
            await save
        assert not ended_before_its_write
        assert loads(target.read_bytes()).counters.consumed_groups == 8  # the new file, whole
        await a.save(target)  # the producer goes on saving after a cancelled save


async def test_checkpoint_after_exit_holds_partials_and_ready_groups() -> None:
    producer = make_producer(60, sim={"per_token_latency_s": 0.001}, max_new_tokens=32)
    async with producer:
        await producer.produce_batch(4)
    state = producer.state_dict()
    ledger = producer.ledger()
    assert len(state.ready) == ledger.ready_groups and len(state.resume) == ledger.resume_groups
    again = loads(dumps(state))
    assert again == state


async def test_state_dict_refuses_while_groups_are_in_flight() -> None:
    producer = make_producer(60, sim={"per_token_latency_s": 0.01}, max_new_tokens=100)
    async with producer:
        with pytest.raises(TimeoutError):
            await producer.produce_batch(1, timeout=0.05)
        with pytest.raises(RuntimeError, match="in flight"):
            producer.state_dict()
        async with producer.pausing():
            assert producer.state_dict().resume  # abort mode drained them into partials


def corrupt(data: bytes) -> list[tuple[bytes, str]]:
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    future = bytearray(data)
    future[4:8] = struct.pack("<I", 99)
    return [
        (data[:10], "truncated"),
        (data[:-5], "truncated"),
        (bytes(flipped), "checksum"),
        (b"NOPE" + data[4:], "not an asyncroll checkpoint"),
        (bytes(future), "format 99"),
    ]


async def test_bad_checkpoints_fail_clearly_and_never_half_load(tmp_path: Path) -> None:
    producer = make_producer(30, sim={"per_token_latency_s": 0.001})
    async with producer:
        await producer.produce_batch(4)
    data = dumps(producer.state_dict())
    for bad, message in corrupt(data):
        path = tmp_path / "bad"
        path.write_bytes(bad)
        fresh = make_producer(30)
        with pytest.raises(CheckpointError, match=message):
            fresh.load(path)
        assert fresh.version == 0 and fresh.buffer.num_ready == fresh.buffer.num_resume == 0
        assert fresh.progress.counters.started_groups == 0


async def test_checkpoint_of_another_shape_is_refused() -> None:
    producer = make_producer(30)
    async with producer:
        await producer.produce_batch(4)
    state = producer.state_dict()
    with pytest.raises(CheckpointError, match="group_size"):
        make_producer(30, group_size=3).load_state_dict(state)
    mixed = Producer(
        SimEngine(vocab_size=VOCAB), TaskMix({"a": prompts(3)}), parity_reward, group_size=4
    )
    with pytest.raises(ValueError, match="tasks"):
        mixed.load_state_dict(state)
    wrong_version = msgspec.structs.replace(state, format=STATE_FORMAT + 1)
    with pytest.raises(CheckpointError, match=f"format {STATE_FORMAT + 1}"):
        make_producer(30).load_state_dict(wrong_version)
    running = make_producer(30)
    async with running:
        with pytest.raises(RuntimeError, match="before"):
            running.load_state_dict(state)


def test_write_is_atomic_and_leaves_no_temp_files(tmp_path: Path) -> None:
    from asyncroll._core.state import write_atomic

    target = tmp_path / "sub" / "ckpt"
    write_atomic(target, b"one")
    write_atomic(target, b"two")
    assert target.read_bytes() == b"two"
    assert os.listdir(target.parent) == ["ckpt"]


def test_failed_write_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncroll._core import state as state_mod

    target = tmp_path / "ckpt"
    state_mod.write_atomic(target, b"old")

    def broken_fsync(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(state_mod.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        state_mod.write_atomic(target, b"new")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["ckpt"]


@pytest.mark.parametrize(
    ("waiting", "fails"),
    [
        (range(1, 4), False),  # ids numpy reads but the codec cannot carry
        (Prompt(tokens=[1, 2], metadata={"handle": object()}), True),  # unstorable metadata
        ({"tokens": [1, 2], "prompt_id": 7}, True),  # an id a group cannot hold
    ],
)
async def test_a_prompt_waiting_for_capacity_survives_a_checkpoint(
    waiting: Any, fails: bool, tmp_path: Path
) -> None:
    """With `max_staleness` the next prompt is drawn and waits for capacity, so it is in
    nearly every checkpoint of such a run: put back in the stream, stored encoded. One whose
    ids or metadata do not encode made `save` raise `CodecError`, and one with an int
    `prompt_id` made a checkpoint that `load` refused."""
    source = [[1, 2, 3], waiting, [4, 5, 6]]

    def producer(drops: list[DropRecord]) -> Producer:
        return Producer(
            SimEngine(vocab_size=VOCAB), source, parity_reward, group_size=2, batch_size=1,
            max_staleness=0, on_drop=drops.append,
        )  # fmt: skip

    drops_a: list[DropRecord] = []
    a = producer(drops_a)
    async with a:
        consumed = (await a.produce_batch(1)).groups
        # the staleness capacity of version 0 (one group) is used up: the next prompt waits
        await a._changed.wait_until(lambda: a._staged is not None)
        await a.save(tmp_path / "ckpt")
    drops_b: list[DropRecord] = []
    b = producer(drops_b)
    b.load(tmp_path / "ckpt")
    async with b:
        while True:
            await b.update_weights(None)  # capacity for one more group
            try:
                consumed += (await b.produce_batch(1)).groups
            except ProducerExhausted:
                break
    b.check_ledger()
    drops = [d for d in drops_a + drops_b if d.prompt_id in ("default/1", "7")]
    assert len(consumed) == 3 - fails and len(drops) == fails
    assert len(ends(consumed, drops_a + drops_b)) == 3  # each prompt ended once


async def test_groups_loaded_into_a_tighter_max_staleness_expire_on_load() -> None:
    """The checkpoint does not fix `max_staleness`; a run resumed with a tighter bound handed
    out the loaded groups as they were, up to the old bound stale."""

    def producer(max_staleness: int | None, drops: list[DropRecord]) -> Producer:
        return Producer(
            SimEngine(vocab_size=VOCAB), prompts(8), parity_reward, group_size=2, batch_size=2,
            max_staleness=max_staleness, max_inflight_groups=8, on_drop=drops.append,
        )  # fmt: skip

    drops: list[DropRecord] = []
    a = producer(None, drops)
    async with a:
        await a._changed.wait_until(lambda: a.buffer.num_ready == 8)
        await a.update_weights(None)
        await a.update_weights(None)
    b = producer(0, drops)
    b.load_state_dict(a.state_dict(), weights=None)
    assert b.buffer.num_ready == 0 and b.progress.counters.expired_groups == 8
    assert {d.outcome for d in drops} == {PutOutcome.DROPPED_EXPIRED}
    b.check_ledger()
    consumed: list[RolloutGroup] = []
    async with b:
        async for batch in b.batches(2):
            assert batch.staleness_tokens().keys() == {0}
            consumed += batch.groups
            await b.update_weights(None)  # max_staleness=0: a new version after each batch
    assert sorted(g.prompt_id for g in consumed) == sorted(f"default/{i}" for i in range(8))
