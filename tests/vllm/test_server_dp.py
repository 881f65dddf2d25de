"""One `vllm serve --data-parallel-size 2` (two engine cores behind one endpoint) driven by
`VLLMServerEngine` as a single replica: every engine core must serve the weights of an update
under its label, and control calls (keep-pause, relabel, abort by id) must reach requests on
either core. docs/design.md, "Data-parallel vLLM servers", has what vLLM 0.32 routes where.

Then, last, the same server as the second of two replicas behind one engine (the session's
server the first): sessions stick to a replica; a replica whose API server is SIGKILLed in the
middle of a Producer run fails only its own groups while the run goes on with the other and
the ledger holds; restarted, it rejoins with the engine's current version label. The kill ends
the DP server's life, so that test costs one server start (the return), not two.

The server runs `--api-server-count 1`: with more API servers an abort by id is honoured only
by the API server that accepted the request (see the design section), and the engine sends
its aborts on a connection of its own. The update's reference is the weight-parity module's
(tests/vllm/test_weight_parity.py: a fresh engine on every tensor perturbed, made once a run).
Slow: a DP server takes 1-5 minutes to start on 2 shared cores.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import pytest_asyncio

from asyncroll import DropRecord, Producer, PutOutcome, RolloutGroup, SamplingConfig
from asyncroll.app.models import build_tiny_model
from asyncroll.engines import VLLMServerEngine
from asyncroll.engines.server.launch import ServerProcess
from asyncroll.engines.server.replicas import ReplicaState
from tests.made_once import made_once
from tests.vllm.conftest import DEADLINE_S, original_weights
from tests.vllm.helpers import ids, request
from tests.vllm.server import SERVER_MAX_MODEL_LEN, restore_session_server, server_engine_on
from tests.vllm.test_weight_parity import (
    VERSION,
    Case,
    assert_parity,
    load_case,
    make_cases,
    serve,
)

# The module's own server and, in the replica test, the session's: on the session server's
# worker under `pytest -n 2 --dist loadgroup`
pytestmark = pytest.mark.slow

ENGINE_CORES = 2
DP_MAX_MODEL_LEN = 8192
PROMPTS = [ids(0, 17 + i, 18 + i % 5, 19, 20 + i % 7) for i in range(16)]  # 16 distinct
# ~17 s per request unloaded: an update or an abort (well under a second) lands while it runs
LONG_TOKENS = DP_MAX_MODEL_LEN - 16
# The relabel test's budgets, tried in turn. A request that ran to its end before the update
# landed (every token labelled 0) makes its attempt prove nothing, and the next budget is
# tried; the last is the model's length, which every run used before. The test prints how many
# tokens each request made before the update landed: the first budget is meant to be several
# times that, so that it is the attempt that runs unless the machine stalls.
RELABEL_BUDGETS = (1024, 4096, LONG_TOKENS)
RUN_TO_END_S = 600.0


async def per_engine(url: str, metric: str) -> Counter[str]:
    """One Prometheus metric of the server summed per engine core (its `engine` label)."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as reply:
        assert reply.status == 200
        text = await reply.text()
    counts: Counter[str] = Counter()
    for line in text.splitlines():
        if line.startswith(metric + "{"):
            engine = re.search(r'engine="(\d+)"', line)
            assert engine is not None, line
            counts[engine.group(1)] += float(line.rsplit(" ", 1)[1])
    return counts


async def checksums(url: str) -> dict[str, str]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}/weight_checker", json={"action": "checksum"}) as reply,
    ):
        assert reply.status == 200, await reply.text()
        return dict((await reply.json())["checksums"])


@pytest.fixture(scope="module")
def dp_server(server_model: Path) -> Iterator[ServerProcess]:
    """The module's data-parallel server (stopped by process group at the end, if the
    replica test has not killed it)."""
    server = ServerProcess.start(
        server_model,
        max_model_len=DP_MAX_MODEL_LEN,
        extra_args=["--data-parallel-size", str(ENGINE_CORES), "--api-server-count", "1"],
    )
    try:
        yield server
    finally:
        server.stop()


@pytest_asyncio.fixture
async def dp_engine(
    dp_server: ServerProcess, tmp_path: Path, server_model: Path
) -> AsyncIterator[VLLMServerEngine]:
    engine = VLLMServerEngine(
        dp_server.url,
        vocab_size=512,
        max_model_len=DP_MAX_MODEL_LEN,
        weights_dir=tmp_path,
        control_timeout_s=DEADLINE_S,
        connect_timeout_s=DEADLINE_S,
        stream_interval=16,
    )
    try:
        yield engine
    finally:
        if engine.version != 0:
            await engine.update_weights(original_weights(server_model), version=0)
        await asyncio.wait_for(engine.close(), DEADLINE_S)


@pytest_asyncio.fixture(scope="module")
async def tied_case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    """The weight-parity module's tied case: every tensor perturbed, and what a fresh engine
    on them served (made once a run, before any engine under test starts). The DP server runs
    the same tensors with more positions, as the session's server does in that module."""
    root = await made_once(tmp_path_factory, "weight-parity", make_cases)
    return load_case(build_tiny_model(), root / "tied")


async def test_every_engine_core_serves_the_update_under_its_label(
    tied_case: Case, dp_server: ServerProcess, dp_engine: VLLMServerEngine
) -> None:
    """The weight-parity requests (greedy and seeded, sent at once: vLLM's DP front end
    spreads a burst round-robin over the engine cores) after an update equal a fresh engine
    loaded with the same weights token for token (logprobs within 1e-4), every token labelled
    with the update's version, and both cores served them; both report the same checksums."""
    server, engine, case = dp_server, dp_engine, tied_case
    before = await serve(engine, "before")
    pairs = zip(before, case.reference, strict=True)
    assert any(a.tokens.tolist() != b.tokens.tolist() for a, b in pairs)  # the update matters
    await engine.update_weights(case.weights, version=VERSION)
    served_before = await per_engine(server.url, "vllm:request_success_total")
    assert_parity(await serve(engine, "parity"), case.reference)  # the same ids: seeds
    served = await per_engine(server.url, "vllm:request_success_total") - served_before

    assert sorted(served) == [str(i) for i in range(ENGINE_CORES)], served  # both cores served
    assert sum(served.values()) == len(case.reference)
    sums = await checksums(server.url)
    ranks = {key.split(":", 1)[0] for key in sums}
    assert ranks == {f"dp{i}" for i in range(ENGINE_CORES)}, ranks
    for key, value in sums.items():
        if key.startswith("dp0:"):
            for i in range(1, ENGINE_CORES):
                assert sums[f"dp{i}:" + key.split(":", 1)[1]] == value, key


async def long_requests(
    engine: VLLMServerEngine, tag: str, count: int, tokens: int = LONG_TOKENS
) -> list[asyncio.Task]:
    """`count` greedy requests of `tokens` each, returned once each has its first token."""
    tasks = [
        asyncio.ensure_future(
            engine.generate(
                request(f"{tag}-{i}", PROMPTS[i], max_new_tokens=tokens, temperature=0.0)
            )
        )
        for i in range(count)
    ]
    await engine.wait_progress(
        lambda: all(engine.samples_started(f"{tag}-{i}") >= 1 for i in range(count)), DEADLINE_S
    )
    return tasks


async def test_an_update_relabels_requests_running_on_every_engine_core(
    dp_server: ServerProcess, dp_engine: VLLMServerEngine
) -> None:
    """A keep-pause update lands while requests run on both cores: each continues to its end,
    its tokens labelled 0 up to the update and 2 after it, in that order (labels are per engine
    core in vLLM: `/update_weight_version` must reach both). An attempt where requests ended
    before the update landed, or before the server counted them running on both cores, is
    run again with longer requests (`RELABEL_BUDGETS`)."""
    engine = dp_engine
    for attempt, tokens in enumerate(RELABEL_BUDGETS):
        last = attempt == len(RELABEL_BUDGETS) - 1
        tasks = await long_requests(engine, f"relabel{attempt}", 4, tokens)
        running = await per_engine(dp_server.url, "vllm:num_requests_running")
        await engine.update_weights(None, version=2)
        async with asyncio.timeout(RUN_TO_END_S):
            results = await asyncio.gather(*tasks)
        before_update = [int((out.versions == 0).sum()) for (out,) in results]
        print(f"{tokens}-token requests: {before_update} tokens each before the update landed")
        for (out,) in results:
            assert (out.finish_reason, len(out.tokens)) == ("length", tokens)
            assert set(out.versions.tolist()) <= {0, 2}
            assert (np.diff(out.versions) >= 0).all()
        on_every_core = all(running[str(i)] > 0 for i in range(ENGINE_CORES))
        if last or (on_every_core and all(2 in out.versions for (out,) in results)):
            break
        await engine.update_weights(None, version=0)  # some ended first: again, longer
    assert on_every_core, running
    for (out,) in results:
        assert set(out.versions.tolist()) == {0, 2}


async def test_an_abort_by_id_reaches_a_request_on_either_engine_core(
    dp_server: ServerProcess, dp_engine: VLLMServerEngine
) -> None:
    """vLLM's DP front end sends an abort to the engine core it routed the request to (from
    its own table of requests in flight): each returns its partial samples."""
    engine = dp_engine
    tasks = await long_requests(engine, "abort", 4)
    running = await per_engine(dp_server.url, "vllm:num_requests_running")
    for i in range(len(tasks)):
        await engine.abort(f"abort-{i}")
    async with asyncio.timeout(DEADLINE_S):
        results = await asyncio.gather(*tasks)
    assert all(running[str(i)] > 0 for i in range(ENGINE_CORES)), running
    for (out,) in results:
        assert out.finish_reason == "abort"
        assert 0 < len(out.tokens) < LONG_TOKENS


async def zero_reward(group: RolloutGroup) -> list[float]:
    return [0.0] * len(group.samples)


async def served_by(engine: VLLMServerEngine, rid: str) -> int:
    """Run one small request; the index of the replica it went to."""
    before = [r.sent for r in engine.replicas]
    await engine.generate(request(rid, ids(0, 5, 6), n=2, max_new_tokens=4))
    (index,) = [i for i, r in enumerate(engine.replicas) if r.sent != before[i]]
    return index


async def test_sticky_sessions_a_killed_replica_and_its_return(
    vllm_server: ServerProcess,
    dp_server: ServerProcess,
    server_model: Path,
    server_weights_dir: Path,
) -> None:
    """Last in the module: it kills the DP server. Back, the replica is a plain server."""
    second = dp_server
    engine = server_engine_on(
        [vllm_server.url, second.url], server_weights_dir, health_interval_s=60.0
    )
    try:
        # Sticky: every attempt of a session meets the same replica; sessions use both.
        homes = {}
        for k in range(24):
            where = {await served_by(engine, f"sticky{k}-{attempt}") for attempt in range(3)}
            assert len(where) == 1, f"session {k} moved between replicas: {where}"
            homes[k] = where.pop()
        assert set(homes.values()) == {0, 1}

        # SIGKILL the second replica's API server while it streams groups of a Producer run.
        drops: list[DropRecord] = []
        producer = Producer(
            engine,
            [[0, 5 + i % 40, 7] for i in range(24)],
            zero_reward,
            group_size=4,
            sampling=SamplingConfig(max_new_tokens=120, ignore_eos=True),
            max_inflight_groups=8,
            on_drop=drops.append,
        )
        killed = engine.replicas[1]
        consumed: list[RolloutGroup] = []
        async with producer:
            await engine.wait_progress(lambda: killed.streams >= 2, DEADLINE_S)
            second.kill_api_server()
            async with asyncio.timeout(10 * DEADLINE_S):
                async for batch in producer.batches(4):
                    producer.check_ledger()
                    consumed += batch.groups
        ledger = producer.check_ledger()
        # Its streams were lost and its liveness probe failed: each of its groups, nothing of
        # it left running there, was routed to the replica that serves (none failed).
        failed = [d.error for d in drops if d.outcome is PutOutcome.DROPPED_FAILED]
        assert not failed, failed
        assert len(consumed) == 24 == ledger.started_groups
        assert ledger.in_flight_groups == 0
        assert killed.state is ReplicaState.DOWN and engine.replicas[0].state is ReplicaState.UP
        assert "generate stream lost" in str(killed.error), killed.error

        # Back on its port, it rejoins once probed, labelled with the engine's version.
        await engine.update_weights(None, version=2)  # only the first replica hears it
        await asyncio.to_thread(second.stop)
        second = await asyncio.to_thread(
            ServerProcess.start,
            server_model,
            port=int(second.url.rsplit(":", 1)[1]),
            max_model_len=SERVER_MAX_MODEL_LEN,
        )
        await engine.check_replicas()
        assert killed.state is ReplicaState.UP, killed.error
        session = next(k for k, home in homes.items() if home == 1)
        assert await served_by(engine, f"sticky{session}-9") == 1
        (out,) = await engine.generate(request(f"sticky{session}-10", ids(0, 5), max_new_tokens=4))
        assert (out.versions == 2).all()
    finally:
        await engine.close()
        await asyncio.to_thread(second.stop)
        # the session's server was this engine's first replica, relabelled 2 above
        await restore_session_server(vllm_server, server_weights_dir, server_model)
