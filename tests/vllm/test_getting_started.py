"""docs/getting-started.md's example, `examples/chat_grpo.py`, runs: the tiny model stands in
for the Hugging Face one (the session's engine serves it), two steps with evaluation."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncroll.chat import TINY_CHAT_TEMPLATE
from asyncroll.engines import VLLMEngine

pytestmark = pytest.mark.vllm

EXAMPLE = Path(__file__).parents[2] / "examples" / "chat_grpo.py"


def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("chat_grpo", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_the_getting_started_example_runs(engine: VLLMEngine, tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    log = await example().train(
        engine, model, tokenizer, steps=2, eval_every=1, chat_template=TINY_CHAT_TEMPLATE
    )
    assert [m["rollout/version"] for m in log] == [0, 1]
    assert [m["eval/version"] for m in log] == [1, 2]  # after each step's update
    for m in log:
        assert m["eval/prompts"] + m["eval/failed_prompts"] == 32 and m["eval/error"] == 0
        assert 0 <= m["eval/pass@1"] <= 1 and m["rollout/reward_count"] > 0
