"""README.md is a short front door: at most 250 lines, the two commands right after the pitch,
the GPU status near the top, its links inside the repository (tests/test_docs.py checks that
they resolve), and a training-loop example that keeps blocking torch work off the event loop."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def python_blocks() -> list[ast.Module]:
    blocks = re.findall(r"^( *)```python\n(.*?)^ *```", README, flags=re.DOTALL | re.MULTILINE)
    return [ast.parse(textwrap.dedent(b)) for _, b in blocks]  # a block in a list is indented


def test_links_point_inside_the_repository() -> None:
    assert "../shared" not in README
    links = re.findall(r"\]\(([^)#]+)\)", README)
    assert not [link for link in links if link.startswith("http")]
    assert "docs/design.md" in links and "docs/configuration.md" in links


def test_it_is_a_front_door() -> None:
    lines = README.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move detail into docs/"
    first_block = README.index("```bash")
    assert first_block < README.index("\n## "), "the two commands come before any section"
    commands = README[first_block:].split("```", 2)[1]
    assert "make demo" in commands and "make test" in commands
    assert "GPU" in "\n".join(lines[:25]), "say near the top that the GPU paths have not run"


def test_the_training_loop_runs_torch_work_off_the_event_loop() -> None:
    """No `backward()` or optimizer `step()` inside an `async def` (they would block vLLM's
    event loop for the whole step); the step goes through `asyncio.to_thread`."""
    blocks = python_blocks()
    assert blocks
    blocking = {"backward", "step", "zero_grad"}
    to_thread = 0
    for module in blocks:
        for fn in (n for n in ast.walk(module) if isinstance(n, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    assert node.func.attr not in blocking, ast.unparse(node)
                    to_thread += node.func.attr == "to_thread"
    assert to_thread >= 2  # the train step and the trainer's checkpoint


def test_the_trainer_checkpoint_is_saved_next_to_the_producers() -> None:
    source = "\n".join(ast.unparse(m) for m in python_blocks())
    assert "producer.save(" in source and "torch.save" in source
    assert "producer.load(" in source and "weights=model.named_parameters()" in source
