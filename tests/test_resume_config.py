"""Resuming a checkpoint under another configuration: every `ProducerConfig` field changed
between save and load. Each change either continues correctly (every prompt ends once, no group
handed out staler than the new `max_staleness`, batches of the new `batch_size`, the ledger
holds) or is refused by `load` with a message that names the field, leaving the producer as it
was. SimEngine (a simulation) generates; the checkpoint is built the same way every time.

The saved run: 64 prompts, groups of 2, batch_size=8, max_staleness=1, the trainer updating
after every batch. After 3 batches the staleness capacity ((1 + 3 + 1) x 8 = 40 groups) is
full: 24 consumed, 10 ready and 6 held in the engine (`ParkingEngine`), which the save aborts
into partial groups of 3 tokens a sample. That is the checkpoint every cell loads.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from asyncroll import (
    DropRecord,
    Producer,
    PutOutcome,
    RolloutGroup,
    SamplingConfig,
    SimEngine,
    single_turn,
)
from asyncroll._core.state import loads
from asyncroll.config import ProducerConfig
from asyncroll.engines.base import GenerateRequest, SampleOutput

GUARD_S = 60.0  # only against hangs: every wait below ends on an event long before
VOCAB = 1000
PROMPTS = 64
PARK_FROM = 34  # prompts from this index on are held in the engine until aborted
HEAD = 3  # tokens a held request has generated when the save aborts it
BASE: dict[str, Any] = {
    "group_size": 2,
    "batch_size": 8,
    "max_staleness": 1,
    "max_buffer_groups": 64,
    "sampling": SamplingConfig(max_new_tokens=8),
}


def prompt_list() -> list[list[int]]:
    return [[2 + i, 7, 9] for i in range(PROMPTS)]  # the first token names the prompt


def ones(group: RolloutGroup) -> list[float]:  # synchronous: runs on the reward workers
    return [1.0] * group.num_samples


class ParkingEngine(SimEngine):
    """SimEngine, except that fresh requests of prompts from `PARK_FROM` on report `HEAD`
    tokens a sample and wait until aborted (or closed): requests caught in flight by a save,
    deterministically."""

    def __init__(self) -> None:
        super().__init__(vocab_size=VOCAB)
        self.parked: dict[str, asyncio.Event] = {}

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        fresh = all(len(s.prefix) == 0 for s in request.samples)
        if not fresh or int(request.prompt_tokens[0]) - 2 < PARK_FROM:
            return await super().generate(request)
        rid = request.request_id
        if self._recent.take_early_abort(rid):
            return await super().generate(request)  # answers the early abort
        released = self.parked[rid] = asyncio.Event()
        try:
            await released.wait()
        finally:
            del self.parked[rid]
            self._recent.ended(rid)
        n = [min(HEAD, s.max_new_tokens) for s in request.samples]
        return [
            SampleOutput(
                tokens=np.full(k, 5, np.int32),
                logprobs=np.full(k, -1.0, np.float32),
                versions=np.full(k, self.version, np.int32),
                finish_reason="abort" if k < s.max_new_tokens else "length",
            )
            for k, s in zip(n, request.samples, strict=True)
        ]

    async def abort(self, request_id: str) -> None:
        if request_id in self.parked:
            self.parked[request_id].set()
        else:
            await super().abort(request_id)

    async def close(self) -> None:
        for released in self.parked.values():
            released.set()
        await super().close()


async def save_mid_run(path: Path, *, episodes: bool) -> list[str]:
    """Run the saved run (module docstring) and save it to `path`; the prompt ids consumed."""
    engine = ParkingEngine()
    producer = Producer(
        engine, prompt_list(), ones, rollout_fn=single_turn if episodes else None, **BASE
    )
    consumed: list[str] = []
    async with producer, asyncio.timeout(GUARD_S):
        for _ in range(3):
            batch = await producer.produce_batch()
            consumed += [g.prompt_id for g in batch.groups]
            await producer.update_weights(None)
        await producer._changed.wait_until(
            lambda: producer.buffer.num_ready == 10 and len(producer._inflight) == 6, GUARD_S
        )
        calls = 6 * (BASE["group_size"] if episodes else 1)  # an episode calls per sample
        await engine.wait_progress(lambda: len(engine.parked) == calls, GUARD_S)
        await producer.save(path)
    state = loads(await asyncio.to_thread(path.read_bytes))
    assert (state.version, state.counters.consumed_groups) == (3, 24)
    assert (len(state.ready), len(state.resume)) == (10, 6), "the saved run is not the one meant"
    return consumed


# field -> [(new value, expected: "continue" or "refuse")]. Every field is listed (a test
# checks), so a field added to ProducerConfig needs its row here.
MATRIX: dict[str, list[tuple[Any, str]]] = {
    "group_size": [(3, "refuse")],  # stored groups hold 2 samples each
    "sampling": [
        (SamplingConfig(max_new_tokens=2), "continue"),  # partials finish as "length"
        (SamplingConfig(max_new_tokens=16), "continue"),
        (SamplingConfig(max_new_tokens=8, temperature=0.5, seed=3), "continue"),
        (
            SamplingConfig(
                max_new_tokens=8, top_p=0.9, top_k=5, stop_token_ids=(1,), ignore_eos=True
            ),
            "continue",
        ),
    ],
    "batch_size": [(4, "continue"), (16, "continue")],
    "max_staleness": [(0, "continue"), (3, "continue"), (None, "continue")],
    "oversample": [(2.0, "continue")],
    "max_inflight_groups": [(2, "continue")],
    "max_buffer_groups": [(15, "refuse"), (16, "continue")],  # the checkpoint holds 16
    # "tight": just room for one batch of groups at their largest (smaller: no run can fill one)
    "max_buffer_bytes": [("tight", "continue"), (1 << 20, "continue")],
    "max_extra_bytes": [(0, "continue")],  # the run's samples carry no extra
    "order": [("stalest", "continue")],
    "pause_mode": [("keep", "continue")],
    "generate_timeout_s": [(5.0, "continue")],
    "reward_timeout_s": [(5.0, "continue")],
    "abort_timeout_s": [(5.0, "continue")],
    "update_timeout_s": [(5.0, "continue")],
    "prompt_timeout_s": [(5.0, "continue")],
    "reward_workers": [(1, "continue")],
    "reward_in_thread": [(False, "continue")],
    "reward_executor": [("process", "continue")],
    "reward_worker_max_calls": [(1, "continue")],
    "reward_worker_max_mib": [(64.0, "continue")],
    "max_dropped_in_a_row": [(2, "continue"), (None, "continue")],
    "max_reward_failures_at_start": [(2, "continue"), (None, "continue")],
    "on_drop_timeout_s": [(1.0, "continue")],
    "failure_log_interval_s": [(0.0, "continue")],
    "max_turns": [(1, "continue")],
    "max_episode_tokens": [(4, "continue"), (64, "continue")],
    "episode_timeout_s": [(30.0, "continue")],
}


def short(value: Any) -> str:
    """A cell's id: a SamplingConfig by the fields it changes."""
    if isinstance(value, SamplingConfig):
        default = SamplingConfig()
        changed = [f for f in value.__struct_fields__ if getattr(value, f) != getattr(default, f)]
        return ",".join(f"{f}={getattr(value, f)!r}" for f in changed).replace(" ", "")
    return repr(value)


CELLS = [
    pytest.param(field, value, expected, id=f"{field}={short(value)}")
    for field, changes in MATRIX.items()
    for value, expected in changes
]


def test_the_matrix_covers_every_config_field() -> None:
    assert set(MATRIX) == set(ProducerConfig.__struct_fields__)


@pytest.mark.parametrize("episodes", [False, True], ids=["single-turn", "episodes"])
@pytest.mark.parametrize(("field", "value", "expected"), CELLS)
async def test_a_checkpoint_resumed_with_one_field_changed(
    tmp_path: Path, field: str, value: Any, expected: str, episodes: bool
) -> None:
    consumed_before = await save_mid_run(tmp_path / "ckpt", episodes=episodes)
    rollout_fn = single_turn if episodes else None
    if value == "tight":
        probe = Producer(SimEngine(vocab_size=VOCAB), [], ones, rollout_fn=rollout_fn, **BASE)
        value = BASE["batch_size"] * probe._core.group_bytes + 100
    options = {**BASE, field: value}
    drops: list[DropRecord] = []

    def resumed() -> Producer:
        return Producer(
            SimEngine(vocab_size=VOCAB), prompt_list(), ones, rollout_fn=rollout_fn,
            on_drop=drops.append, **options,
        )  # fmt: skip

    producer = resumed()
    if expected == "refuse":
        with pytest.raises(ValueError, match=rf"\b{field}\b"):
            producer.load(tmp_path / "ckpt", weights=None)
        assert producer.state_dict() == resumed().state_dict(), "a refused load changed it"
        assert producer.version == 0 and not drops
        return
    producer.load(tmp_path / "ckpt", weights=None)
    cfg = producer.config
    batches = []
    async with producer, asyncio.timeout(GUARD_S):
        async for batch in producer.batches():
            producer.check_ledger()
            batches.append(batch)
            await producer.update_weights(None)
    producer.check_ledger()
    consumed = [g for b in batches for g in b.groups]
    ends = Counter(consumed_before)
    ends.update(g.prompt_id for g in consumed)
    ends.update(d.prompt_id for d in drops if d.outcome is not PutOutcome.DROPPED_EXPIRED)
    assert set(ends.values()) == {1}, [p for p, n in ends.items() if n != 1]
    assert len(ends) == PROMPTS
    if cfg.max_staleness is not None:
        stale = [b.version - g.min_version for b in batches for g in b.groups]
        assert max(stale) <= cfg.max_staleness
    assert all(len(b.groups) == cfg.batch_size for b in batches[:-1])


async def test_a_checkpoint_without_a_schedule_anchors_it_at_the_groups_consumed(
    tmp_path: Path,
) -> None:
    """A state without `scheduled_groups` (a run without batch_size, or an older file) starts
    the staleness schedule where the run is: it resumes at another batch_size without a stall."""
    await save_mid_run(tmp_path / "ckpt", episodes=False)
    state = loads(await asyncio.to_thread((tmp_path / "ckpt").read_bytes))
    assert state.scheduled_groups == 24  # 3 versions x batch_size 8
    producer = Producer(
        SimEngine(vocab_size=VOCAB), prompt_list(), ones, **{**BASE, "batch_size": 4}
    )
    producer.load_state_dict(msgspec.structs.replace(state, scheduled_groups=None), weights=None)
    assert producer.state_dict().scheduled_groups == 24  # anchored at consumed_groups
    async with producer, asyncio.timeout(GUARD_S):
        async for _ in producer.batches():
            await producer.update_weights(None)
    assert producer.check_ledger().consumed_groups == PROMPTS  # 24 before, 40 after
