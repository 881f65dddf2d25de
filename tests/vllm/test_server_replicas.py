"""Two `vllm serve` replicas behind one `VLLMServerEngine` (the session's server and one of
this test's own): sessions stick to a replica; a replica whose API server is SIGKILLed in the
middle of a Producer run fails only its own groups while the run goes on with the other and
the ledger holds; restarted, it rejoins with the engine's current version label.

Slow (a second server start, 30-55 s on 2 cores, twice) but part of the default run: the
replica guarantees have no cheaper honest test."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from asyncroll import DropRecord, Producer, PutOutcome, RolloutGroup, SamplingConfig
from asyncroll.engines import VLLMServerEngine
from asyncroll.engines.server.launch import ServerProcess
from asyncroll.engines.server.replicas import ReplicaState
from tests.vllm.conftest import DEADLINE_S
from tests.vllm.helpers import ids, request
from tests.vllm.server import ON_THE_SESSION_SERVER, SERVER_MAX_MODEL_LEN, server_engine_on

pytestmark = [pytest.mark.slow, ON_THE_SESSION_SERVER]


async def zero_reward(group: RolloutGroup) -> list[float]:
    return [0.0] * len(group.samples)


async def start_replica(model: Path, port: int | None = None) -> ServerProcess:
    return await asyncio.to_thread(
        ServerProcess.start, model, port=port, max_model_len=SERVER_MAX_MODEL_LEN
    )


async def served_by(engine: VLLMServerEngine, rid: str) -> int:
    """Run one small request; the index of the replica it went to."""
    before = [r.sent for r in engine.replicas]
    await engine.generate(request(rid, ids(0, 5, 6), n=2, max_new_tokens=4))
    (index,) = [i for i, r in enumerate(engine.replicas) if r.sent != before[i]]
    return index


async def test_sticky_sessions_a_killed_replica_and_its_return(
    vllm_server: ServerProcess, server_model: Path, server_weights_dir: Path
) -> None:
    second = await start_replica(server_model)
    engine = server_engine_on(
        [vllm_server.url, second.url], server_weights_dir, health_interval_s=60.0
    )
    try:
        # Sticky: every attempt of a session meets the same replica; sessions use both.
        homes = {}
        for k in range(24):
            where = {await served_by(engine, f"sticky{k}-{attempt}") for attempt in range(3)}
            assert len(where) == 1, f"session {k} moved between replicas: {where}"
            homes[k] = where.pop()
        assert set(homes.values()) == {0, 1}

        # SIGKILL the second replica's API server while it streams groups of a Producer run.
        drops: list[DropRecord] = []
        producer = Producer(
            engine,
            [[0, 5 + i % 40, 7] for i in range(24)],
            zero_reward,
            group_size=4,
            sampling=SamplingConfig(max_new_tokens=120, ignore_eos=True),
            max_inflight_groups=8,
            on_drop=drops.append,
        )
        killed = engine.replicas[1]
        consumed: list[RolloutGroup] = []
        async with producer:
            await engine.wait_progress(lambda: killed.streams >= 2, DEADLINE_S)
            second.kill_api_server()
            async with asyncio.timeout(10 * DEADLINE_S):
                async for batch in producer.batches(4):
                    producer.check_ledger()
                    consumed += batch.groups
        ledger = producer.check_ledger()
        failed = [d for d in drops if d.outcome is PutOutcome.DROPPED_FAILED]
        assert failed, "the killed replica's groups should have failed"
        assert all(second.url in (d.error or "") for d in failed), [d.error for d in failed]
        assert len(consumed) + len(failed) == 24 == ledger.started_groups
        assert ledger.in_flight_groups == 0 and len(consumed) >= 24 - 8
        assert killed.state is ReplicaState.DOWN and engine.replicas[0].state is ReplicaState.UP

        # Back on its port, it rejoins once probed, labelled with the engine's version.
        await engine.update_weights(None, version=2)  # only the first replica hears it
        second.stop()
        second = await start_replica(server_model, port=int(second.url.rsplit(":", 1)[1]))
        await engine.check_replicas()
        assert killed.state is ReplicaState.UP, killed.error
        session = next(k for k, home in homes.items() if home == 1)
        assert await served_by(engine, f"sticky{session}-9") == 1
        (out,) = await engine.generate(request(f"sticky{session}-10", ids(0, 5), max_new_tokens=4))
        assert (out.versions == 2).all()
    finally:
        await engine.close()
        await asyncio.to_thread(second.stop)
