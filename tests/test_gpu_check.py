"""`benchmarks/gpu_check.sh` on a machine without CUDA: it parses, each step fails at once with
a message that says why, and every benchmark flag it passes is one that benchmark still has.

The script is the one run a GPU lease gets (minutes, all tries counted): a step that breaks on a
renamed flag, or that starts vLLM only to fail on the missing GPU, would waste it.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STEPS = ("tests", "parity", "throughput", "memory", "demo")


def gpu_check(*args: str, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


def test_bad_arguments_say_what_to_change(tmp_path: Path) -> None:
    proc = gpu_check("--steps", "tests,nope", out=tmp_path)
    assert proc.returncode == 2
    assert "no step 'nope'" in proc.stderr and "throughput" in proc.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="runs the steps for real")
def test_each_step_fails_at_once_without_cuda_saying_so(tmp_path: Path) -> None:
    proc = gpu_check("--python", sys.executable, "--steps", ",".join(STEPS), out=tmp_path)
    assert proc.returncode == 1
    summary = (tmp_path / "summary.md").read_text()
    for step in STEPS:
        assert re.search(rf"^\| {step} \| failed \(exit 1\) \| \d+ \|", summary, re.M), summary
        log = (tmp_path / step / "log.txt").read_text()
        assert "needs a CUDA GPU" in log, log


def test_every_benchmark_flag_it_passes_exists(tmp_path: Path) -> None:
    proc = gpu_check("--dry-run", "--python", sys.executable, out=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    commands = [
        line.split(": ", 2)[2]
        for step in STEPS
        for line in (tmp_path / step / "log.txt").read_text().splitlines()
        if line.startswith("gpu_check: would run in ")
    ]
    benchmarks = [shlex.split(c) for c in commands if ".py " in c and " -m pytest " not in c]
    assert {argv[1] for argv in benchmarks} == {
        "vllm_throughput.py",
        "memory_profile.py",
        "demo_overlap.py",
    }
    for argv in benchmarks:
        script = ROOT / "benchmarks" / argv[1]
        helped = subprocess.run(
            [sys.executable, str(script), "--help"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            check=True,
        ).stdout
        for flag in (a for a in argv[2:] if a.startswith("--")):
            assert re.search(rf"(^|[\s\[,]){re.escape(flag)}\b", helped), f"{script.name}: {flag}"
