"""README.md's training loop runs as written, on the tiny model and the shared vLLM engine: two
steps of GRPO with the `tis` correction, a weight update after each, and the trainer's and the
producer's checkpoints written at the same version. Only what a test must change is changed:
the model path (the shared engine instead of a new one), a response length that fits the
shared engine's context, and a checkpoint every 2 steps instead of every 100."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from asyncroll.engines import VLLMEngine
from asyncroll.types import RolloutGroup

ROOT = Path(__file__).resolve().parents[2]
EDITS = {
    'VLLMEngine("path/to/hf-model", tensor_parallel_size=1)': "shared_engine()",
    "max_new_tokens=512": "max_new_tokens=16",
    "step % 100 == 0": "step % 2 == 0",
}


def readme_loop() -> str:
    text = (ROOT / "README.md").read_text()
    source = re.search(r"## A training loop\n.*?```python\n(.*?)```", text, re.DOTALL)
    assert source is not None
    code = source.group(1)
    for old, new in EDITS.items():
        assert old in code, f"README's loop no longer has {old!r}: update this test's EDITS"
        code = code.replace(old, new)
    return code


def reward_fn(group: RolloutGroup) -> list[float]:
    return [float(s.tokens.size > 0 and s.tokens[0] % 2 == 0) for s in group.samples]


async def test_the_readme_training_loop_runs(
    engine: VLLMEngine, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    logged: list[dict[str, Any]] = []

    @contextlib.asynccontextmanager
    async def shared_engine() -> AsyncIterator[VLLMEngine]:
        yield engine  # the session's engine: the `engine` fixture restores its weights

    namespace: dict[str, Any] = {"shared_engine": shared_engine}
    exec(compile(readme_loop(), "README.md", "exec"), namespace)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prompts = [[1, 40 + i % 26, 60] for i in range(200)]
    version = engine.version
    await namespace["train"](model, optimizer, prompts, reward_fn, steps=2, log=logged.append)

    assert len(logged) == 2
    assert logged[-1]["rollout/batch_groups"] == 32
    assert {"train/loss", "train/clip_fraction", "train/tokens", "rollout/version"} <= set(
        logged[-1]
    )
    assert engine.version == version + 2
    assert (tmp_path / "ckpt" / "trainer.pt").exists()
    assert (tmp_path / "ckpt" / "producer").exists()
