"""A trainer that owns a `VLLMEngine` and waits to be killed; driven by
tests/vllm/test_killed_trainer.py.

It runs as a `multiprocessing` spawn child (as `torch.multiprocessing.spawn` starts a rank):
not the main script, its engine started from a function. Once the engine has served one
request it sends the pids of every process below it (vLLM's engine core and workers, the
multiprocessing resource tracker, and whatever asyncroll started), then waits for its signal.
"""

from __future__ import annotations

import asyncio
import os
from multiprocessing.connection import Connection

import psutil

from asyncroll.engines import VLLMEngine
from tests.vllm.helpers import ids, request


def run(model: str, report: Connection) -> None:
    asyncio.run(serve_until_killed(model, report))


async def serve_until_killed(model: str, report: Connection) -> None:
    engine = VLLMEngine(model, max_model_len=128, seed=0)
    try:
        await engine.generate(request("first", ids(0, 5, 6), 1, 4))
        below = psutil.Process(os.getpid()).children(recursive=True)
        report.send([(p.pid, " ".join(p.cmdline()).strip() or p.name()) for p in below])
        await asyncio.Event().wait()  # until the test's signal
    finally:
        await engine.close()
        report.send("closed")  # the engine closed: only a handled signal gets here
