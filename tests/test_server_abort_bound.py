"""An abort ends its request within one control call and a token's time: the `/abort_requests`
call `abort()` makes (at most `pause_timeout_s`), then the replica's last event; nothing after
the abort waits for another control call. Run on the control-plane simulation's virtual clock
(`benchmarks/control_sim.py`), where a control call takes exactly as long as the test says."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import control_sim

from asyncroll.engines import GenerateRequest, SampleRequest, SamplingConfig, VLLMServerEngine
from asyncroll.engines.server.replicas import ReplicaError
from tests.test_server_pause_bound import SLOW_S, SlowReplica, _simulated

ONE_CALL_S = SLOW_S + 0.005 + 2 * control_sim.TOKEN_S  # a slow call, its latency, a token


def _long(rid: str) -> GenerateRequest:
    """A request that samples for a while (50 tokens) unless aborted."""
    return GenerateRequest(
        request_id=rid,
        prompt_tokens=np.array([1, 2], np.int32),
        samples=(SampleRequest(np.zeros(0, np.int32), 50),),
        sampling=SamplingConfig(max_new_tokens=50, temperature=1.0),
    )


async def _streaming(engine: VLLMServerEngine, sim: SlowReplica, rid: str) -> asyncio.Task[Any]:
    """`generate(_long(rid))` in a task, once its stream reached `sim`."""
    call = asyncio.ensure_future(engine.generate(_long(rid)))
    await sim.until_called(f"generate {rid}/n0")
    return call


async def _ended_after_abort(
    loop: asyncio.AbstractEventLoop, engine: VLLMServerEngine, rid: str, call: asyncio.Task[Any]
) -> float:
    """Abort `rid`; how long after it `call` ended (returned or raised)."""
    start = loop.time()
    abort = asyncio.ensure_future(engine.abort(rid))
    await asyncio.gather(call, return_exceptions=True)
    took = loop.time() - start
    await abort
    return took


def test_a_request_frozen_by_a_pause_ends_one_abort_call_after_its_abort(tmp_path: Path) -> None:
    """`control_sim --sluggish` seeds 585 and 750: the abort reached the frozen request, whose
    stream then ended with its first event; at that event the stream made a second
    `/abort_requests` call (for an abort that may have beaten the request to the replica)
    and waited for it before ending: 0.57-0.65 s after the abort, past the bound."""

    async def test(
        engine: VLLMServerEngine, loop: asyncio.AbstractEventLoop, sims: list[SlowReplica]
    ) -> None:
        await engine.check_replicas()
        call = await _streaming(engine, sims[0], "run-0-0")
        await engine.pause_generation()  # keep mode: the request is frozen on its replica
        sims[0].slow = {"/abort_requests"}
        took = await _ended_after_abort(loop, engine, "run-0-0", call)
        (sample,) = call.result()
        assert sample.finish_reason == "abort"
        assert took <= ONE_CALL_S, f"{took:.3f} s > {ONE_CALL_S:.3f} s"
        await engine.resume_generation()

    _simulated(test, 1, tmp_path)


def test_a_request_whose_stream_breaks_after_its_abort_does_not_wait_for_another_abort(
    tmp_path: Path,
) -> None:
    """`control_sim --sluggish` seed 859: the replica died while the abort's call was on its
    way; the broken stream's error path then aborted the request's other parts, and waited
    for that call (a dead replica's, tried twice) before raising: 0.65 s after the abort."""

    async def test(
        engine: VLLMServerEngine, loop: asyncio.AbstractEventLoop, sims: list[SlowReplica]
    ) -> None:
        await engine.check_replicas()
        call = await _streaming(engine, sims[0], "run-0-0")
        sims[0].slow = {"/abort_requests"}

        def crash() -> None:  # the abort's call is on its way
            sims[0].crashed = True
            sims[0].poke()

        loop.call_later(SLOW_S / 2, crash)
        took = await _ended_after_abort(loop, engine, "run-0-0", call)
        assert isinstance(call.exception(), ReplicaError) or call.result()[0].finish_reason
        assert took <= engine.pause_timeout_s + 2 * control_sim.TOKEN_S, f"{took:.3f} s"
        assert took <= SLOW_S, f"{took:.3f} s: it waited for a call after the stream broke"

    _simulated(test, 1, tmp_path)
