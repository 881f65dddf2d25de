"""A dead engine (its EngineCore process killed) surfaces as an error, never as a hang.

This kills the shared engine, so the conftest runs it after every other vLLM test.
"""

from __future__ import annotations

import asyncio
import os
import time

import psutil
import pytest

from asyncroll import Producer, ProducerError, SamplingConfig
from asyncroll.engines import EngineDeadError, VLLMEngine
from tests.vllm.conftest import DEADLINE_S
from tests.vllm.helpers import ids, request

pytestmark = pytest.mark.vllm

PROMPT_DEADLINE_S = 15.0  # how soon the death must surface (it takes well under a second)


def engine_processes() -> tuple[psutil.Process, list[psutil.Process]]:
    """vLLM's EngineCore process (a child of this one) and its workers."""
    cores = [
        p for p in psutil.Process(os.getpid()).children()
        if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())
    ]  # fmt: skip
    assert len(cores) == 1, [(p.pid, p.name()) for p in psutil.Process().children()]
    return cores[0], cores[0].children(recursive=True)


async def test_killed_engine_core_stops_the_producer(engine_to_kill: VLLMEngine) -> None:
    engine = engine_to_kill
    core, workers = engine_processes()
    producer = Producer(
        engine, [[0, 30 + i, 31] for i in range(40)], lambda g: [0.0] * g.num_samples,
        group_size=2, max_inflight_groups=4,
        sampling=SamplingConfig(max_new_tokens=200, ignore_eos=True),
    )  # fmt: skip
    start = engine.generated_tokens
    killed_at = []

    async def kill_while_generating() -> None:
        async with producer:
            await engine.wait_generated(start + 1, timeout=DEADLINE_S)
            core.kill()
            killed_at.append(time.monotonic())
            await producer.produce_batch(40, timeout=PROMPT_DEADLINE_S)

    with pytest.raises(ProducerError, match="engine died"):
        await kill_while_generating()
    assert time.monotonic() - killed_at[0] < PROMPT_DEADLINE_S
    with pytest.raises(EngineDeadError):
        await engine.generate(request("after-death", ids(0, 5), 2, 4))
    with pytest.raises(EngineDeadError):
        await engine.update_weights(None, version=1)
    # vLLM's orphaned worker notices its parent died and exits (about 3 s on 2 busy cores)
    _gone, alive = await asyncio.to_thread(psutil.wait_procs, workers, DEADLINE_S)
    for proc in alive:  # do not leave them to the next test run
        proc.kill()
    assert not alive, f"vLLM workers still running {DEADLINE_S} s after their engine died"
