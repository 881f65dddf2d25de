"""`VLLMServerEngine` with NCCL weight transfer, without a GPU: a SIMULATION.

The replicas are aiohttp stubs of vLLM's control routes that record every call, and the
trainer's side is `FakeSender`, which moves no tensor: it only keeps the rendezvous a real
NCCL group imposes (a replica's `/init_weight_transfer_engine` returns once the trainer has
joined, its `/update_weights` once the trainer has sent, and the send waits for every replica
to be receiving). What this checks is the engine's sequence of calls, admission and failure
handling; the real transfer is `tests/vllm/test_server_nccl.py` (GPU only).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from aiohttp import web

from asyncroll.engines import (
    GenerateRequest,
    ReplicaError,
    SampleRequest,
    SamplingConfig,
    VLLMServerEngine,
)
from asyncroll.engines.server.nccl_transfer import NCCLWeightTransfer
from asyncroll.engines.server.replicas import NoReplicaError, ReplicaState
from tests.stubs import served

WAIT_S = 5.0


class FakeSender:
    """A simulated trainer side (no NCCL): records its calls in the shared `log` and keeps
    the rendezvous of a real group (see the module docstring). `gate`: when set, `send`
    waits for it after every replica is receiving."""

    def __init__(self, log: list[tuple[str, str]]) -> None:
        self.timeout_s = WAIT_S
        self.log = log
        self.receiving = 0  # replicas inside /update_weights now
        self.members = 0
        self.all_receiving = asyncio.Event()
        self.waiting = asyncio.Event()  # the send waits for `gate`
        self.joined = asyncio.Event()
        self.settled = asyncio.Event()  # the send ended (sent, or left mid-way)
        self.sent = False
        self.gate: asyncio.Event | None = None
        self.groups: list[dict[str, Any]] = []

    def new_group(self, world_size: int) -> dict[str, Any]:
        self.leave()
        self.joined = asyncio.Event()
        info = {"master_address": "sim", "master_port": 1 + len(self.groups)}
        self.groups.append({**info, "world_size": world_size})
        self.log.append(("trainer", f"new_group {world_size}"))
        return {**info, "world_size": world_size}

    async def join(self) -> None:
        self.log.append(("trainer", "join"))
        self.joined.set()

    async def send(self, named: list[tuple[str, Any]]) -> None:
        self.sent, self.settled = False, asyncio.Event()
        async with asyncio.timeout(WAIT_S):
            await self.all_receiving.wait()  # a broadcast needs every rank
            if self.gate is not None:
                self.waiting.set()
                await self.gate.wait()
        self.log.append(("trainer", f"send {[name for name, _ in named]}"))
        self.sent = True
        self.settled.set()

    def leave(self) -> None:
        self.log.append(("trainer", "leave"))
        self.settled.set()


class TransferStub:
    """A replica's control routes, weight-transfer ones included, and a generate that
    answers one token labelled with the replica's version label. `configured`: started with
    `--weight-transfer-config` (else those routes answer 500 as vLLM's do); `fail_update`,
    `fail_init`: `/update_weights`, `/init_weight_transfer_engine` answer 500."""

    def __init__(self, name: str, log: list[tuple[str, str]], sender: FakeSender, size: int):
        self.name = name
        self.log = log
        self.sender = sender
        self.world_size = size
        self.configured = True
        self.fail_update = False
        self.fail_init = False
        self.drop: set[str] = set()  # routes that close the connection unanswered, once
        self.alive = True  # False: every route answers 503, as a server that went away
        self.label = "default"
        self.joined = False  # in the trainer's NCCL group (`/init_weight_transfer_engine`)
        self.init_infos: list[dict[str, Any]] = []
        self.update_infos: list[dict[str, Any]] = []
        self.lives = 0  # restarts so far: its process identity (`asyncroll_process`)
        self.restart_at: set[str] = set()  # routes whose next call a new process takes
        # A started update not finished (vLLM's worker `_weight_update_active`): a second
        # start and a shutdown are refused, a failed receive ends it (v1/worker/gpu_worker.py)
        self.updating = False

    def calls(self) -> list[str]:
        return [call for who, call in self.log if who == self.name]

    def restart(self) -> None:
        """A new server process in the same place: vLLM's initial label, its own weights, in
        no NCCL group; it answers every probe as before."""
        self.label, self.joined = "default", False
        self.lives += 1

    def app(self) -> web.Application:
        def record(call: str) -> None:
            self.log.append((self.name, call))

        def not_configured() -> web.Response:
            text = "RuntimeError: Weight transfer not configured. Please set weight_transfer_config"
            return web.Response(status=500, text=text)

        async def ok(_: web.Request) -> web.Response:
            return web.json_response({"success": True})

        async def control(request: web.Request) -> web.Response:
            record(request.path)
            return web.json_response({"status": "ok"})

        async def transfer(request: web.Request) -> web.Response:
            if not self.configured:
                return not_configured()
            record(request.path)
            if request.path == "/start_weight_update":
                if self.updating:
                    text = "RuntimeError: start_weight_update called while a weight update is "
                    return web.Response(status=500, text=text + "already active.")
                self.updating = True
            elif request.path == "/finish_weight_update":
                if not self.updating:
                    text = "RuntimeError: finish_weight_update called without a matching start"
                    return web.Response(status=500, text=text)
                self.updating = False
            if request.path in self.drop:  # the step ran; its answer is lost
                self.drop.discard(request.path)
                assert request.transport is not None
                request.transport.abort()
            return web.json_response({"message": "ok"})

        async def world_size(_: web.Request) -> web.Response:
            return web.json_response({"world_size": self.world_size})

        async def init(request: web.Request) -> web.Response:
            if not self.configured:
                return not_configured()
            if self.fail_init:
                return web.Response(status=500, text="RuntimeError: NCCL error: unhandled")
            self.init_infos.append((await request.json())["init_info"])
            self.joined = True
            record(request.path)
            await asyncio.wait_for(self.sender.joined.wait(), WAIT_S)  # NCCL rendezvous
            return web.json_response({"message": "Weight transfer initialized"})

        async def update(request: web.Request) -> web.Response:
            answer = await receive(request)
            if answer.status != 200:
                self.updating = False  # vLLM's worker ends the update when a receive fails
            return answer

        async def receive(request: web.Request) -> web.Response:
            if self.fail_update:
                return web.Response(status=500, text="ValueError: bad update_info")
            if not self.joined:  # vLLM's words; on GPUs the trainer's broadcast would hang
                text = "RuntimeError: NCCL weight transfer not initialized. Call init_transfer"
                return web.Response(status=500, text=text + "_engine() first.")
            self.update_infos.append((await request.json())["update_info"])
            record("/update_weights receiving")
            self.sender.receiving += 1
            if self.sender.receiving == self.sender.members:
                self.sender.all_receiving.set()
            try:
                await asyncio.wait_for(self.sender.settled.wait(), WAIT_S)
            finally:
                self.sender.receiving -= 1
                self.sender.all_receiving.clear()
            if not self.sender.sent:
                return web.Response(status=500, text="NCCL aborted")
            record("/update_weights received")
            return web.json_response({"message": "Weights updated"})

        async def shutdown(request: web.Request) -> web.Response:
            if self.updating:
                text = "RuntimeError: Cannot release a trainer connection during a weight update"
                return web.Response(status=500, text=text)
            self.joined = False
            return await control(request)

        async def weight_info(_: web.Request) -> web.Response:
            return web.json_response({"weight_version": self.label})

        async def version(request: web.Request) -> web.Response:
            if request.path in self.restart_at:
                self.restart_at.discard(request.path)
                self.restart()
            self.label = (await request.json())["new_version"]
            record(f"/update_weight_version {self.label}")
            return web.json_response({"success": True})

        async def process(request: web.Request) -> web.Response:
            assert (await request.json())["method"] == "asyncroll_process"
            return web.json_response({"results": [f"{self.name}.{self.lives}"]})

        async def generate(request: web.Request) -> web.Response:
            if not (await request.json())["request_id"].startswith("asyncroll-liveness"):
                record("generate")  # the engine's liveness probes are not the test's requests
            choice = {
                "index": 0,
                "token_ids": [7],
                "finish_reason": "length",
                "logprobs": {"content": [{"token_id": 7, "logprob": -0.5}]},
                "weight_versions": [{"version": self.label, "start": 0, "end": 1}],
            }
            reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await reply.prepare(request)
            event = json.dumps({"choices": [choice]})
            await reply.write(f"data: {event}\n\ndata: [DONE]\n\n".encode())
            await reply.write_eof()
            return reply

        @web.middleware
        async def gone(request: web.Request, handler: Any) -> web.StreamResponse:
            if not self.alive:
                return web.Response(status=503, text="gone")
            return await handler(request)  # type: ignore[no-any-return]

        app = web.Application(middlewares=[gone])
        app.router.add_get("/health", ok)
        app.router.add_post("/reset_prefix_cache", ok)
        for path in ("/pause", "/resume"):
            app.router.add_post(path, control)
        for path in ("/start_weight_update", "/finish_weight_update"):
            app.router.add_post(path, transfer)
        app.router.add_post("/shutdown_weight_transfer_engine", shutdown)
        app.router.add_get("/weight_info", weight_info)
        app.router.add_get("/get_world_size", world_size)
        app.router.add_post("/init_weight_transfer_engine", init)
        app.router.add_post("/update_weights", update)
        app.router.add_post("/update_weight_version", version)
        app.router.add_post("/collective_rpc", process)
        app.router.add_post("/inference/v1/generate", generate)
        return app


class Setup:
    def __init__(self, engine: VLLMServerEngine, sender: FakeSender, stubs: list[TransferStub]):
        self.engine = engine
        self.sender = sender
        self.stubs = stubs


@pytest_asyncio.fixture
async def setup() -> AsyncIterator[Setup]:
    """Two replicas (one worker, and two: tensor parallel 2) and the simulated trainer."""
    log: list[tuple[str, str]] = []
    sender = FakeSender(log)
    stubs = [TransferStub(f"r{i}", log, sender, size) for i, size in enumerate((1, 2))]
    async with served([stub.app() for stub in stubs]) as urls:
        engine = VLLMServerEngine(
            urls, vocab_size=512, control_timeout_s=WAIT_S, weight_transfer=sender
        )
        sender.members = len(stubs)
        try:
            yield Setup(engine, sender, stubs)
        finally:
            await engine.close()


def _request(rid: str) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        prompt_tokens=np.array([0, 5], np.int32),
        samples=(SampleRequest(np.zeros(0, np.int32), 1),),
        sampling=SamplingConfig(max_new_tokens=1),
    )


WEIGHTS = [("w", np.ones((2, 3), np.float32)), ("b", np.zeros(3, np.float32))]


async def test_an_update_freezes_receives_while_the_trainer_sends_labels_and_resumes(
    setup: Setup,
) -> None:
    engine, sender, stubs = setup.engine, setup.sender, setup.stubs
    await engine.update_weights(WEIGHTS, version=1)
    assert engine.version == 1
    for stub in stubs:
        assert stub.calls() == [
            "/pause",  # the first sync: paused before it is synced, resumed after
            "/update_weight_version 0",
            "/resume",
            "/pause",
            "/init_weight_transfer_engine",
            "/start_weight_update",
            "/update_weights receiving",
            "/update_weights received",
            "/finish_weight_update",
            "/update_weight_version 1",
            "/resume",
        ]
        assert stub.update_infos == [
            {"names": ["w", "b"], "dtype_names": ["float32"] * 2, "shapes": [[2, 3], [3]]}
        ]
    # the trainer is rank 0, r0's worker rank 1, r1's two workers ranks 2 and 3
    assert sender.groups == [{"master_address": "sim", "master_port": 1, "world_size": 4}]
    assert [s.init_infos[0]["rank_offset"] for s in stubs] == [1, 2]
    assert all(s.init_infos[0]["world_size"] == 4 for s in stubs)
    sent = sender.log.index(("trainer", "send ['w', 'b']"))
    for stub in stubs:  # both received during the one send: the calls ran concurrently
        assert sender.log.index((stub.name, "/update_weights receiving")) < sent
        assert sender.log.index((stub.name, "/update_weights received")) > sent
    await engine.update_weights(WEIGHTS, version=2)  # the same members: the group is kept
    assert len(sender.groups) == 1
    assert all(s.calls().count("/init_weight_transfer_engine") == 1 for s in stubs)
    assert all(s.label == "2" for s in stubs)


async def test_a_generate_sent_during_an_update_runs_after_it_on_the_new_version(
    setup: Setup,
) -> None:
    engine, sender, stubs = setup.engine, setup.sender, setup.stubs
    await engine.update_weights(WEIGHTS, version=1)
    sender.gate = asyncio.Event()
    update = asyncio.create_task(engine.update_weights(WEIGHTS, version=2))
    await asyncio.wait_for(sender.waiting.wait(), WAIT_S)
    generate = asyncio.create_task(engine.generate(_request("run-0-0")))
    await engine.wait_held(1, WAIT_S)
    assert not any(call == "generate" for _, call in sender.log)
    sender.gate.set()
    await asyncio.wait_for(update, WAIT_S)
    (sample,) = await asyncio.wait_for(generate, WAIT_S)
    assert sample.versions.tolist() == [2]
    (served,) = [s for s in stubs if "generate" in s.calls()]
    calls = served.calls()
    last_resume = max(i for i, call in enumerate(calls) if call == "/resume")
    assert calls.index("generate") > last_resume


async def test_a_replica_failing_update_weights_fails_the_update_naming_it_and_the_step(
    setup: Setup,
) -> None:
    """Once weights move, a failure leaves every member's weights partial: the update
    raises, every member leaves the rotation, the version stays, and nothing is held. The
    replicas that answer again are STALE (a broadcast cannot be replayed), and the next
    update rebuilds the group with them."""
    engine, sender, stubs = setup.engine, setup.sender, setup.stubs
    await engine.update_weights(WEIGHTS, version=1)
    stubs[1].fail_update = True
    with pytest.raises(ReplicaError, match=r"POST /update_weights -> HTTP 500") as caught:
        await engine.update_weights(WEIGHTS, version=2)
    assert caught.value.url == engine.replicas[1].url
    assert engine.version == 1
    assert [r.state for r in engine.replicas] == [ReplicaState.DOWN] * 2
    assert "partial weights" in str(engine.replicas[0].error)
    assert ("trainer", "leave") in sender.log
    assert engine.held_requests == 0
    engine.request_timeout_s = 0.3
    with pytest.raises(NoReplicaError, match="no replica took it"):  # a state, not death:
        await engine.generate(_request("run-1-0"))  # it waits for one, to its deadline
    engine.request_timeout_s = WAIT_S

    await engine.check_replicas()
    assert [r.state for r in engine.replicas] == [ReplicaState.STALE] * 2
    stubs[1].fail_update = False
    await engine.update_weights(WEIGHTS, version=3)
    assert [r.state for r in engine.replicas] == [ReplicaState.UP] * 2
    assert len(sender.groups) == 2 and sender.groups[1]["master_port"] == 2
    (sample,) = await asyncio.wait_for(engine.generate(_request("run-2-0")), WAIT_S)
    assert sample.versions.tolist() == [3]


async def test_a_rejoining_replica_stays_out_until_the_next_update_includes_it(
    setup: Setup,
) -> None:
    engine, sender, stubs = setup.engine, setup.sender, setup.stubs
    await engine.update_weights(WEIGHTS, version=1)
    left, stayed = engine.replicas[1], engine.replicas[0]
    stubs[1].alive = False  # it goes away: the first request sent there takes it down
    for k in range(20):
        with contextlib.suppress(ReplicaError):
            await asyncio.wait_for(engine.generate(_request(f"run-{k}-0")), WAIT_S)
    assert left.state is ReplicaState.DOWN
    stubs[1].alive, stubs[1].label = True, "default"  # back, restarted with its own weights
    await engine.check_replicas()
    assert left.state is ReplicaState.STALE  # answers, but cannot be given broadcast weights
    served = stubs[1].calls().count("generate")
    for k in range(20):  # no request reaches it
        await asyncio.wait_for(engine.generate(_request(f"again-{k}-0")), WAIT_S)
    assert stubs[1].calls().count("generate") == served

    await engine.update_weights(WEIGHTS, version=2)
    assert left.state is stayed.state is ReplicaState.UP
    assert stubs[0].calls().count("/shutdown_weight_transfer_engine") == 1
    assert [s.init_infos[-1]["rank_offset"] for s in stubs] == [1, 2]
    assert len(sender.groups) == 2 and all(s.label == "2" for s in stubs)


async def test_a_replica_restarted_between_probes_rejoins_the_group_at_the_next_update(
    setup: Setup,
) -> None:
    """A replica can restart (a new process: vLLM's initial label, in no NCCL group) and
    answer every probe before the engine notices. The next update finds it by its weight
    label and rebuilds the group with it, instead of broadcasting to a group it has left
    (which on GPUs hangs until the timeout and then takes every replica out)."""
    engine, sender, stubs = setup.engine, setup.sender, setup.stubs
    await engine.update_weights(WEIGHTS, version=1)
    stubs[1].restart()
    await engine.update_weights(WEIGHTS, version=2)
    assert [r.state for r in engine.replicas] == [ReplicaState.UP] * 2
    assert len(sender.groups) == 2 and all(s.label == "2" and s.joined for s in stubs)
    assert stubs[0].calls().count("/shutdown_weight_transfer_engine") == 1
    assert stubs[1].calls().count("/shutdown_weight_transfer_engine") == 0  # it had no end
    (sample,) = await asyncio.wait_for(engine.generate(_request("after-0")), WAIT_S)
    assert sample.versions.tolist() == [2]


async def test_a_replica_restarted_after_the_broadcast_never_serves_under_its_label(
    setup: Setup,
) -> None:
    """A replica that restarted after it received the broadcast, before its label call
    (which the new process takes), serves its own weights: under the new label it would
    have served them as the broadcast's. It waits for the next update instead."""
    engine, stubs = setup.engine, setup.stubs
    await engine.update_weights(WEIGHTS, version=1)
    stubs[1].restart_at = {"/update_weight_version"}
    await engine.update_weights(WEIGHTS, version=2)
    assert engine.replicas[0].state is ReplicaState.UP
    assert engine.replicas[1].state is not ReplicaState.UP
    await engine.update_weights(WEIGHTS, version=3)
    assert [r.state for r in engine.replicas] == [ReplicaState.UP] * 2
    assert all(s.label == "3" and s.joined for s in stubs)


async def test_a_replica_restarted_behind_the_engines_back_fails_one_request_then_waits(
    setup: Setup,
) -> None:
    """Between updates, a restarted replica is found by the first request it serves (its
    tokens carry vLLM's initial label). That request fails; the replica must then leave the
    rotation until it can be given the current weights (over NCCL: the next update), not
    keep failing every request routed to it while its health probe says it is fine."""
    engine, stubs = setup.engine, setup.stubs
    await engine.update_weights(WEIGHTS, version=1)
    stubs[1].restart()
    before = stubs[1].calls().count("generate")
    failed = []
    for k in range(200):  # until a session maps to the restarted replica
        try:
            await asyncio.wait_for(engine.generate(_request(f"run-{k}-0")), WAIT_S)
        except ReplicaError as exc:
            failed.append(str(exc))
        if stubs[1].calls().count("generate") > before:
            break
    assert stubs[1].calls().count("generate") == before + 1
    assert len(failed) == 1 and "labelled 'default'" in failed[0]
    assert engine.replicas[1].state is ReplicaState.UNSYNCED  # the next route syncs it
    for k in range(20):  # nothing more reaches it, and nothing fails
        await asyncio.wait_for(engine.generate(_request(f"again-{k}-0")), WAIT_S)
    assert stubs[1].calls().count("generate") == before + 1
    assert engine.replicas[1].state is ReplicaState.STALE  # answers; weights came over NCCL
    await engine.update_weights(WEIGHTS, version=2)
    assert [r.state for r in engine.replicas] == [ReplicaState.UP] * 2
    assert all(s.label == "2" and s.joined for s in stubs)


async def test_servers_without_weight_transfer_config_fail_the_update_saying_so(
    setup: Setup,
) -> None:
    """No weights move before the group is joined: the replicas keep serving version 0."""
    engine, stubs = setup.engine, setup.stubs
    stubs[1].configured = False
    with pytest.raises(ValueError, match="--weight-transfer-config") as caught:
        await engine.update_weights(WEIGHTS, version=1)
    assert engine.replicas[1].url in str(caught.value)
    assert engine.version == 0
    assert [r.state for r in engine.replicas] == [ReplicaState.UP] * 2
    assert all(s.calls()[-1] == "/resume" for s in stubs)
    (sample,) = await asyncio.wait_for(engine.generate(_request("run-0-0")), WAIT_S)
    assert sample.versions.tolist() == [0]


def test_trainer_side_config_and_ports_without_a_gpu() -> None:
    with pytest.raises(ValueError, match="master_port"):
        NCCLWeightTransfer("127.0.0.1", 0)
    sender = NCCLWeightTransfer("10.0.0.1", 29500, packed=False)
    first, second = sender.new_group(3), sender.new_group(5)
    assert first == {
        "master_address": "10.0.0.1",
        "master_port": 29500,
        "world_size": 3,
        "packed": False,
        "packed_buffer_size_bytes": 1 << 30,
        "packed_num_buffers": 2,
    }
    assert (second["master_port"], second["world_size"]) == (29501, 5)
    sender.leave()  # not in a group: nothing to do


def test_the_modules_import_without_torch() -> None:
    code = (
        "import sys, asyncroll.engines.server.nccl_transfer, asyncroll.engines.server.engine;"
        "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)  # a loaded machine


async def test_a_replica_failing_to_join_the_group_leaves_the_rotation_not_every_update(
    setup: Setup,
) -> None:
    """A replica whose `/init_weight_transfer_engine` fails (its NCCL cannot reach the
    trainer, say) failed the update, and stayed up: every later update formed the group
    with it again and failed again, so no weights could ever reach the other replicas. It
    must leave the rotation, so that the next update goes ahead without it."""
    engine, stubs = setup.engine, setup.stubs
    stubs[1].fail_init = True
    with pytest.raises(ReplicaError, match="init_weight_transfer_engine") as caught:
        await engine.update_weights(WEIGHTS, version=1)
    assert caught.value.url == engine.replicas[1].url
    assert engine.replicas[1].state is ReplicaState.DOWN
    assert engine.replicas[0].state is ReplicaState.UP
    setup.sender.members = 1
    await engine.update_weights(WEIGHTS, version=2)
    assert engine.version == 2 and stubs[0].label == "2"
    (sample,) = await asyncio.wait_for(engine.generate(_request("run-0-0")), WAIT_S)
    assert sample.versions.tolist() == [2]


async def test_a_weight_transfer_step_is_never_sent_twice(setup: Setup) -> None:
    """Every control call was tried once more after a connection error, the NCCL steps too:
    a replica that ran `/start_weight_update` and lost the connection before answering got it
    again (a second join or receive waits for a broadcast that never comes)."""
    engine, stubs = setup.engine, setup.stubs
    await engine.update_weights(WEIGHTS, version=1)
    stubs[1].drop = {"/start_weight_update"}
    with pytest.raises(ReplicaError, match="/start_weight_update") as caught:
        await engine.update_weights(WEIGHTS, version=2)
    assert caught.value.url == engine.replicas[1].url
    assert stubs[1].calls().count("/start_weight_update") == 2  # one per update, not three


async def test_a_failed_round_finishes_the_open_update_so_the_next_one_can_start(
    setup: Setup,
) -> None:
    """A round that fails after `/start_weight_update` ran on a replica (here the other
    replica's answer to it is lost) left that replica's update open: vLLM's worker then
    refuses every later start and the group's shutdown, so the replica could take no NCCL
    update again until it restarted. The failed round finishes it."""
    engine, stubs = setup.engine, setup.stubs
    await engine.update_weights(WEIGHTS, version=1)
    stubs[1].drop = {"/start_weight_update"}
    with pytest.raises(ReplicaError, match="/start_weight_update"):
        await engine.update_weights(WEIGHTS, version=2)
    assert not stubs[0].updating and not stubs[1].updating
    await engine.check_replicas()
    await engine.update_weights(WEIGHTS, version=3)
    assert [r.state for r in engine.replicas] == [ReplicaState.UP] * 2
    (sample,) = await asyncio.wait_for(engine.generate(_request("run-3-0")), WAIT_S)
    assert sample.versions.tolist() == [3]
