"""Multi-rank trainers (asyncroll.distributed), run for real under torchrun on CPU (gloo).

The jobs (tests/ranks/job.py) start together when the module starts, each in processes of its
own, and each test reads what its job's ranks wrote: a 3-rank FSDP2 + DDP + LoRA job whose
steps and gathers are compared with one process's, and one 2-rank job per fault, whose
survivors must end with an error naming the rank and its cause. Rank 0's producer runs on
SimEngine (a simulation); tests/vllm/test_ranks_vllm.py runs one with real vLLM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from asyncroll.launcher_env import launcher_variables, without_launcher_variables

pytestmark = pytest.mark.xdist_group("ranks")

JOB = Path(__file__).parent / "ranks" / "job.py"
LAUNCH = Path(__file__).parent / "ranks" / "launch.py"
FAULT_TIMEOUT_S = 30.0  # the jobs' Ranks(timeout_s): what a hung rank may cost
HUNG_TIMEOUT_S = 8.0  # the never-joined gather's job: its timeout is what is measured

# fault: (the rank that misbehaves, the rank the survivors must name, words in their error)
FAULTS: dict[str, tuple[int, int | None, str]] = {
    "raise_step": (1, 1, "rank 1 failed: ValueError: boom in the step (injected)"),
    "kill_step": (1, 1, "rank 1 (pid"),
    "wait_kill": (1, 1, "rank 1 (pid"),
    "kill_gather": (1, 1, "rank 1 (pid"),
    "kill_rank0": (0, 0, "rank 0 (pid"),
    "producer_stop": (0, 0, "rank 0 failed in batch: ProducerError"),
    "skip_gather": (1, None, "did not join within timeout_s=8 s"),
}


class Job:
    """One torchrun launch of tests/ranks/job.py, started at once and read when done.

    `forked`: torchrun's main with its ranks forked from a launcher that imported torch and
    asyncroll once (tests/ranks/launch.py), for the CPU jobs; otherwise the `torchrun`
    command itself (`python -m torch.distributed.run`, each rank its own interpreter), as the
    SIGTERM test and the jobs with vLLM in rank 0 run it."""

    def __init__(
        self, scenario: str, out: Path, ranks: int, env: dict[str, str], *, forked: bool = True
    ) -> None:
        out.mkdir(parents=True)
        self.out, self.ranks = out, ranks
        self.log = out / "launcher.log"
        launcher = [str(LAUNCH)] if forked else ["-m", "torch.distributed.run"]
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, *launcher, f"--nproc-per-node={ranks}",
                 "--standalone", str(JOB), scenario, str(out)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **env}, start_new_session=False,
            )  # fmt: skip

    def wait(self, timeout: float = 240) -> int:
        return self.process.wait(timeout=timeout)

    def rank(self, r: int) -> dict[str, Any] | None:
        path = self.out / f"rank{r}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def fault_at(self) -> float:
        return float((self.out / "fault_at").read_text())

    def leftovers(self) -> list[psutil.Process]:
        """Processes of this job still alive (found by its output folder on their command
        line: the ranks, the launcher)."""
        mine = str(self.out)
        found = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if mine in " ".join(p.info["cmdline"] or []) and p.status() != "zombie":
                    found.append(p)
            except psutil.Error:
                continue
        return found


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Job]:
    root = tmp_path_factory.mktemp("ranks")
    started = {
        "train": Job("train", root / "train", 3, {"RANKS_TIMEOUT_S": "120"}),
        "checkpoint": Job(
            "checkpoint", root / "checkpoint", 2,
            {"CKPT": str(root / "ckpt"), "CKPT_MODE": "save", "RANKS_TIMEOUT_S": "60"},
        ),
    }  # fmt: skip
    for fault, (victim, _, _) in FAULTS.items():
        timeout = HUNG_TIMEOUT_S if fault == "skip_gather" else FAULT_TIMEOUT_S
        env = {"FAULT": fault, "FAULT_RANK": str(victim), "RANKS_TIMEOUT_S": str(timeout)}
        started[fault] = Job("fault", root / fault, 2, env)
    yield started
    for job in started.values():
        if job.process.poll() is None:
            job.process.kill()


def test_every_rank_gets_its_share_once_in_equal_micro_batch_counts(jobs: dict[str, Job]) -> None:
    job = jobs["train"]
    assert job.wait() == 0, job.log.read_text()[-3000:]
    zero = job.rank(0)
    assert zero is not None and zero["checks"] == "done"
    assert zero["rows_once"]  # every sample of the batch on exactly one rank, once
    assert len(set(zero["micro_batches"])) == 1  # the same count on all 3 ranks
    assert zero["tokens"][0] == zero["tokens"][1] > 0  # trained tokens: 3 ranks = 1 process


def test_sharded_steps_equal_one_process_step_on_the_whole_batch(jobs: dict[str, Job]) -> None:
    """FSDP2 and DDP over 3 ranks, micro-batched, then one optimizer step: the weights equal
    those of one process's step on the whole batch in one pass (float64; RoPE's float32
    tables leave ~1e-7 between different batch shapes), and the loss is the same."""
    job = jobs["train"]
    assert job.wait() == 0
    zero = job.rank(0)
    assert zero is not None
    assert zero["moved"] > 1e-3  # the step did change the weights
    tolerance = 1e-6 * (1 + zero["moved"])
    assert zero["fsdp_max_diff"] < tolerance
    assert zero["ddp_max_diff"] < tolerance
    one, fsdp, ddp = zero["loss"]
    assert fsdp == pytest.approx(one, rel=1e-12) and ddp == pytest.approx(one, rel=1e-12)


def test_the_gather_gives_the_models_own_tensors_under_its_own_names(jobs: dict[str, Job]) -> None:
    """Every parameter gathered from FSDP2 shards equals the unsharded model's, bit for bit
    (tied head, biases, norms); DDP's `module.` prefix is gone; buckets stay in their bound;
    a LoRA model sends only its adapter; the peers' lazy DTensor transfer is refused."""
    job = jobs["train"]
    assert job.wait() == 0
    zero = job.rank(0)
    assert zero is not None
    assert zero["gather_exact"] and zero["fsdp_names"] and zero["ddp_names"]
    assert zero["peak_bucket_bytes"] <= 16 << 10 and zero["buckets"] > 1
    assert zero["version"] == 1 and all(job.rank(r)["version"] == 1 for r in (1, 2))  # type: ignore[index]
    assert zero["lora_names"] and zero["lora_exact"] and zero["lora_config"] and zero["lora_only"]
    assert "sharded DTensor" in zero["dtensor_refused"]


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_failure_ends_every_rank_named_within_the_bound(jobs: dict[str, Job], fault: str) -> None:
    """Each survivor ends with `RankFailed` naming the rank that failed and what it did;
    within a keepalive of the fault when it waited for rank 0 alone, at once when it was in a
    collective (the dead rank's sockets close), within timeout_s when a rank hangs; and no
    process of the job is left."""
    victim, named, words = FAULTS[fault]
    job = jobs[fault]
    assert job.wait() != 0
    survivors = [r for r in range(job.ranks) if r != victim]
    bound = (HUNG_TIMEOUT_S + FAULT_TIMEOUT_S / 10 if fault == "skip_gather" else 0) + 10
    for r in survivors:
        report = job.rank(r)
        assert report is not None, job.log.read_text()[-3000:]
        assert report["error"].startswith("RankFailed"), report["error"]
        assert words in report["error"], report["error"]
        assert report["failed_rank"] == named
        assert report["ended_at"] - job.fault_at() < bound
    assert job.leftovers() == []


def test_sigterm_to_the_launcher_ends_every_rank_named(tmp_path: Path) -> None:
    """torchrun forwards a SIGTERM (Slurm's, Kubernetes') to every rank: each closes what it
    owns (rank 0: the producer) and ends with RankFailed saying so; nothing is left."""
    ready = tmp_path / "ready"
    job = Job(
        "fault", tmp_path / "job", 2,
        {"FAULT": "sigterm_launcher", "FAULT_RANK": "0", "READY_FILE": str(ready),
         "RANKS_TIMEOUT_S": str(FAULT_TIMEOUT_S)},
        forked=False,  # the `torchrun` command itself is what Slurm or Kubernetes signals
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while not ready.exists():  # rank 0 is past step 1's update and waits: its event
        assert job.process.poll() is None, job.log.read_text()[-3000:]
        assert time.monotonic() < deadline, "the job never got to step 1"
        time.sleep(0.1)
    job.process.send_signal(signal.SIGTERM)
    assert job.wait() != 0
    for r in range(2):
        report = job.rank(r)
        assert report is not None, job.log.read_text()[-3000:]
        assert "SIGTERM" in report["error"], report["error"]
        assert report["step1"] == "ok"
    assert job.leftovers() == []


@pytest.fixture(scope="module")
def resumed(jobs: dict[str, Job], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Job]:
    """The checkpoint written by 2 ranks after 2 steps, resumed by 2 and by 3 ranks."""
    save = jobs["checkpoint"]
    assert save.wait() == 0, save.log.read_text()[-3000:]
    root = tmp_path_factory.mktemp("resumed")
    env = {"CKPT": str(save.out.parent / "ckpt"), "CKPT_MODE": "resume", "RANKS_TIMEOUT_S": "60"}
    started = {n: Job("checkpoint", root / f"n{n}", n, env) for n in (2, 3)}
    for job in started.values():
        job.wait()
    return {"save": save, **{f"n{n}": job for n, job in started.items()}}


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_resumed_run_trains_every_prompt_once_with_any_number_of_ranks(
    resumed: dict[str, Job], ranks: int
) -> None:
    """Saved by 2 ranks at version 2 (the trainer's shards and the producer at the same
    version), resumed by `ranks`: the weights are the saved ones, resharded; the versions
    go on; every prompt of the data is trained once over the two runs."""
    save, job = resumed["save"].rank(0), resumed[f"n{ranks}"]
    assert job.process.returncode == 0, job.log.read_text()[-3000:]
    again = job.rank(0)
    assert save is not None and again is not None
    assert save["meta"] == again["meta"] == [2, 2, 2]
    assert again["loaded_weights"] == save["saved_weights"]
    assert sorted(save["prompts"] + again["prompts"]) == sorted(f"default/{i}" for i in range(24))
    assert again["version"] == 2 + len(again["prompts"]) // 3


def test_vllm_never_sees_the_launchers_variables() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x",
           "PATH": "/bin", "LOCAL_RANK": "1"}  # fmt: skip
    assert launcher_variables(env) == [
        "LOCAL_RANK", "MASTER_PORT", "RANK", "TORCHELASTIC_RUN_ID", "WORLD_SIZE",
    ]  # fmt: skip
    assert without_launcher_variables(env) == {"PATH": "/bin"}
