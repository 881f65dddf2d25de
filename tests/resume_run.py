"""One training run that checkpoints and may be killed; driven by tests/test_resume_after_kill.py.

The "trainer" journals every terminal event it sees: prompts handed to it, and prompts the
producer dropped (on_drop). Its checkpoint is the producer's state plus the journal so far,
taken together inside `producer.pausing()` so the two describe the same instant.

    python -m tests.resume_run DIR --save-at K --kill-at M   # dies by SIGKILL at step M
    python -m tests.resume_run DIR --resume                  # continues from DIR/ckpt
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

from asyncroll import DropRecord, Producer, PutOutcome, SamplingConfig, SimEngine
from asyncroll.state import dumps, write_atomic

PROMPTS = 160
BATCH = 8


async def reward(group: Any) -> list[float]:
    return [float(len(s.tokens) % 2) for s in group.samples]


def make_producer(journal: list[list[Any]]) -> Producer:
    def dropped(record: DropRecord) -> None:
        if record.outcome is not PutOutcome.DROPPED_EXPIRED:  # expired prompts come back
            journal.append(["dropped", record.prompt_id, record.outcome.value])

    engine = SimEngine(
        vocab_size=1000, per_token_latency_s=0.0005, lengths="uniform", fail_rate=0.1, seed=5
    )
    prompts = [[1 + (i * 13 + j) % 997 for j in range(4)] for i in range(PROMPTS)]
    return Producer(
        engine, prompts, reward, group_size=4, sampling=SamplingConfig(max_new_tokens=32),
        filter="nonzero_std", batch_size=BATCH, max_staleness=1, on_drop=dropped,
    )  # fmt: skip


async def run(out: Path, save_at: int | None, kill_at: int | None, resume: bool) -> None:
    journal: list[list[Any]] = []
    producer = make_producer(journal)
    step = 0
    if resume:
        saved = json.loads((out / "journal.json").read_text())
        journal += saved["journal"]
        step = saved["step"]
        producer.load(out / "ckpt", weights=None)  # SimEngine: nothing to reload
    async with producer:
        async for batch in producer.batches():
            journal += [["consumed", g.prompt_id] for g in batch.groups]
            step += 1
            await producer.update_weights(None)
            if step == save_at:
                async with producer.pausing():
                    write_atomic(out / "ckpt", dumps(producer.state_dict()))
                    write_atomic(
                        out / "journal.json",
                        json.dumps({"step": step, "journal": journal}).encode(),
                    )
            if step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
    counters = producer.check_ledger()
    (out / "final.json").write_text(
        json.dumps(
            {
                "journal": journal,
                "ledger": {f: getattr(counters, f) for f in counters.__struct_fields__},
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--save-at", type=int)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    asyncio.run(run(args.out, args.save_at, args.kill_at, args.resume))


if __name__ == "__main__":
    main()
