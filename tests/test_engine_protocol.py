"""The `Engine` protocol is a promise: an engine written to the protocol of the release before
LoRA (the members `PRE_LORA` lists, and no others) runs with today's producer; a member
added since is optional with a documented default; a required member missing is named when
the producer is built. The engines below delegate to `SimEngine` (a simulation)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import pytest

from asyncroll import Producer, SamplingConfig, SimEngine
from asyncroll.engines.base import (
    OPTIONAL_MEMBERS,
    REQUIRED_MEMBERS,
    EngineDefaults,
    GenerateRequest,
    SampleOutput,
    Weights,
)
from tests.test_producer import VOCAB, parity_reward, prompts

GUARD_S = 60.0  # only against hangs
ROOT = Path(__file__).resolve().parents[1]

# The members of `Engine` as the release before LoRA documented them (asyncroll/engines/base.py
# and the README at 64773c4^1, the main line before the LoRA merge).
PRE_LORA = {
    "vocab_size", "max_model_len", "payload_bytes", "supports_keep_pause", "version",
    "generate", "abort", "pause_generation", "resume_generation", "update_weights", "close",
}  # fmt: skip


class PreLoraEngine:
    """A user's engine written to the pre-LoRA protocol, member for member (and no more)."""

    def __init__(self, **sim: Any) -> None:
        self._sim = SimEngine(vocab_size=VOCAB, **sim)

    @property
    def vocab_size(self) -> int:
        return self._sim.vocab_size

    @property
    def max_model_len(self) -> int | None:
        return None

    def payload_bytes(self, max_new_tokens: int) -> int:
        return 0

    @property
    def supports_keep_pause(self) -> bool:
        return True

    @property
    def version(self) -> int:
        return self._sim.version

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        return await self._sim.generate(request)

    async def abort(self, request_id: str) -> None:
        await self._sim.abort(request_id)

    async def pause_generation(self) -> None:
        await self._sim.pause_generation()

    async def resume_generation(self) -> None:
        await self._sim.resume_generation()

    async def update_weights(self, weights: Weights | None, *, version: int) -> None:
        await self._sim.update_weights(weights, version=version)

    async def close(self) -> None:
        await self._sim.close()


def public_members(cls: type) -> set[str]:
    return {name for name in vars(cls) if not name.startswith("_")}


def test_the_user_engine_below_is_the_pre_lora_protocol() -> None:
    assert public_members(PreLoraEngine) == PRE_LORA


def test_no_member_added_since_the_pre_lora_release_is_required() -> None:
    """A member added to `Engine` must come with a default (`EngineDefaults`): required
    members are those a pre-LoRA engine already has."""
    assert set(REQUIRED_MEMBERS) <= PRE_LORA
    assert not set(REQUIRED_MEMBERS) & set(OPTIONAL_MEMBERS)
    assert public_members(EngineDefaults) == set(OPTIONAL_MEMBERS)


@pytest.mark.parametrize("pause_mode", ["abort", "keep"])
async def test_a_pre_lora_engine_runs_end_to_end(
    tmp_path: Path, pause_mode: Literal["abort", "keep"]
) -> None:
    """Build, run with an update after every batch, save mid-run, resume on a second one:
    every prompt is consumed once."""

    def producer_on(engine: PreLoraEngine) -> Producer:
        return Producer(
            engine, prompts(24), parity_reward, group_size=2, batch_size=4, max_staleness=1,
            pause_mode=pause_mode, sampling=SamplingConfig(max_new_tokens=8),
        )  # fmt: skip

    first = producer_on(PreLoraEngine(per_token_latency_s=0.001))
    consumed = Counter[str]()
    async with first, asyncio.timeout(GUARD_S):
        for _ in range(2):
            batch = await first.produce_batch()
            consumed.update(g.prompt_id for g in batch.groups)
            await first.update_weights(None)
        async with first.pausing():
            pass
        await first.save(tmp_path / "ckpt")
    second = producer_on(PreLoraEngine())
    second.load(tmp_path / "ckpt", weights=None)
    async with second, asyncio.timeout(GUARD_S):
        async for batch in second.batches():
            consumed.update(g.prompt_id for g in batch.groups)
            await second.update_weights(None)
    second.check_ledger()
    assert len(consumed) == 24 and set(consumed.values()) == {1}


@pytest.mark.parametrize("member", sorted(REQUIRED_MEMBERS))
def test_a_missing_required_member_is_named_at_construction(member: str) -> None:
    lacking = type(
        "Lacking", (), {k: v for k, v in vars(PreLoraEngine).items() if k != member}
    )  # the same engine without `member`
    with pytest.raises(TypeError, match=rf"Lacking lacks the Engine member\(s\) \['{member}'\]"):
        Producer(lacking(), prompts(4), parity_reward)


class Delegating:
    """A wrapper that records requests and hands every other member to the engine it wraps,
    through `__getattr__`: a common way to instrument an engine (the agent tests do)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.requests = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, request: Any) -> Any:
        self.requests += 1
        return await self._engine.generate(request)


async def test_an_engine_that_delegates_through_getattr_has_its_members() -> None:
    """The members were looked up statically only, so a delegating wrapper "lacked" vocab_size
    and the rest; what `__getattr__` answers is a member. Its optional ones are read too."""

    class Bounded(SimEngine):
        pause_bound_s = 1.0  # type: ignore[assignment]

    with pytest.raises(ValueError, match=r"Delegating.pause_bound_s=1.0"):
        Producer(
            Delegating(Bounded(vocab_size=VOCAB)), prompts(4), parity_reward, abort_timeout_s=0.5
        )
    wrapper = Delegating(SimEngine(vocab_size=VOCAB))
    producer = Producer(
        wrapper, prompts(4), parity_reward, group_size=2, sampling=SamplingConfig(max_new_tokens=4)
    )
    async with producer:
        assert len((await producer.produce_batch(2)).groups) == 2
    assert wrapper.requests >= 2


def test_an_absent_pause_bound_s_is_no_bound_of_its_own() -> None:
    """The default (None): any `abort_timeout_s` is accepted; a stated bound is enforced."""
    Producer(PreLoraEngine(), prompts(4), parity_reward, abort_timeout_s=0.001)

    class Bounded(PreLoraEngine):
        pause_bound_s = 1.0

    with pytest.raises(ValueError, match=r"Bounded.pause_bound_s=1.0"):
        Producer(Bounded(), prompts(4), parity_reward, abort_timeout_s=0.5)


async def test_an_absent_adapter_slots_serves_no_adapters_so_an_adapter_update_pauses() -> None:
    """The default (None): no staleness window is refused for want of slots, and an adapter
    update pauses like a full-weight one (groups in flight are aborted first)."""
    from tests.test_lora_producer import adapter

    engine = PreLoraEngine(per_token_latency_s=0.05)  # 0.4 s a request
    producer = Producer(
        engine, prompts(8), parity_reward, group_size=2, batch_size=2, max_staleness=7,
        sampling=SamplingConfig(max_new_tokens=8),
    )  # fmt: skip
    async with producer:
        await engine._sim.wait_progress(lambda: engine._sim.running_requests > 0, GUARD_S)
        await producer.update_weights(adapter())
        assert producer.progress.counters.aborted_groups > 0


@pytest.mark.parametrize(
    ("member", "value"),
    [("adapter_slots", 0), ("adapter_slots", "2"), ("pause_bound_s", -1.0),
     ("pause_bound_s", float("nan"))],
)  # fmt: skip
def test_an_optional_member_of_the_wrong_kind_is_named(member: str, value: object) -> None:
    engine = type("Odd", (PreLoraEngine,), {member: value})()
    with pytest.raises(TypeError, match=rf"Odd.{member}={value!r}"):
        Producer(engine, prompts(4), parity_reward)


def test_the_protocol_page_lists_every_member() -> None:
    page = (ROOT / "docs" / "engine-protocol.md").read_text()
    for member in (*REQUIRED_MEMBERS, *OPTIONAL_MEMBERS):
        assert f"`{member}" in page, member


async def test_the_pages_minimal_engine_runs() -> None:
    """The page's example: built from its code block, run to the end."""
    page = (ROOT / "docs" / "engine-protocol.md").read_text()
    code = page.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/engine-protocol.md", "exec"), namespace)
    producer = namespace["producer"]
    async with producer, asyncio.timeout(GUARD_S):
        groups = [g async for batch in producer.batches(2) for g in batch.groups]
        await producer.update_weights(None)
    assert len(groups) == 4 and producer.engine.version == 1
    assert all(len(s.tokens) == 256 for g in groups for s in g.samples)
