"""`asyncroll demo --ranks N`: the echo demo with its trainer sharded over N ranks.

The command re-executes itself under torchrun (`python -m torch.distributed.run --standalone
--nproc-per-node N -m asyncroll.app.demo_ranks CONFIG`, gloo on CPU): every rank builds the
same tiny model, shards it with FSDP2 (`fully_shard` per decoder layer, then the whole) and
trains its share of each batch with `train_step`; rank 0 alone starts vLLM and the producer
(the other ranks never import vLLM), hands each rank its share (`Ranks.batch`), and loads the
gathered weights into vLLM after each step (`Ranks.update_weights`). The loss is the one
process demo's (GRPO with the same correction, clip and gradient clipping), so it learns as
that one does. Rank 0 writes the run record as the one-process demo does (the groups, their
advantages and each step's numbers; not the trainer's logprobs, which each rank computes for
its own share) and its report. docs/whole-machine.md explains each line.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

import msgspec

from asyncroll.app.demo import DemoConfig, demo_model, echo_prompts, echo_reward, solved
from asyncroll.app.demo_report import (
    StepRecord,
    log_record,
    postfix,
    step_numbers,
    step_record,
    summarise,
)
from asyncroll.engines.base import SamplingConfig
from asyncroll.record import RecordConfig, record_files


def command(cfg: DemoConfig, verbose: bool) -> list[str]:
    """The torchrun command line that runs `cfg` on its ranks."""
    payload = msgspec.json.encode(cfg).decode()
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={cfg.ranks}", "-m", "asyncroll.app.demo_ranks", payload,
        *(["--verbose"] if verbose else []),
    ]  # fmt: skip


async def run_ranks(cfg: DemoConfig, *, console: TextIO, progress: bool = True) -> None:
    """One rank's part of the run (every rank calls it, under torchrun)."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from asyncroll.distributed import Ranks
    from asyncroll.report import build_report
    from asyncroll.train import CORRECTIONS, LossConfig, split_batch, to_batch, train_step

    torch.set_num_threads(1)  # the ranks and vLLM's worker share the machine's cores
    model_dir = demo_model(cfg)
    sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens)
    loss = LossConfig.for_sampling(sampling, correction=CORRECTIONS[cfg.correction])
    async with Ranks(timeout_s=cfg.batch_timeout_s + 60) as ranks:
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.train()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        prompt_len = 3  # bos, the letter, ":"
        max_tokens = cfg.group_size * (prompt_len + cfg.max_new_tokens)  # a group per pass

        out = Path(cfg.out)
        records: list[StepRecord] = []
        staleness: Counter[int] = Counter()
        async with _rollouts(cfg, model_dir, sampling, ranks.rollout) as producer:

            def split(result: Any, step: int) -> list[Any]:
                """Rank 0's: each rank's share of the batch, and the record's advantages."""
                batch = to_batch(result.groups, advantage="grpo", pad_id=2)
                producer.record.attach(result.groups, step=step, advantages=batch.advantages)
                return split_batch(batch, ranks.world_size, max_tokens=max_tokens)

            bar = tqdm(
                total=cfg.steps, disable=not (progress and ranks.rollout), file=console,
                desc=f"GRPO echo, {ranks.world_size} ranks",
            )  # fmt: skip
            for step in range(1, cfg.steps + 1):
                start = time.perf_counter()
                share = functools.partial(split, step=step)
                got = await ranks.batch(producer, share, timeout=cfg.batch_timeout_s)
                if got is None:
                    break
                shard, result = got
                waited = time.perf_counter() - start
                train_start = time.perf_counter()
                stats = await ranks.run(
                    train_step, model, optimizer, shard, loss, max_grad_norm=1.0
                )
                train_s = time.perf_counter() - train_start
                await ranks.update_weights(model, producer)
                if result is not None:
                    staleness.update(result.staleness_tokens())
                    records.append(
                        step_record(step, result, stats["train/loss"], {}, train_s, waited, start)
                    )
                    records[-1].task_metrics = {
                        k: v for k, v in stats.items() if k.startswith("train/")
                    }
                    log_record(out, records[-1])
                    producer.record.step_metrics(step, step_numbers(records[-1]))
                    bar.update(1)
                    bar.set_postfix(postfix(records[-1]))
                if await ranks.decide(
                    solved(records, cfg.solved_reward) if ranks.rollout else None
                ):
                    break
            bar.close()
            if producer is not None:
                producer.check_ledger()
        if producer is not None:  # the record's writer has ended with the producer
            report = build_report(out)
            summary = summarise(
                out, records, producer.progress.counters.copy(), staleness, "echo", [], report
            )
            print(f"{ranks.world_size} ranks (FSDP2, gloo)\n{summary}", file=console)


@contextlib.asynccontextmanager
async def _rollouts(
    cfg: DemoConfig, model_dir: Path, sampling: SamplingConfig, rollout: bool
) -> Any:
    """Rank 0: vLLM and the producer, as the one-process demo makes them; elsewhere None
    (vLLM is never imported there)."""
    if not rollout:
        yield None
        return
    from tokenizers import Tokenizer

    from asyncroll.engines import VLLMEngine
    from asyncroll.producer import Producer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    out = Path(cfg.out)
    for old in record_files(out):  # an earlier run's: this one starts anew (no --resume here)
        old.unlink()
    async with VLLMEngine(model_dir, seed=cfg.seed) as engine:
        producer = Producer(
            engine, echo_prompts(tokenizer, cfg.seed), echo_reward,
            group_size=cfg.group_size, batch_size=cfg.batch_groups,
            max_staleness=cfg.max_staleness, sampling=sampling,
            filter=None if cfg.filter == "none" else cfg.filter, reward_in_thread=False,
            record=RecordConfig(dir=str(out), tokenizer=tokenizer),
        )  # fmt: skip
        async with producer:
            yield producer


def main(argv: list[str] | None = None) -> None:
    """The ranks' entry point (torchrun runs it once per rank)."""
    import os

    from asyncroll.app.cli import engine_output

    args = list(sys.argv[1:] if argv is None else argv)
    verbose = "--verbose" in args
    cfg = msgspec.json.decode(args[0], type=DemoConfig)
    out = Path(cfg.out)
    rank = int(os.environ.get("RANK", "0"))
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / ("engine.log" if rank == 0 else f"rank{rank}.log")
    with engine_output(log_path, verbose=verbose) as console:
        asyncio.run(run_ranks(cfg, console=console))


if __name__ == "__main__":
    main()
