"""`VLLMServerEngine.pause_bound_s` is a bound: a pause or resume ends within it whatever holds
the control lock when it starts (the end of a pause its caller gave up on, a replica owner's
catch-up) and however many replicas re-sync meanwhile. Run on the control-plane simulation's
virtual clock (`benchmarks/control_sim.py`: simulated replicas, no sockets, no sleeps), where
a control call takes exactly as long as the test says."""

from __future__ import annotations

import asyncio
import random
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import control_sim

from asyncroll.engines import VLLMServerEngine
from asyncroll.engines.server.replicas import ReplicaState

PAUSE_S = 0.5  # the engine's pause_timeout_s (virtual seconds)
SLOW_S = 0.2  # a slow replica's answer to the routes it is slow on: under PAUSE_S


class SlowReplica(control_sim.SimReplica):
    """A simulated replica that answers the routes in `slow` `SLOW_S` late (within every
    deadline), and notes each route it was called on (a stream as "generate REQUEST_ID")."""

    def __init__(self, world: control_sim.World, name: str, own: Path) -> None:
        super().__init__(world, name, own, random.Random(name))
        self.slow: set[str] = set()
        self.routes: list[str] = []
        self.called = asyncio.Event()

    async def handle(self, method: str, path: str, body: Any) -> tuple[int, bytes]:
        route = path.split("?")[0]
        self._note(route)
        if route in self.slow:
            await asyncio.sleep(SLOW_S)
        return await super().handle(method, path, body)

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        self._note(f"generate {body['request_id']}")
        async for chunk in super().stream(body):
            yield chunk

    def _note(self, route: str) -> None:
        self.routes.append(route)
        self.called.set()
        self.called = asyncio.Event()

    async def until_called(self, route: str) -> None:
        while route not in self.routes:
            await self.called.wait()


def _simulated(
    test: Callable[..., Awaitable[None]],
    replicas: int,
    tmp: Path,
    kind: type[SlowReplica] = SlowReplica,
) -> None:
    """Run `test(engine, loop, sims)` on a virtual clock against `replicas` simulated ones
    (of `kind`)."""
    loop = control_sim.VirtualLoop()
    world = control_sim.World(tmp, verbose=False)
    world.loop = loop
    own = world.folder("own", 0)
    sims = {f"r{i}": kind(world, f"r{i}", own) for i in range(replicas)}
    engine = VLLMServerEngine(
        [f"http://{name}" for name in sims],
        vocab_size=control_sim.STRIDE * 1024,
        health_interval_s=0.05,
        liveness_timeout_s=PAUSE_S,
        pause_timeout_s=PAUSE_S,
        sessions=lambda limit: control_sim.SimSession(sims, limit),  # type: ignore[arg-type,return-value]
    )

    async def main() -> None:
        async with engine:
            await test(engine, loop, list(sims.values()))

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


async def _timed(loop: asyncio.AbstractEventLoop, call: Callable[[], Awaitable[None]]) -> float:
    start = loop.time()
    await call()
    return loop.time() - start


def test_a_pause_behind_a_cut_pauses_end_and_every_replicas_catch_up_keeps_its_bound(
    tmp_path: Path,
) -> None:
    """The control lock is held by the end of a pause its caller gave up on (resuming a slow
    replica), and two replicas that re-synced wait for it to catch up under it (their label
    read and resume, slow too): the next pause waited for all three in turn, past
    `pause_bound_s` (2 x `pause_timeout_s` then), which the producer holds its
    `abort_timeout_s` above."""

    async def test(
        engine: VLLMServerEngine, loop: asyncio.AbstractEventLoop, sims: list[SlowReplica]
    ) -> None:
        await engine.check_replicas()
        assert all(r.state is ReplicaState.UP for r in engine.replicas)
        sims[0].slow = {"/pause", "/resume"}
        sims[0].routes.clear()
        cut = asyncio.ensure_future(engine.pause_generation())
        await sims[0].until_called("/pause")
        cut.cancel()  # the producer's abort_timeout_s: the undo (a resume) is the engine's
        await asyncio.gather(cut, return_exceptions=True)
        for replica, sim in zip(engine.replicas[1:], sims[1:], strict=True):
            replica.mark_unsynced("restarted")
            sim.slow = {"/weight_info", "/resume"}
            sim.routes.clear()
        syncs = asyncio.ensure_future(engine.check_replicas())
        for sim in sims[1:]:
            await sim.until_called("/update_weight_version")
        # virtual time: the labels' replies arrive (a simulated call takes up to 5 ms) and
        # each replica's owner queues for the control lock, behind the cut pause's end
        await asyncio.sleep(0.05)
        assert engine._state.lock.locked()
        took = await _timed(loop, engine.pause_generation)
        assert took <= engine.pause_bound_s, f"{took:.3f} s > {engine.pause_bound_s} s"
        took = await _timed(loop, engine.resume_generation)
        assert took <= engine.pause_bound_s, f"{took:.3f} s > {engine.pause_bound_s} s"
        await syncs
        assert all(not sim.paused for sim in sims)

    _simulated(test, 3, tmp_path)


def test_a_pause_with_no_replica_up_does_not_wait_for_their_syncs(tmp_path: Path) -> None:
    """No replica is up (the engine's start, or every replica re-syncing after a cut
    update): the pause waited up to `pause_timeout_s` for their syncs, then for each one's
    catch-up under the control lock, past `pause_bound_s`. A replica that joins later reads
    whether the engine is paused under that lock, and is paused then."""

    async def test(
        engine: VLLMServerEngine, loop: asyncio.AbstractEventLoop, sims: list[SlowReplica]
    ) -> None:
        for sim in sims:
            sim.slow = {"/weight_info", "/resume"}
        took = await _timed(loop, engine.pause_generation)
        assert took <= engine.pause_bound_s, f"{took:.3f} s > {engine.pause_bound_s} s"
        await engine.check_replicas()
        assert all(r.state is ReplicaState.UP for r in engine.replicas)
        assert all(sim.paused for sim in sims)  # joined paused, as the engine is
        took = await _timed(loop, engine.resume_generation)
        assert took <= engine.pause_bound_s, f"{took:.3f} s > {engine.pause_bound_s} s"
        assert all(not sim.paused for sim in sims)

    _simulated(test, 3, tmp_path)
