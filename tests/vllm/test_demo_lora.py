"""`asyncroll demo --lora` end to end, short, with --lora's defaults (every group kept, an
entropy bonus): real vLLM serving the trainer's LoRA adapter, only the adapter moving each step,
the producer's ledger balanced. That it learns (reward up by more than 0.5 for two seeds) takes
about 3 minutes per seed: benchmarks/results/demo-runs.md has the figures, measured with
`asyncroll demo --lora --seed 1` and `--seed 2`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncroll.app.demo import LORA_DEFAULTS, demo_config, run_demo
from asyncroll.engines import VLLMEngine
from asyncroll.lora import LoraAdapter
from tests.vllm.test_demo import load_demo_model


async def test_demo_lora_moves_only_the_adapter_and_balances_the_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lora_engine: VLLMEngine
) -> None:
    """On the session's LoRA engine (`LoraSlots(max_rank=8, slots=4)`: the demo's rank 8,
    more slots than its 2), given the demo's base model at version 0."""
    config = demo_config(
        lora=True, steps=3, group_size=4, batch_groups=4, out=str(tmp_path), solved_reward=0.0,
        batch_timeout_s=60.0,
    )  # fmt: skip
    engine = await load_demo_model(lora_engine, config)  # before the spy: not the demo's call
    sent: list[tuple[int, Any]] = []
    update = VLLMEngine.update_weights

    async def spy(self: VLLMEngine, weights: Any, *, version: int) -> None:
        sent.append((version, weights))
        await update(self, weights, version=version)

    monkeypatch.setattr(VLLMEngine, "update_weights", spy)
    assert (config.filter, config.entropy) == (LORA_DEFAULTS["filter"], LORA_DEFAULTS["entropy"])
    records = await run_demo(config, progress=False, engine=engine)
    assert [r.version for r in records] == [0, 1, 2]
    assert sent[0] == (0, None)  # the producer's entry labels the base weights version 0
    assert [v for v, _ in sent[1:]] == [1, 2, 3]  # then one update per step, nothing else
    assert all(isinstance(w, LoraAdapter) for _, w in sent[1:])
    adapters: list[LoraAdapter] = [w for _, w in sent[1:]]
    assert adapters[0].config == config.lora_config()
    assert len(adapters[0].tensors) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    assert adapters[0].nbytes() < 0.1 * 1.38 * 2**20  # under a tenth of the model's 1.38 MiB
    b = "model.layers.0.self_attn.q_proj.lora_B.weight"
    assert bool(adapters[0].tensors[b].any())  # a step moved B away from its zeros
    assert not torch.equal(adapters[0].tensors[b], adapters[2].tensors[b])  # and kept moving
    assert all(0 <= r.reward <= 1 and r.failed_groups == 0 for r in records)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    summary = (tmp_path / "summary.txt").read_text()  # run_demo checked the producer's ledger
    consumed = next(line for line in summary.splitlines() if line.startswith("groups consumed"))
    assert consumed.split()[-7] == str(3 * config.batch_groups), consumed
