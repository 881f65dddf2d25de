"""Smoke runs of the replica chaos run (`benchmarks/replica_chaos.py`): a `Producer` on a
`VLLMServerEngine` over FAKE replicas (`benchmarks/_fake_replica.py`, a simulation), one
scenario per test, a few seconds each.

Each asserts the run's invariants: every prompt ends exactly once, every token's label names
the weights that sampled it, the run never stops and drains, every update not deliberately
cut succeeds while a replica serves, and a wedged or garbage replica stops getting groups.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from replica_chaos import ChaosConfig, run_scenario

CONFIG = ChaosConfig(
    replicas=2,
    chaos_s=2.0,
    drain_s=20.0,
    episode_s=5.0,  # a wedged or garbage episode outlasts detect_bound_s (3.7 s here)
    max_inflight=8,
    generate_timeout_s=0.5,
    control_timeout_s=2.0,
    abort_timeout_s=5.0,  # a pause outlasts a hung control call: the deadlines compose
    pause_timeout_s=2.0,  # the pause bound (4 s) under abort_timeout_s
    update_timeout_s=10.0,
)
"""Deadlines with room for a loaded machine: with the benchmark's 0.3 s `pause_timeout_s`, a
healthy fake replica on a machine with ~7 runnable tasks per core answered a `/pause` or
`/resume` too late, every replica went down and the run stopped (the engine's correct answer
to replicas that do not answer, not what these tests check)."""

DEFAULT_RATIO = msgspec.structs.replace(CONFIG, abort_timeout_s=1.5, pause_timeout_s=0.7)
"""A pause's deadline below a control call's, as the defaults have it (30 s < 120 s): the engine's
own pause bound (`pause_bound_s`, 2 x `pause_timeout_s`) keeps them composing."""


@pytest.mark.parametrize(
    ("scenario", "config"),
    [
        pytest.param("slow", CONFIG, id="slow"),
        pytest.param("sigkill", CONFIG, id="sigkill"),
        pytest.param("cut_pause", CONFIG, id="cut_pause"),
        pytest.param("cut_load", CONFIG, id="cut_load"),
        pytest.param("cut_reset", CONFIG, id="cut_reset"),
        pytest.param("cut_label", CONFIG, id="cut_label"),
        pytest.param("garbage", CONFIG, id="garbage"),
        pytest.param("wedged", CONFIG, id="wedged"),
        pytest.param(
            "wedged", msgspec.structs.replace(CONFIG, pause_mode="abort"), id="wedged-abort"
        ),
        pytest.param("stalled_probe", DEFAULT_RATIO, id="stalled_probe"),
        pytest.param("cut_resume", CONFIG, id="cut_resume"),
    ],
)
async def test_replica_chaos_keeps_the_invariants(
    scenario: str, config: ChaosConfig, tmp_path: Path
) -> None:
    run = await run_scenario(config, scenario, tmp_path)
    summary = run.summary()
    assert run.episodes, f"{scenario}: no chaos episode ran"
    assert summary["handed_out"] > 0, summary
    assert summary["drained"] and summary["lost"] == 0 and summary["duplicated"] == 0, summary
    assert summary["mislabelled_tokens"] == 0, run.failures
    assert not run.failures, run.failures
