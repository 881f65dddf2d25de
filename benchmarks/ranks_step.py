"""What a multi-rank step costs beside one process: the split and the scatter of each batch,
the gather of the weights, and the peak extra memory of a gather against its bucket bound.

`python benchmarks/ranks_step.py [--ranks 2] [--steps 6] [--quick]` runs the job under torchrun
with 1 rank and with `--ranks` ranks (gloo, CPU), FSDP2 over a random Llama (about 12M
parameters), rank 0's producer on SimEngine (a simulation: random tokens, so the model's cost
is real and generation's is not: this measures asyncroll's share). Per step and rank: the time
in `split_batch` (rank 0), in the scatter (`Ranks.batch` after the batch is produced), in
`train_step`, in the gather (`Ranks.update_weights` without the engine's load: SimEngine's is a
label) and the extra RSS the gather took at its peak, sampled every millisecond, against
`bucket_bytes`. Prints a markdown table; the numbers are ratios on a noisy 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

BUCKET = 8 << 20


def model() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


class PeakRss:
    """The largest RSS over a block, sampled every millisecond in a thread."""

    def __init__(self) -> None:
        import psutil

        self._process = psutil.Process()
        self.base = self.peak = self._process.memory_info().rss
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


async def job(steps: int, out: Path) -> None:
    import torch
    from torch.distributed.fsdp import fully_shard

    from asyncroll import Producer, SamplingConfig
    from asyncroll.distributed import Ranks
    from asyncroll.distributed.gather import check_same_parameters, full_weights
    from asyncroll.engines import SimEngine
    from asyncroll.train import LossConfig, split_batch, to_batch, train_step

    torch.set_num_threads(1)
    rows: list[dict[str, float]] = []
    async with Ranks(timeout_s=600) as ranks:
        net = model()
        for layer in net.model.layers:
            fully_shard(layer)
        fully_shard(net)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
        producer = None
        if ranks.rollout:
            engine = SimEngine(vocab_size=8192, lengths="uniform", min_new_tokens=16, seed=0)
            producer = Producer(
                engine, ([2 + i % 100] * 16 for i in range(10**6)),
                lambda g: [float(i % 2) for i in range(g.num_samples)],
                group_size=8, batch_size=8, sampling=SamplingConfig(max_new_tokens=128),
            )  # fmt: skip
            await producer.__aenter__()
        split_s: list[float] = []

        def split(result: Any) -> list[Any]:
            start = time.perf_counter()
            shares = split_batch(to_batch(result.groups), ranks.world_size, max_tokens=2048)
            split_s.append(time.perf_counter() - start)
            return shares

        try:
            for step in range(steps):
                start = time.perf_counter()
                got = await ranks.batch(producer, split)
                assert got is not None
                shard, _ = got
                batch_s = time.perf_counter() - start
                start = time.perf_counter()
                await ranks.run(train_step, net, optimizer, shard, LossConfig())
                step_s = time.perf_counter() - start
                await ranks.run(check_same_parameters, net, ranks._control)
                with PeakRss() as rss:
                    start = time.perf_counter()
                    full = await ranks.run(
                        full_weights, net, keep=ranks.rollout, bucket_bytes=BUCKET
                    )
                    gather_s = time.perf_counter() - start
                start = time.perf_counter()
                await ranks.alone("update", update(producer, full.tensors))
                update_s = time.perf_counter() - start
                rows.append({
                    "step": step, "split_s": split_s[-1] if split_s and ranks.rollout else 0.0,
                    "batch_s": batch_s, "step_s": step_s, "gather_s": gather_s,
                    "update_s": update_s, "gather_extra_mib": (rss.peak - rss.base) / 2**20,
                    "bytes": full.stats.bytes, "peak_bucket_bytes": full.stats.peak_bucket_bytes,
                    "tokens": float(sum(int(m.batch.loss_mask.sum()) for m in shard.micro_batches)),
                })  # fmt: skip
        finally:
            if producer is not None:
                await producer.__aexit__(None, None, None)
    (out / f"rank{ranks.rank}.json").write_text(json.dumps(rows))


def update(producer: Any, weights: list[Any]) -> Any:
    """Rank 0's load of `weights` into its producer's engine; None elsewhere."""
    if producer is None:
        return None
    return lambda: producer.update_weights(weights)


def launch(ranks: int, steps: int) -> list[list[dict[str, float]]]:
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={ranks}", __file__, "--job", folder, "--steps", str(steps)],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        return [json.loads((Path(folder) / f"rank{r}.json").read_text()) for r in range(ranks)]


def summary(label: str, per_rank: list[list[dict[str, float]]]) -> list[str]:
    lines = []
    for rank, rows in enumerate(per_rank):
        rows = rows[1:] or rows  # the first step warms up
        mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
        total = mean["batch_s"] + mean["step_s"] + mean["gather_s"] + mean["update_s"]
        lines.append(
            f"| {label} | {rank} | {mean['split_s'] * 1e3:.1f} | {mean['batch_s'] * 1e3:.1f} | "
            f"{mean['step_s'] * 1e3:.0f} | {mean['gather_s'] * 1e3:.1f} | "
            f"{mean['update_s'] * 1e3:.1f} | "
            f"{(mean['batch_s'] + mean['gather_s'] + mean['update_s']) / total:.1%} | "
            f"{mean['gather_extra_mib']:.1f} | {mean['peak_bucket_bytes'] / 2**20:.1f} | "
            f"{mean['bytes'] / 2**20:.1f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--quick", action="store_true", help="2 steps: a smoke run")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        asyncio.run(job(args.steps, Path(args.job)))
        return
    steps = 2 if args.quick else args.steps
    print(
        "| ranks | rank | split ms | batch (produce + scatter) ms | train_step ms | gather ms | "
        "update ms | asyncroll's share | gather extra RSS MiB | bucket peak MiB | weights MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for ranks in (1, args.ranks):
        for line in summary(str(ranks), launch(ranks, steps)):
            print(line)
    print(f"\nbucket_bytes = {BUCKET >> 20} MiB; {os.cpu_count()} CPUs; steps after the first")


if __name__ == "__main__":
    main()
