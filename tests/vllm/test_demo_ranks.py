"""`asyncroll demo --ranks 2`, as documented (docs/whole-machine.md): the command re-executes
itself under torchrun, rank 0 starts vLLM (its own: it lives in rank 0's process) and the
producer, both ranks train FSDP2 shards of the tiny model; a short run ends cleanly with the
summary, its metrics, and no process left."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import psutil
import pytest

from asyncroll.app.demo import DemoConfig, demo_config
from asyncroll.app.demo_ranks import command


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
