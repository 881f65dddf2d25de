"""A version label names the process that took its weights: a `vllm serve` replica that
restarted between its load and its label (or whose label call, retried on a fresh connection,
reached the new process) serves its own weights, and must not serve them under the engine's
label. Run on the control-plane simulation's virtual clock (`benchmarks/control_sim.py`),
where a replica restarts exactly where the test says."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import control_sim

from asyncroll.engines import VLLMServerEngine
from asyncroll.engines.server.replicas import ReplicaState
from tests.test_server_pause_bound import SlowReplica, _simulated


class RestartingReplica(SlowReplica):
    """A simulated replica that restarts (a new process: its own weights, vLLM's initial
    label, no pause) just before it takes the next call to a route in `restart_at`; the new
    process answers that call."""

    def __init__(self, world: control_sim.World, name: str, own: Path) -> None:
        super().__init__(world, name, own)
        self.restart_at: set[str] = set()

    async def handle(self, method: str, path: str, body: Any) -> tuple[int, bytes]:
        route = path.split("?")[0]
        if route in self.restart_at:
            self.restart_at.discard(route)
            self.restart()
        return await super().handle(method, path, body)


def _serving(engine: VLLMServerEngine, sims: list[RestartingReplica]) -> list[tuple[str, int]]:
    """(label, weights) of each replica the engine counts up."""
    return [
        (sim.label, sim.weights)
        for replica, sim in zip(engine.replicas, sims, strict=True)
        if replica.state is ReplicaState.UP
    ]


@pytest.mark.parametrize("relabel", [False, True])
def test_a_replica_restarted_before_its_label_never_serves_under_it(
    tmp_path: Path, relabel: bool
) -> None:
    """The replica restarts between the update's load (or, for a relabel, its check of the
    replica's label) and the label call, which the new process takes: it served its own
    weights (0) under the new label (control_sim --sluggish seed 428: tokens of weights 0
    labelled 3). It leaves the rotation instead, and comes back synced."""

    async def test(
        engine: VLLMServerEngine, loop: asyncio.AbstractEventLoop, sims: list[RestartingReplica]
    ) -> None:
        await engine.check_replicas()
        folder = sims[0].world.folder("v1", 101)
        if relabel:
            await engine.update_weights_from_path(folder, version=1)
        sims[1].restart_at = {"/update_weight_version"}
        if relabel:
            await engine.update_weights(None, version=2)
        else:
            await engine.update_weights_from_path(folder, version=1)
        label = str(engine.version)
        assert _serving(engine, sims) == [(label, 101)] * len(_serving(engine, sims))
        assert engine.replicas[1].state is not ReplicaState.UP
        await engine.check_replicas()  # synced again: the engine's weights under its label
        assert _serving(engine, sims) == [(label, 101), (label, 101)]

    _simulated(test, 2, tmp_path, RestartingReplica)


def test_a_replica_restarted_before_its_catch_up_relabel_never_serves_under_it(
    tmp_path: Path,
) -> None:
    """A re-synced replica catches up under the control lock on a relabel that ran while it
    loaded; it restarts before that label call: its own weights would join under it."""

    async def test(
        engine: VLLMServerEngine, loop: asyncio.AbstractEventLoop, sims: list[RestartingReplica]
    ) -> None:
        await engine.check_replicas()
        await engine.update_weights_from_path(sims[0].world.folder("v1", 101), version=1)
        engine.replicas[1].mark_unsynced("restarted")
        sims[1].slow = {"/collective_rpc"}  # it loads while the relabel runs
        sync = asyncio.ensure_future(engine.check_replicas())
        await sims[1].until_called("/collective_rpc")
        sims[1].routes.clear()
        await engine.update_weights(None, version=2)
        sims[1].restart_at = {"/update_weight_version"}  # its catch-up's label
        await sync
        assert _serving(engine, sims) == [("2", 101)] * len(_serving(engine, sims))
        await engine.check_replicas()
        assert _serving(engine, sims) == [("2", 101), ("2", 101)]

    _simulated(test, 2, tmp_path, RestartingReplica)


def test_a_label_retried_on_the_restarted_process_is_found(tmp_path: Path) -> None:
    """Seed 428 of `control_sim.py --sluggish`: the label call reached the replica, which
    restarted before it answered; the client tried it again on a fresh connection (the call
    is idempotent), and the new process served weights 0 under label 3."""
    control_sim.run_seed(428, tmp_path, sluggish=True)
