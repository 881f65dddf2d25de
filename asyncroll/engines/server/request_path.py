"""The request path of `VLLMServerEngine`: a group from `generate` to its samples, routed to
one replica, held while admission is, streamed, aborted.

Why a module of its own. Requests are the hot path and the one place that talks to the
replicas over stream connections; they read what the control calls decide (admission,
`control.Dispatch`) and what each replica's supervisor knows (is it up, synced, its liveness
in question), and change neither: a request that finds its replica failing reports it
(`ReplicaControl.failed`) and its supervisor decides. It is the one writer of what is in flight
(`live`, the counters the engine's progress reads).

Every wait a request makes is its caller's (`RequestPath._wait`): bounded by
`request_timeout_s` (or a deadline of the caller's), ended by its abort or the engine's
close, never a wait on a supervisor's task. A request not yet sent when its replica leaves
the rotation is routed again; with no replica up it waits for one until its deadline
(`NoReplicaError`, naming each replica: no dead engine).

Errors are classified by where they came from (`replicas.stream_failure`). A stream whose
connection is lost (`StreamLost`: disconnected, reset, truncated) is one request's failure: it
is sent again from scratch once its replica's liveness generate kept the replica in the
rotation, as if never sent (`RequestPath._lost`); anything wrong in what a replica sent is
that replica's failure, which fails the group. A request a paused replica refused
(`PausedRefusal`: someone else paused its vLLM in mode "abort" or "wait") ran nothing and is
nobody's failure: it is sent again after a backoff until its deadline (`RequestPath._refused`,
`asyncroll.engines.vllm.refusals`), and its group then fails with `EnginePausedError`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import aiohttp

from asyncroll._core.tasks import Tasks
from asyncroll._core.wakeup import Signal
from asyncroll.engines.base import (
    EngineDeadError,
    GenerateRequest,
    RecentIds,
    SampleOutput,
    SamplingConfig,
)
from asyncroll.engines.server import lora as server_lora
from asyncroll.engines.server import replicas as rp
from asyncroll.engines.server import samples as ss
from asyncroll.engines.server import supervisor as sup
from asyncroll.engines.server.client import ReplicaClient
from asyncroll.engines.server.control import Dispatch, ReplicaControl
from asyncroll.engines.server.replicas import (
    NoReplicaError,
    Replica,
    ReplicaError,
    ReplicaState,
    UnsyncedReplicaError,
)
from asyncroll.engines.vllm import groups as vllm_groups
from asyncroll.engines.vllm import refusals

_HOMES = frozenset({ReplicaState.UP, ReplicaState.UNSYNCED})  # where a session may live
_SERVER_PREFIX = "generate-tokens-"  # vLLM's id for a request to /inference/v1/generate

MAX_RESENDS = 2
"""How often one request whose stream was lost is sent again before its group fails: a
replica that passes its liveness check but cuts every stream (a broken proxy) is not tried
for ever within `request_timeout_s`."""


class RequestPath:
    """The requests of one engine (see the module docstring). `session_of`,
    `stream_interval` and `request_timeout_s` are the engine's arguments of those names (the
    engine's attributes of those names read and set them here); `pause_timeout_s` bounds an
    abort."""

    def __init__(
        self,
        replicas: list[Replica],
        state: sup.ControlState,
        client: ReplicaClient,
        supervisors: Mapping[Replica, sup.Supervisor],
        control: ReplicaControl,
        lora: server_lora.ServerAdapters,
        progress: Signal,
        tasks: Tasks,
        *,
        vocab_size: int,
        session_of: Callable[[str], str],
        stream_interval: int | None,
        request_timeout_s: float,
        pause_timeout_s: float,
    ) -> None:
        self._replicas = replicas
        self._state = state
        self._client = client
        self._supervisors = supervisors
        self._control = control
        self._lora = lora
        self._progress = progress
        self._tasks = tasks  # aborts that outlive the caller who started them
        self._vocab_size = vocab_size
        self.session_of = session_of
        self.stream_interval = stream_interval
        self.request_timeout_s = request_timeout_s
        self._pause_timeout_s = pause_timeout_s
        self.live: dict[str, ss.Live] = {}
        self._recent = RecentIds()
        self.generated = 0  # tokens received since the engine started
        self.open_streams = 0  # HTTP generate requests sent, not ended
        self.held = 0  # requests waiting for admission
        self.pause_refusals = 0  # requests a paused replica refused (each sent again)
        self._closing: set[asyncio.Task[Any]] = set()  # streams `abort` closes (`_stream`)

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        """`VLLMServerEngine.generate`: route the group, wait (within `request_timeout_s`,
        ended by `abort`) until its replica may be sent to, then stream its requests there."""
        self._check_open()
        rid = request.request_id
        if rid in self.live:
            raise ValueError(f"request id {rid!r} is already running")
        parts = self._split(request)
        samples = [ss.Sample() for _ in request.samples]
        if self._recent.take_early_abort(rid):
            self._recent.ended(rid)
            return [ss.aborted_output() for _ in samples]
        # an episode names its session; a single-turn group's attempts share their id's stem
        session = request.session or self.session_of(rid)
        live = self.live[rid] = ss.Live(parts, None, samples)  # from now on `abort` finds it
        self._progress.notify()
        try:
            async with asyncio.timeout(self.request_timeout_s):
                while not await self._sent(live, session, request.sampling):
                    pass  # its replica left the rotation before anything was sent: again
        except TimeoutError:
            self._check_open()
            replica = live.replica
            refused = [p for p in parts if p.refusals and not p.started]
            if live.refused is not None and refused:  # a pause, not its replica, held it
                times = sum(p.refusals for p in refused)
                deadline = f"request_timeout_s={self.request_timeout_s}"
                where = f"replica {live.refused.url}"
                reason = refusals.paused_too_long(rid, where, live.refused.message, times, deadline)
                raise refusals.EnginePausedError(reason) from None
            if replica is None or not any(p.started for p in parts):
                raise NoReplicaError(
                    f"{rid}: no replica took it within request_timeout_s="
                    f"{self.request_timeout_s}: {self._control.states()}"
                ) from None
            error = ReplicaError(
                replica.url,
                f"{rid} not finished within request_timeout_s={self.request_timeout_s}"
                " (its requests were aborted)",
            )
            self._control.failed(replica, error)  # one that hangs leaves the rotation
            raise error from None
        finally:
            del self.live[rid]
            self._recent.ended(rid)
            base_of = dict(self._lora.base_of)  # as its tokens were labelled, before release
            for part in parts:
                if part.started:  # bound to the policy it was sent with (`_stream`)
                    self._lora.release(part.adapter)
            self._progress.notify()
        url = "" if live.replica is None else live.replica.url
        try:
            return [
                ss.output(s, rid, url, asked.max_new_tokens, base_of)
                for s, asked in zip(samples, request.samples, strict=True)
            ]
        except ReplicaError as exc:  # what the replica answered is wrong: as a failed stream
            if live.replica is not None:
                self._control.failed(live.replica, exc)
            raise

    def _split(self, request: GenerateRequest) -> list[ss.Part]:
        """Fresh samples of one budget travel together as `n` (not when greedy: vLLM refuses
        n > 1 then), continued samples one request each (see `vllm_groups.split_group`)."""
        together = request.sampling.temperature > 0
        return vllm_groups.split_group(request, self._vocab_size, together=together, part=ss.Part)

    async def _sent(self, live: ss.Live, session: str, sampling: SamplingConfig) -> bool:
        """Route `live`, wait until its replica may take it, and stream it there. False: its
        replica left the rotation before any of its requests was sent (route it again)."""
        replica = live.replica = await self._ready(live, session)
        if replica is None:  # aborted before anything was sent
            for sample in live.samples:
                sample.finish = "abort"
            return True
        try:
            await self._run_parts(live, live.samples, sampling)
        except _NotSent:
            if any(p.started for p in live.parts):
                raise ReplicaError(
                    replica.url, f"left the rotation while its requests were sent: {replica.error}"
                ) from None
            return False
        return True

    async def _ready(self, live: ss.Live, session: str) -> Replica | None:
        """The replica `session` goes to, once it may be sent to: admission open, no sync of
        the session's own replica and no liveness check of the chosen one under way. Every
        wait is the caller's (its deadline, its abort); nothing here waits on a supervisor's
        task. None: the request was aborted."""
        while True:
            self._check_open()
            if live.aborted:
                return None
            self._control.revive_due()
            home = rp.pick(self._replicas, session, _HOMES)
            owner = None if home is None else self._supervisors[home]
            if owner is not None and owner.replica.state is ReplicaState.UNSYNCED and owner.task:
                # its own replica is being synced (new, or restarted): wait for that, not
                # settling elsewhere only because its replica was not synced yet
                await self._wait(live, owner.idle)
                continue
            replica = rp.pick(self._replicas, session)
            if replica is None:  # none up now: a state, not death; wait for one
                await self._wait(
                    live,
                    lambda: any(r.state is ReplicaState.UP for r in self._replicas),
                    timeout=self._next_probe_s(),
                )
                continue
            if self._control.admission is not Dispatch.OPEN:
                await self._admit(live)
                continue
            checked = self._supervisors[replica]
            if checked.check is not None:  # its liveness is in question
                await self._wait(live, checked.unchecked)
                continue
            return replica

    async def _wait(
        self, live: ss.Live, predicate: Callable[[], bool], timeout: float | None = None
    ) -> None:
        """The one way a request waits: until `predicate()`, its abort, the engine's close
        or `timeout` s (then it returns, for the caller to look again), within whatever
        deadline its caller set (`request_timeout_s`)."""
        with contextlib.suppress(TimeoutError):
            await self._progress.wait_until(
                lambda: predicate() or live.aborted or self._state.closed, timeout
            )

    def _next_probe_s(self) -> float | None:
        """Seconds until the next down replica is due for a probe (None: none is)."""
        now = asyncio.get_running_loop().time()
        due = [r.retry_at - now for r in self._replicas if r.state is ReplicaState.DOWN]
        later = [d for d in due if d > 0]  # those due now are being probed: their end wakes
        return min(later) + 1e-3 if later else None

    async def _admit(self, live: ss.Live) -> None:
        """Wait while admission is held (a pause or weight update); an abort or close ends
        the wait."""
        if self._control.admission is Dispatch.OPEN:
            return
        self.held += 1
        self._progress.notify()
        try:
            await self._wait(live, lambda: self._control.admission is Dispatch.OPEN)
        finally:
            self.held -= 1

    async def _run_parts(
        self, live: ss.Live, samples: list[ss.Sample], sampling: SamplingConfig
    ) -> None:
        """Stream every part; on the first error (or a cancellation) end the others, abort
        what was sent, and raise."""
        replica = live.replica
        assert replica is not None  # routed (`_ready`)
        tasks = live.tasks = [
            asyncio.ensure_future(self._stream(live, part, samples, sampling))
            for part in live.parts
        ]
        gave_up = False
        try:
            error = await vllm_groups.first_error(tasks)
        except asyncio.CancelledError:
            gave_up = True
            self._caller_gave_up(live)
            raise
        finally:
            unfinished = [
                p.server_id
                for p, task in zip(live.parts, tasks, strict=True)
                if p.started and ss.unfinished(task)
            ]
            if unfinished and not self._state.closed:  # do not rely on the disconnect alone
                # in a task of the engine's: a caller that gave up, or aborted (its abort
                # ends it within one control call: its own), is not held for it
                abort = self._tasks.spawn(self._abort_left(replica, unfinished), name="abort")
                if not (gave_up or live.aborted):
                    await asyncio.shield(abort)
        if self._state.closed:
            raise EngineDeadError("VLLMServerEngine is closed")
        if error is not None:
            if isinstance(error, ReplicaError):
                self._control.failed(replica, error)
            raise error

    def _caller_gave_up(self, live: ss.Live) -> None:
        """`generate` was cancelled (the producer's `generate_timeout_s`, or this engine's
        `request_timeout_s`) while requests it sent were unfinished: the replica is checked
        as after a failed request. A wedged engine core whose `/health` and
        `/abort_requests` answer fails nothing else: every group sent there ran into its
        caller's deadline, and the replica stayed in the rotation (the chaos run's 140 late
        groups)."""
        if self._state.closed or live.replica is None:
            return
        unfinished = [
            p.server_id
            for p, t in zip(live.parts, live.tasks, strict=True)
            if p.started and ss.unfinished(t)
        ]
        if unfinished:
            error = ReplicaError(
                live.replica.url,
                f"{len(unfinished)} requests unfinished when their caller gave up on them",
            )
            self._control.failed(live.replica, error)  # not awaited: the caller is gone

    async def _stream(
        self, live: ss.Live, part: ss.Part, samples: list[ss.Sample], sampling: SamplingConfig
    ) -> None:
        """Stream one part to its group's replica (`_send`). One whose stream is lost
        (`StreamLost`) is sent again, from scratch, once the replica's liveness check kept
        it in the rotation (`_lost`; its group is routed again when the replica left and
        nothing else of the group was sent), at most `MAX_RESENDS` times: then the replica
        fails it. One a paused replica refused is sent again after a backoff (`_refused`)."""
        while True:
            try:
                await self._send(live, part, samples, sampling)
                return
            except rp.PausedRefusal as exc:
                await self._refused(live, part, samples, exc)
            except rp.StreamLost as exc:
                self._lost(live, part, samples, exc)
                if part.resends > MAX_RESENDS:
                    raise ReplicaError(
                        exc.url,
                        f"generate stream lost {part.resends} times in a row (sent again"
                        f" while its liveness generate answered); the last: {exc.cause}",
                    ) from None

    def _lost(
        self, live: ss.Live, part: ss.Part, samples: list[ss.Sample], exc: rp.StreamLost
    ) -> None:
        """`part`'s stream was lost: the part is as if never sent. Its samples are emptied
        (vLLM sends a sample's version spans with its end, so the tokens streamed so far
        carry none), its adapter released (it binds the policy of its next send), the
        request aborted on the replica (vLLM notices a closed connection only when it next
        writes to it; not awaited: the abort's own failure is the replica's), and the
        replica checked (`ReplicaControl.failed`), which `_send` waits for."""
        replica = live.replica
        assert replica is not None  # it was sent there
        self._unsend(part, samples)
        self._tasks.spawn(self._abort_left(replica, [part.server_id]), "abort")
        part.resends += 1
        self._control.failed(replica, exc)
        self._progress.notify()

    def _unsend(self, part: ss.Part, samples: list[ss.Sample]) -> None:
        """`part` as if never sent: its samples emptied and its adapter released (an adapter
        binds the policy of the part's next send)."""
        for i in part.indices:
            samples[i].clear()
        if part.adapter is not None:
            self._lora.release(part.adapter)
            part.adapter = None
        part.started = False

    async def _refused(
        self, live: ss.Live, part: ss.Part, samples: list[ss.Sample], exc: rp.PausedRefusal
    ) -> None:
        """`part` was refused by its paused replica: vLLM turned it away on arrival, so it is
        as if never sent (its adapter released: it binds the policy of its next send; the same
        id may be sent again, as vLLM finished the refused one) and nobody's failure (no
        check of the replica). It waits `refusals.retry_delay_s` (ended by its abort or the
        engine's close), for `_stream` to send it again, within the group's deadline."""
        self._unsend(part, samples)
        part.refusals += 1
        self.pause_refusals += 1
        live.refused = exc
        self._progress.notify()
        await self._wait(live, lambda: False, timeout=refusals.retry_delay_s(part.refusals))

    async def _send(
        self, live: ss.Live, part: ss.Part, samples: list[ss.Sample], sampling: SamplingConfig
    ) -> None:
        """One send of `part`, once admission is open and its replica's liveness is not in
        question; its samples filled from the stream. Any error from talking to the replica
        is classified by its origin (`replicas.stream_failure`)."""
        replica = live.replica
        assert replica is not None  # routed (`_ready`)
        supervisor = self._supervisors[replica]
        while self._control.admission is not Dispatch.OPEN or supervisor.check is not None:
            await self._admit(live)  # a pause may have begun since it was routed
            await self._wait(live, supervisor.unchecked)  # its liveness checked
            if live.aborted or self._state.closed:
                break
        if self._state.closed:
            raise EngineDeadError("VLLMServerEngine is closed")
        if live.aborted:
            for i in part.indices:
                samples[i].finish = "abort"
            return
        if not _up(replica):  # it left the rotation while this waited: routed again
            raise _NotSent(replica.url)
        body: dict[str, Any] = {
            "request_id": part.server_id,
            "token_ids": part.prompt,
            "stream": True,
            "sampling_params": ss.sampling_params(sampling, part, self.stream_interval),
        }
        adapter = part.adapter = self._lora.bind()
        if adapter is not None:  # every token of the request is sampled with it
            body["model"] = adapter.name
            for i in part.indices:
                samples[i].label = self._state.version
        part.started = True
        self.open_streams += 1
        replica.streams += 1
        replica.sent += 1
        self._progress.notify()
        try:
            async with self._answered(live, f"{replica.url}/inference/v1/generate", body) as reply:
                if reply is None:  # aborted before the replica answered: nothing to wait for
                    for i in part.indices:
                        samples[i].finish = "abort"
                    return
                if reply.status != 200:
                    head = await rp.read_at_most(reply, rp.ERROR_BODY_BYTES)
                    text = head.decode(errors="replace")
                    if (message := rp.refused_reply(reply.status, text)) is not None:
                        raise rp.PausedRefusal(replica.url, message)
                    error = ReplicaError(replica.url, f"generate -> HTTP {reply.status}: {text}")
                    if reply.status == 404 and adapter is not None and adapter.name in text:
                        raise UnsyncedReplicaError(
                            replica.url,
                            f"does not know the adapter {adapter.name} (did it restart?): {text}",
                        )
                    if 400 <= reply.status < 500:
                        raise rp.Rejected(str(error))
                    raise error
                first = True
                tokens = part.max_tokens * len(part.indices)
                async for event in rp.events(reply, replica.url, tokens):
                    for choice in event.choices:
                        if not 0 <= choice.index < len(part.indices):  # not -1: Python's last
                            raise ReplicaError(
                                replica.url,
                                f"streamed choice {choice.index} of a request of"
                                f" {len(part.indices)} samples",
                            )
                        sample = samples[part.indices[choice.index]]
                        got = ss.append(sample, choice, replica.url, self._vocab_size)
                        self.generated += got
                    part.refusals = 0  # taken: a later refusal starts the backoff anew
                    self._progress.notify()
                    if first and _aborted(live):  # the abort may have beaten the request there
                        # not awaited: the stream ends on the replica's answer to either abort
                        self._tasks.spawn(self._abort_left(replica, [part.server_id]), "abort")
                    first = False
        except asyncio.CancelledError:
            if asyncio.current_task() not in self._closing or _cancelling():
                raise  # the caller's (it gave up: `_caller_gave_up` checks the replica)
            # `abort` closed it (its abort did not reach the replica): ended, not failed
            for i in part.indices:
                if samples[i].finish is None:
                    samples[i].finish = "abort"
        except (rp.Rejected, rp.PausedRefusal, EngineDeadError):
            raise
        except Exception as exc:  # the connection's (`StreamLost`), or else the replica's
            self._check_open()  # `close()` closed the session under this stream
            raise rp.stream_failure(replica, exc) from None
        finally:
            self._closing.discard(asyncio.current_task())
            self.open_streams -= 1
            replica.streams -= 1
            self._progress.notify()

    @contextlib.asynccontextmanager
    async def _answered(
        self, live: ss.Live, url: str, body: dict[str, Any]
    ) -> AsyncIterator[aiohttp.ClientResponse | None]:
        """POST a generate and yield the reply once the replica answers, or None when the
        request is aborted first: the POST may wait for one of `max_connections` stream
        connections (streams of a wedged replica hold them), and that wait too ends on the
        caller's abort (the control-plane simulation found aborted requests held there until
        a connection freed). Cancelled before it was answered, the request never reached the
        replica, or its connection closes, which makes vLLM abort it."""
        self._check_open()  # never a new session once `close()` closed the last one
        post = self._client.session().post(url, json=body)
        request = asyncio.ensure_future(post.__aenter__())
        request.add_done_callback(lambda _: self._progress.notify())
        try:
            await self._wait(live, request.done)
        finally:
            if not request.done():
                request.cancel()
                await asyncio.gather(request, return_exceptions=True)
        if request.cancelled():
            yield None
            return
        reply = request.result()  # the POST's own error, if any
        try:
            yield reply
        finally:
            await post.__aexit__(None, None, None)

    # -- aborts ----------------------------------------------------------------------------------

    async def abort(self, request_id: str) -> None:
        """`VLLMServerEngine.abort`: abort every request of the group on its replica."""
        if self._state.closed:
            return
        live = vllm_groups.claim_abort(self.live, self._recent, request_id)
        if live is None:
            return
        self._progress.notify()  # wakes parts held for admission
        started = [p.server_id for p in live.parts if p.started]
        if started and live.replica is not None and not await self.abort_on(live.replica, started):
            # it did not reach the replica (down, restarting): the streams are closed here,
            # which ends them now (`_stream`) and makes a vLLM that answers again abort them;
            # else a request frozen on a replica that came back paused outlived its abort
            # until the resume (the control-plane simulation found it)
            for part, task in zip(live.parts, live.tasks, strict=True):
                if part.started and not task.done():  # the others end on `live.aborted`
                    self._closing.add(task)
                    task.cancel()

    async def abort_on(self, replica: Replica, server_ids: list[str]) -> bool:
        """Abort requests on `replica`, through the RL route that returns once vLLM has
        aborted them (`/inference/v1/abort_requests` only starts a task that will). A failure
        fails no request (the stream's own end or deadline still bounds it), but is a failed
        call to the replica like any other: one whose engine core is not alive either leaves
        the rotation. Often this abort is the last call a hung replica gets (its caller gave
        up on the request), and nothing else would take it out. Within `pause_timeout_s`, and
        not waiting for that check: a caller that gave up (the producer's
        `generate_timeout_s`) is not held past it by a hung replica. Whether it got there."""
        ids = [_SERVER_PREFIX + s for s in server_ids]
        try:
            await self._client.call(
                replica,
                "POST",
                "/abort_requests",
                {"request_ids": ids},
                timeout_s=self._pause_timeout_s,
            )
        except ReplicaError as exc:
            self._control.failed(replica, exc)  # the supervisor owns the check
            return False
        return True

    async def _abort_left(self, replica: Replica, server_ids: list[str]) -> None:
        """`abort_on` in a task of the engine's, whose outcome nobody reads: for requests a
        group left unfinished (their stream's end is their fallback), and for one whose
        abort may have beaten it to its replica (its stream goes on to the replica's end)."""
        await self.abort_on(replica, server_ids)

    async def end_adapter_requests(self) -> None:
        """Before new full weights (the replicas paused): abort the requests sent with an
        adapter. It was trained on the old base weights; over the new ones they would sample
        with a policy no version names. They return their samples so far, finish "abort"
        (to be continued), labelled with their adapter's version, as `VLLMEngine` does."""
        running = [
            rid for rid, live in self.live.items() if any(p.adapter is not None for p in live.parts)
        ]
        await asyncio.gather(*(self.abort(rid) for rid in running))

    async def end_all(self, timeout_s: float) -> None:
        """The engine closes: abort every sent request on its replica (a closed connection
        alone reaches vLLM only when it next writes to the stream, which may be at the
        request's end), then end the streams, within `timeout_s`."""
        started = [
            (live.replica, [p.server_id for p in live.parts if p.started])
            for live in self.live.values()
            if live.replica is not None
        ]
        await asyncio.gather(*(self.abort_on(r, ids) for r, ids in started if ids))
        await vllm_groups.end_streams(self.live.values(), timeout_s)

    def _check_open(self) -> None:
        if self._state.closed:
            raise EngineDeadError("VLLMServerEngine is closed")


class _NotSent(Exception):
    """A request's replica left the rotation before its request was sent."""


def _up(replica: Replica) -> bool:
    """Whether `replica` is up, read through a call: its state changes across awaits, which
    mypy's narrowing does not know."""
    return replica.state is ReplicaState.UP


def _cancelling() -> bool:
    """Whether the current task is being cancelled by someone else too (its caller): after
    `abort`'s own cancel is taken, one left means the caller's, which must go on."""
    task = asyncio.current_task()
    return task is not None and task.uncancel() > 0


def _aborted(live: ss.Live) -> bool:
    """`live.aborted`, read through a call: it changes across awaits, which mypy's narrowing
    does not know."""
    return live.aborted
