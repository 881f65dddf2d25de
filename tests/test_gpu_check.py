"""`benchmarks/gpu_check.sh` on a machine without CUDA: it parses, each step fails at once with
a message that says why, and every benchmark flag it passes is one that benchmark still has.

The script is the one run a GPU lease gets (minutes, all tries counted): a step that breaks on a
renamed flag, or that starts vLLM only to fail on the missing GPU, would waste it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STEPS = ("torch", "tests", "runner_v1", "parity", "throughput", "memory", "demo")


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
    proc = gpu_check("--vllm", "0.31.0", "--dry-run", out=tmp_path)
    assert proc.returncode == 2
    assert "not a supported release; supported: 0.32.0 0.33.0 0.34.0" in proc.stderr


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
        for step in ("compat", *STEPS)
        for line in (tmp_path / step / "log.txt").read_text().splitlines()
        if line.startswith("gpu_check: would run in ")
    ]
    benchmarks = [shlex.split(c) for c in commands if ".py " in c and " -m pytest " not in c]
    assert {Path(argv[1]).name for argv in benchmarks} == {
        "gpu_check_torch.py",
        "vllm_compat.py",
        "vllm_throughput.py",
        "memory_profile.py",
        "demo_overlap.py",
    }
    for argv in benchmarks:
        script = ROOT / "benchmarks" / Path(argv[1]).name
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


def test_the_torch_tier_passes_on_cpu_at_a_small_vocabulary(tmp_path: Path) -> None:
    """The checks the `torch` step runs on CUDA, on the CPU at a small size: the same code
    (numerics against float64, wrap_lora steps, the codec); GPU memory is CUDA's alone."""
    proc = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", str(SCRIPT.parent / "gpu_check_torch.py"),
         "--device", "cpu", "--vocab", "1024", "--length", "16", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((tmp_path / "torch_check.json").read_text())["results"]
    names = {r["name"] for r in results}
    assert {"wrap_lora training", "codec with device tensors", "policy_loss bfloat16"} <= names
    assert sum(n.startswith("token_logprobs") for n in names) == 12
    assert all(r["passed"] for r in results)


def test_the_torch_tier_unpacks_missing_dependencies_from_a_wheelhouse(tmp_path: Path) -> None:
    """A bare GPU machine has torch and no network: wheels carried along are unpacked into
    the output folder (nothing installed), the ones for this Python or pure ones only."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check_torch
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    house = tmp_path / "wheels"
    house.mkdir()
    for name, module in ((f"fakedep-1.0-{tag}-{tag}-manylinux_x86_64.whl", "fakedep"),
                         ("fakedep-1.0-cp27-cp27-manylinux_x86_64.whl", "wrongdep"),
                         ("puredep-2.0-py3-none-any.whl", "puredep")):  # fmt: skip
        with zipfile.ZipFile(house / name, "w") as wheel:
            wheel.writestr(f"{module}/__init__.py", "")
    needed = gpu_check_torch.NEEDED
    gpu_check_torch.NEEDED = ("fakedep", "puredep", "wrongdep")
    try:
        missing = gpu_check_torch._ready(house, tmp_path / "site")
    finally:
        gpu_check_torch.NEEDED = needed
    assert missing == ["wrongdep"]
    assert sorted(p.name for p in (tmp_path / "site").iterdir()) == ["fakedep", "puredep"]


def test_the_torch_tier_fits_what_a_device_run_carries() -> None:
    """A device run carries at most 64 MiB of the project: the tracked files and a wheelhouse
    of asyncroll's dependencies for the machine's Python (measured 2026-12-07 for CPython 3.12:
    msgspec, numpy, anyio, tqdm, psutil and their own, 16.4 MB)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
    ).stdout.split(b"\0")
    tracked = sum((ROOT / name.decode()).stat().st_size for name in listed if name)
    wheelhouse = 16_446_920
    assert tracked + wheelhouse <= 64 << 20, (tracked, wheelhouse)
