"""`benchmarks/lora_throughput.py --quick` on the session's engines (the plain one and the LoRA
one), its code imported rather than run as a command that would start two engines of its own:
every setting generated and handed out groups, none failed, the updating settings updated (and
timed each update), the others did not."""

from __future__ import annotations

import json
from pathlib import Path

from asyncroll.engines import VLLMEngine
from tests.test_benchmarks import import_benchmark


async def test_lora_throughput_quick_runs(
    tmp_path: Path, engine: VLLMEngine, lora_engine: VLLMEngine
) -> None:
    bench = import_benchmark("lora_throughput")
    args = bench.parse_args(["--quick", "--out", str(tmp_path)])
    await bench.measure(args, {"base": engine, "lora": lora_engine})
    pooled = json.loads((tmp_path / "lora_throughput.json").read_text())["pooled"]
    assert set(pooled) == {
        "base", "full, abort", "full, keep",
        "LoRA, 1 adapter", "LoRA, update", "LoRA, update, pause",
    }  # fmt: skip
    for name, run in pooled.items():
        assert run["generated_tokens"] > 0 and run["kept_tokens"] > 0, name
        assert run["failed_groups"] == 0, name
        updates = 0 if name in ("base", "LoRA, 1 adapter") else run["steps"]
        assert run["updates"] == len(run["update_s"]) == updates, name
        assert len(run["stall_s"]) == run["steps"] > 0, name  # one per step, update or not
        assert all(s > 0 for s in run["update_s"]) and min(run["stall_s"]) >= 0, name
    assert (tmp_path / "lora_throughput.png").exists()
