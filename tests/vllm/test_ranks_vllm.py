"""A sharded trainer's update into real vLLM: 2 torchrun ranks (gloo, CPU), rank 0 serving
the tiny model with an in-process `VLLMEngine` of its own (it must live in rank 0's process,
so it cannot be the session's), the ranks holding every tensor of the weight-parity model
perturbed, sharded with FSDP2 and then DDP. After each update the engine serves what a fresh
engine on the perturbed weights served (tests/vllm/test_weight_parity.py's reference, made
once a run), and vLLM's processes carry none of torchrun's variables or ports. Then rank 0 is
SIGKILLed with its engine running: rank 1 ends naming it, and no vLLM process outlives it."""

from __future__ import annotations

import psutil
import pytest

from asyncroll.app.models import build_tiny_model
from tests.made_once import made_once
from tests.test_ranks import Job
from tests.vllm.test_weight_parity import make_cases


@pytest.fixture(scope="module")
async def parity_job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    tiny = build_tiny_model()
    root = await made_once(tmp_path_factory, "weight-parity", make_cases)
    env = {"PARITY_CASE": str(root / "tied"), "ORIGINAL_MODEL": str(tiny),
           "RANKS_TIMEOUT_S": "300"}  # fmt: skip
    job = Job("vllm_parity", tmp_path_factory.mktemp("ranks-vllm") / "job", 2, env, forked=False)
    job.wait(timeout=540)
    return job


def test_a_sharded_update_serves_what_a_fresh_engine_on_its_weights_serves(
    parity_job: Job,
) -> None:
    zero, one = parity_job.rank(0), parity_job.rank(1)
    assert zero is not None and one is not None, parity_job.log.read_text()[-4000:]
    for name, version in (("fsdp2", 1), ("ddp", 2)):
        assert zero[name] == one[name] == version  # every rank knows the new version
        assert zero[f"{name}_tokens"], f"{name}: other tokens than the fresh engine's"
        assert zero[f"{name}_logprob_gap"] < 1e-4
        assert zero[f"{name}_labels"]


def test_vllm_processes_see_none_of_the_launchers_variables_or_ports(parity_job: Job) -> None:
    zero = parity_job.rank(0)
    assert zero is not None
    assert zero["vllm_processes"] >= 1  # the engine core (and its worker)
    # vLLM's CPU platform sets LOCAL_WORLD_SIZE itself (its own world: 1); none inherited
    for name, (trainer, vllm) in zero["vllm_launcher_variables"].items():
        assert trainer not in vllm, f"{name}={trainer} reached vLLM's processes"
    assert set(zero["vllm_launcher_variables"]) <= {"LOCAL_WORLD_SIZE"}
    assert zero["master_port"] not in zero["vllm_ports"]


def test_rank_0_killed_with_its_engine_leaves_no_vllm_process_and_rank_1_names_it(
    parity_job: Job,
) -> None:
    zero, one = parity_job.rank(0), parity_job.rank(1)
    assert zero is not None and one is not None
    assert parity_job.process.returncode != 0
    assert one["error"].startswith("RankFailed: rank 0 (pid"), one["error"]
    assert one["ended_at"] - parity_job.fault_at() < 30
    vllm = [p for p in map(_process, zero["vllm_pids"]) if p is not None]
    _, alive = psutil.wait_procs(vllm, timeout=60)  # the reaper: SIGTERM, 10 s, SIGKILL
    assert alive == []


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None
