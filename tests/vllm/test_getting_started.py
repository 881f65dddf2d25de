"""docs/getting-started.md's example, `examples/chat_grpo.py`, runs: the tiny model stands in
for the Hugging Face one (the session's engine serves it), two steps with evaluation on 16 of
its held-out questions (the example's own run evaluates all 64; what it learns, run as
documented, is in benchmarks/results/2026-12-07-chat-grpo-example.md)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncroll.engines import VLLMEngine

pytestmark = pytest.mark.vllm

EXAMPLE = Path(__file__).parents[2] / "examples" / "chat_grpo.py"


def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("chat_grpo", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["chat_grpo"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


async def test_the_getting_started_example_runs(engine: VLLMEngine, tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    chat_grpo = example()
    setup = chat_grpo.tiny_setup()
    setup = dataclasses.replace(setup, held_out=setup.held_out[:16])
    log = await chat_grpo.train(engine, model, tokenizer, setup, steps=2, eval_every=1)
    assert [m["rollout/version"] for m in log] == [0, 1]
    assert [m["eval/version"] for m in log] == [1, 2]  # after each step's update
    for m in log:
        assert m["eval/prompts"] + m["eval/failed_prompts"] == 16 and m["eval/error"] == 0
        assert 0 <= m["eval/pass@1"] <= 1 and m["rollout/reward_count"] > 0
