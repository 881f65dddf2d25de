"""docs/chat-data.md's example runs as written (the tiny model and SimEngine standing in for a
Hugging Face model and vLLM, as the page says)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "chat-data.md"


def test_the_example_runs(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (example,) = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.DOTALL | re.MULTILINE)
    exec(compile(example, str(DOC), "exec"), {"__name__": "__main__"})  # it runs as a script
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4  # one per group of the batch: its answer and its 8 rewards
    for line in lines:
        answer, rewards = line.split(" ", 1)
        assert answer.isdigit() and rewards.startswith("[") and rewards.count(".") == 8
