"""The short demo as an end-to-end test: real vLLM rollouts on CPU, GRPO in torch, weight sync
every step. The reward can only rise if generation, scoring, the trainer and the weight sync
all work (with a broken sync vLLM keeps sampling the random initial policy)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from asyncroll.demo import DemoConfig, run_demo


async def test_demo_learns_the_echo_task(tmp_path: Path) -> None:
    config = DemoConfig(steps=40, out=str(tmp_path), solved_reward=0.0, batch_timeout_s=60.0)
    records = await run_demo(config, progress=False)
    assert len(records) == 40
    first = np.mean([r.reward for r in records[:5]])
    last = np.mean([r.reward for r in records[-5:]])
    assert first < 0.05  # a random policy almost never echoes the letter
    assert last > 0.2 and last > 5 * first, (first, last)
    assert [r.version for r in records] == list(range(40))  # one weight update per step
    assert max(r.staleness_mean for r in records) <= config.max_staleness
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 41))
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    assert "reward, last" in (tmp_path / "summary.txt").read_text()
