"""The control plane's deterministic simulation (`benchmarks/control_sim.py`): seeds run clean,
a run is a function of its seed (a failure replays from it), and a defect put back is found."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import control_sim

from asyncroll.engines.server import client as server_client


def test_seeds_keep_every_invariant(tmp_path: Path) -> None:
    """A slice of the seeds `.ci/run` runs in full (`control_sim.py --seeds 10000`)."""
    for seed in range(150):
        control_sim.run_seed(seed, tmp_path)


def test_sluggish_seeds_keep_every_invariant(tmp_path: Path) -> None:
    """A slice of `.ci/run`'s second run (`--sluggish`: replicas whose control calls take up
    to 0.45 s, within every deadline)."""
    for seed in range(60):
        control_sim.run_seed(seed, tmp_path, sluggish=True)


def test_seeds_paused_elsewhere_keep_every_invariant(tmp_path: Path) -> None:
    """A slice of `.ci/run`'s third run (`--paused-elsewhere`: another client pauses a replica
    in mode "wait", which vLLM >= 0.33 answers new requests with a refusal). Before refused
    requests were sent again, seeds 69, 241 and 275 of the first 300 failed a request on a
    replica that was never faulty ("generate stream error: Generation is paused...")."""
    for seed in (*range(40), 69, 241, 275):
        control_sim.run_seed(seed, tmp_path, paused_elsewhere=True)


def test_a_seed_replays_event_for_event(tmp_path: Path) -> None:
    first = control_sim.run_seed(7, tmp_path, verbose=False)
    again = control_sim.run_seed(7, tmp_path, verbose=False)
    assert first == again and len(first) > 10


def test_a_shared_connection_pool_put_back_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control calls queued behind streams (one pool for both): aborts wait for a stream
    connection, and a healthy replica's `/pause` times out; the simulation names the seed."""
    monkeypatch.setattr(server_client.ReplicaClient, "control_session", lambda self: self.session())
    with pytest.raises(control_sim.Violation):
        for seed in range(400):
            control_sim.run_seed(seed, tmp_path)


def test_an_abort_that_cannot_reach_its_replica_still_ends_the_request(tmp_path: Path) -> None:
    """Seed 1282: an abort whose `/abort_requests` found its replica restarting ended
    nothing, and the request, frozen once the replica came back paused, ended 0.71 s after
    its abort (the bound is one control call and a token) when the pause no longer waited
    for syncs. The engine now closes the request's streams when its abort cannot reach the
    replica."""
    control_sim.run_seed(1282, tmp_path)
