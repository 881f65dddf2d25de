"""Run A straight through; run B checkpointed at a random step, killed (SIGKILL) a few steps
later, and resumed in a new process. Every prompt must end exactly once in both runs, and
the counters must agree with what the trainer saw (SimEngine: a simulation)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.resume_run import PROMPTS

ROOT = Path(__file__).resolve().parents[1]


def launch(out: Path, *args: str) -> int:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.resume_run", str(out), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(proc.stderr[-3000:])
    return proc.returncode


def check_run(final: dict[str, Any]) -> None:
    journal, ledger = final["journal"], final["ledger"]
    ends = Counter(event[1] for event in journal)
    assert set(ends) == {f"default/{i}" for i in range(PROMPTS)}, "a prompt is missing"
    assert max(ends.values()) == 1, [p for p, n in ends.items() if n > 1]
    kinds = Counter(event[0] if event[0] == "consumed" else event[2] for event in journal)
    assert ledger["consumed_groups"] == kinds["consumed"]
    assert ledger["failed_groups"] == kinds["dropped_failed"]
    assert ledger["filtered_groups"] == kinds["dropped_filtered"]
    assert ledger["in_flight_groups"] == ledger["ready_groups"] == ledger["resume_groups"] == 0


@pytest.mark.parametrize(
    ("seed", "multi"), [(1, False), (2, False), (3, True)], ids=["1", "2", "multi-turn"]
)
def test_killed_and_resumed_run_ends_every_prompt_once(
    tmp_path: Path, seed: int, multi: bool
) -> None:
    """With `multi`, the checkpoint holds episodes in flight (restarted on resume)."""
    rng = random.Random(seed)
    save_at = rng.randint(2, 12)
    kill_at = save_at + rng.randint(1, 4)
    straight, broken = tmp_path / "a", tmp_path / "b"
    straight.mkdir()
    broken.mkdir()
    extra = ["--multi"] if multi else []
    assert launch(straight, *extra) == 0
    killed = launch(broken, "--save-at", str(save_at), "--kill-at", str(kill_at), *extra)
    assert killed == -signal.SIGKILL
    assert not (broken / "final.json").exists()  # it really died mid-run
    assert launch(broken, "--resume", *extra) == 0
    a = json.loads((straight / "final.json").read_text())
    b = json.loads((broken / "final.json").read_text())
    check_run(a)
    check_run(b)
    for run in (a, b):
        ledger = run["ledger"]
        ended = ledger["consumed_groups"] + ledger["failed_groups"] + ledger["filtered_groups"]
        assert ended == PROMPTS  # the counters agree: same prompts, each ended once
    assert b["ledger"]["started_groups"] >= PROMPTS
    if multi:  # the checkpoint was taken with episodes in flight, and they restarted
        assert json.loads((broken / "journal.json").read_text())["in_flight"] > 0
        assert b["ledger"]["environment_tokens"] > 0
