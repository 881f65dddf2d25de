"""One training run that checkpoints and may be killed; driven by tests/test_resume_after_kill.py.

The "trainer" journals every terminal event it sees: prompts handed to it, and prompts the
producer dropped (on_drop). Its checkpoint is the producer's state plus the journal so far,
taken together inside `producer.pausing()` so the two describe the same instant.

    python -m tests.resume_run DIR --save-at K --kill-at M   # dies by SIGKILL at step M
    python -m tests.resume_run DIR --resume                  # continues from DIR/ckpt

With `--multi` every sample is a three-turn episode (a tool answers each policy turn), so the
checkpoint is taken with episodes in flight: they restart from their prompt on resume.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np

from asyncroll import DropRecord, Episode, Producer, PutOutcome, SamplingConfig, SimEngine
from asyncroll._core.state import dumps, write_atomic

PROMPTS = 160
BATCH = 8


async def reward(group: Any) -> list[float]:
    return [float(len(s.tokens) % 2) for s in group.samples]


async def tool_agent(episode: Episode) -> None:
    for _ in range(3):
        turn = await episode.generate(max_new_tokens=8)
        episode.append(np.array([2 + int(turn.tokens[-1]) % 50] * 2) if len(turn.tokens) else [2])


def make_producer(journal: list[list[Any]], multi: bool = False) -> Producer:
    def dropped(record: DropRecord) -> None:
        if record.outcome is not PutOutcome.DROPPED_EXPIRED:  # expired prompts come back
            journal.append(["dropped", record.prompt_id, record.outcome.value])

    engine = SimEngine(
        vocab_size=1000, per_token_latency_s=0.0005, lengths="uniform",
        fail_rate=0.02 if multi else 0.1, seed=5,
    )  # fmt: skip
    prompts = [[1 + (i * 13 + j) % 997 for j in range(4)] for i in range(PROMPTS)]
    return Producer(
        engine, prompts, reward, group_size=4, sampling=SamplingConfig(max_new_tokens=32),
        filter="nonzero_std", batch_size=BATCH, max_staleness=1, on_drop=dropped,
        rollout_fn=tool_agent if multi else None,
    )  # fmt: skip


async def run(
    out: Path, save_at: int | None, kill_at: int | None, resume: bool, multi: bool
) -> None:
    journal: list[list[Any]] = []
    producer = make_producer(journal, multi)
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
                if multi:  # checkpoint with episodes in flight: wait for one to start
                    await producer._changed.wait_until(
                        lambda: producer.ledger().in_flight_groups > 0, 60
                    )
                async with producer.pausing():
                    write_atomic(out / "ckpt", dumps(producer.state_dict()))
                    in_flight = producer.ledger().in_flight_groups  # episodes parked
                    write_atomic(
                        out / "journal.json",
                        json.dumps(
                            {"step": step, "journal": journal, "in_flight": in_flight}
                        ).encode(),
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
    parser.add_argument("--multi", action="store_true", help="three-turn episodes")
    args = parser.parse_args()
    asyncio.run(run(args.out, args.save_at, args.kill_at, args.resume, args.multi))


if __name__ == "__main__":
    main()
