"""`asyncroll demo --ranks 2`, as documented (docs/whole-machine.md): the command re-executes
itself under torchrun, rank 0 starts vLLM (its own: it lives in rank 0's process) and the
producer, both ranks train FSDP2 shards of the tiny model; a short run ends cleanly with the
summary, its metrics, its run record and report, and no process left."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import psutil
import pytest

from asyncroll.app.demo import DemoConfig, demo_config
from asyncroll.app.demo_ranks import command
from tests.test_record import lines as record_lines


def test_the_demo_on_two_ranks_runs_as_documented(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "asyncroll", "demo", "--ranks", "2", "--steps", "2",
         "--out", str(out)],
        capture_output=True, text=True, timeout=540, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "2 ranks (FSDP2, gloo)" in done.stdout
    records = (out / "metrics.jsonl").read_text().splitlines()
    assert [msgspec.json.decode(r)["step"] for r in records] == [1, 2]
    assert msgspec.json.decode(records[-1])["version"] == 1  # the batch of step 2: version 1
    # Rank 0's record: every group handed out, its GRPO advantages, each step's numbers.
    runs, groups, trains, steps = record_lines(out)
    config = DemoConfig()
    assert len(runs) == 1 and [s.step for s in steps] == [1, 2]
    assert all("train/loss" in s.metrics for s in steps)
    handed = [g for g in groups if g.step is not None]
    assert sorted(g.step for g in handed) == [1] * config.batch_groups + [2] * config.batch_groups
    rewards = {(g.uid, i): s.reward for g in handed for i, s in enumerate(g.samples)}
    assert sorted((t.uid, t.index) for t in trains) == sorted(rewards)
    for group in handed:  # the group's rewards centred and scaled: same order, summing to 0
        advantage = {t.index: t.advantages[-1] for t in trains if t.uid == group.uid}
        assert all(t.logprobs is None for t in trains if t.uid == group.uid)
        assert sum(advantage.values()) == pytest.approx(0.0, abs=1e-4)
        by_reward = sorted(advantage, key=lambda i: rewards[group.uid, i])
        assert [advantage[i] for i in by_reward] == sorted(advantage.values())
    assert "report" in done.stdout and (out / "report" / "index.html").exists()
    left = [
        p for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])
    ]
    assert left == []


def test_ranks_refuses_what_it_does_not_run() -> None:
    with pytest.raises(ValueError, match="--ranks 2 runs the echo task"):
        demo_config(ranks=2, task="chat")
    with pytest.raises(ValueError, match="leave --lora at False"):
        demo_config(ranks=2, lora=True)
    with pytest.raises(ValueError, match="--ranks must be >= 1"):
        demo_config(ranks=0)


def test_the_command_is_torchrun_on_the_ranks_module() -> None:
    cfg = DemoConfig(ranks=3, steps=5)
    argv = command(cfg, verbose=True)
    assert argv[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3"]
    assert argv[5:7] == ["-m", "asyncroll.app.demo_ranks"]
    assert msgspec.json.decode(argv[7], type=DemoConfig) == cfg and argv[-1] == "--verbose"
