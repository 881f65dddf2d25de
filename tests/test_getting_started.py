"""docs/getting-started.md shows the example's code, never a copy that could drift: every line
of its Python blocks is a line of `examples/chat_grpo.py` (which tests/vllm runs)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_the_page_quotes_the_example() -> None:
    page = (ROOT / "docs" / "getting-started.md").read_text()
    example = {
        line.rstrip() for line in (ROOT / "examples" / "chat_grpo.py").read_text().splitlines()
    }
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert len(blocks) >= 4
    for block in blocks:
        for line in block.splitlines():
            if line.strip() and line.strip() != "...":
                assert line.rstrip() in example, line
