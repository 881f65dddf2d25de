"""A generate stream to the session's real `vllm serve` whose connection is cut mid-way (here
from the client's side: its socket shut down) while the server serves on. A `pytest -n 4` run
saw the server drop one such connection under load, and the group failed with a
`ReplicaError` (tests/test_server_lost_stream.py has every case against scripted replicas)."""

from __future__ import annotations

import asyncio
import socket

import numpy as np

from asyncroll.engines import VLLMServerEngine
from tests.vllm.conftest import DEADLINE_S
from tests.vllm.helpers import ids, request

PROMPT = ids(0, 17, 18, 19, 20)
BUDGET = 1024  # long enough that the stream is still open once its first tokens arrived
STREAM_INTERVAL = 8  # tokens per event: the first ones arrive long before the end


def cut_streams(engine: VLLMServerEngine) -> int:
    """Shut down the socket of every generate stream the engine has open (its stream pool's
    connections in use; control calls have a pool of their own); how many."""
    session = engine._client.session()
    connector = session.connector
    assert connector is not None
    cut = 0
    for protocol in list(connector._acquired):
        transport = protocol.transport
        if transport is not None:
            transport.get_extra_info("socket").shutdown(socket.SHUT_RDWR)
            cut += 1
    return cut


async def test_a_stream_cut_mid_way_is_sent_again_and_completes_exactly(
    server_engine: VLLMServerEngine,
) -> None:
    """The group completes, sent once more after the replica's liveness check; greedy, so its
    tokens and logprobs are an uncut request's, every token at the engine's version."""
    engine = server_engine
    async with asyncio.timeout(DEADLINE_S):
        (short,) = await engine.generate(
            request("lost-ref", PROMPT, max_new_tokens=32, temperature=0.0)
        )
    (replica,) = engine.replicas
    sent = replica.sent
    saved, engine.stream_interval = engine.stream_interval, STREAM_INTERVAL
    try:
        call = asyncio.ensure_future(
            engine.generate(request("lost-cut", PROMPT, max_new_tokens=BUDGET, temperature=0.0))
        )
        await engine.wait_progress(lambda: engine.samples_started("lost-cut") == 1, DEADLINE_S)
        assert cut_streams(engine) == 1
        async with asyncio.timeout(DEADLINE_S):
            (out,) = await call
    finally:
        engine.stream_interval = saved
    assert replica.sent == sent + 2  # cut, then sent again
    assert (out.finish_reason, len(out.tokens)) == ("length", BUDGET)
    assert np.array_equal(out.tokens[:32], short.tokens)
    np.testing.assert_allclose(out.logprobs[:32], short.logprobs, atol=1e-4)
    assert (out.versions == engine.version).all()
    assert engine.running_requests == 0
