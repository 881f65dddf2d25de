"""docs/getting-started.md shows the example's code, never a copy that could drift: every line
of its Python blocks is a line of `examples/chat_grpo.py` (which tests/vllm runs)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_the_page_quotes_the_example() -> None:
    page = (ROOT / "docs" / "getting-started.md").read_text()
    example = {
        line.rstrip() for line in (ROOT / "examples" / "chat_grpo.py").read_text().splitlines()
    }
    blocks = re.findall(r"(<!-- docs-test: [^\n]*-->)\n```python\n(.*?)```", page, flags=re.S)
    quoted = [block for marker, block in blocks if "piece of examples/chat_grpo.py" in marker]
    assert len(quoted) >= 4
    for block in quoted:
        for line in block.splitlines():
            if line.strip() and line.strip() != "...":
                assert line.rstrip() in example, line


def test_the_qwen3_setup_turns_thinking_off_and_its_data_cycles() -> None:
    """`--model Qwen/Qwen3-0.6B --steps 200` as documented: 200 batches of 16 groups draw 3,200
    prompts from 1,000 rows, so the rows come back (drawn here past the first epoch), and
    Qwen3's template gets `enable_thinking=False`, so the reply starts after an empty think
    block instead of inside one (the real Qwen3 tokenizer)."""
    import importlib.util
    import itertools

    from tests.chat.templates import qwen3_tokenizer

    spec = importlib.util.spec_from_file_location("chat_grpo", ROOT / "examples" / "chat_grpo.py")
    assert spec is not None and spec.loader is not None
    chat_grpo = importlib.util.module_from_spec(spec)
    sys.modules["chat_grpo"] = chat_grpo  # its dataclass looks its module up there
    spec.loader.exec_module(chat_grpo)
    tokenizer = qwen3_tokenizer()
    setup = chat_grpo.hf_setup()
    drawn = list(itertools.islice(chat_grpo.training_prompts(setup, tokenizer, 1024), 1001))
    assert len(drawn) == 1001 and len({p.prompt_id for p in drawn}) == 1001
    assert drawn[1000].tokens.tolist() == drawn[0].tokens.tolist()  # the second epoch
    assert tokenizer.decode(drawn[0].tokens).endswith("<think>\n\n</think>\n\n")
