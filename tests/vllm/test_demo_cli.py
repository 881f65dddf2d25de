"""`asyncroll demo` from a terminal's point of view: the progress bar and the summary on the
terminal, vLLM's logs (and its processes' other output) in OUT/engine.log; `--verbose` shows
them. Runs the command in a subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_demo_cli(out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    # as a user's shell would start it: importing trl (the chat tests do) sets
    # VLLM_LOGGING_LEVEL=ERROR in this process, which would silence vLLM's log in engine.log
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    env["PYTHONPATH"] = str(ROOT)
    command = [sys.executable, "-m", "asyncroll.app.cli", "demo", "--steps", "2", "--batch-groups",
               "4", "--group-size", "4", "--out", str(out), *flags]  # fmt: skip
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_demo_terminal_shows_the_bar_and_the_summary_only(tmp_path: Path) -> None:
    proc = run_demo_cli(tmp_path)
    terminal = proc.stdout + proc.stderr
    assert proc.returncode == 0, terminal[-3000:]
    assert "GRPO echo" in terminal and "reward, last" in terminal  # the bar and the summary
    assert f"engine and library logs: {tmp_path / 'engine.log'}" in terminal
    for noise in ("INFO", "WARNING", "EngineCore", "vllm"):
        assert noise not in terminal, noise
    log = (tmp_path / "engine.log").read_text()
    assert "EngineCore" in log and "INFO" in log  # vLLM's processes wrote there
    assert "Failed to load weights" not in log  # the reload warnings are fixed at the cause
