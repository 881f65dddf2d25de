"""The `Engine` contract (`asyncroll/engines/base.py`), checked the same way on every engine.

Each test runs once per engine: `SimEngine` (a simulation, slowed down per token so a long
request is certainly still running when an abort or a cancellation lands), `VLLMEngine`
(the tiny local model on the session's shared engine; marked `vllm`, skipped without vllm) and
`VLLMServerEngine` (the same model behind the session's one `vllm serve`, started only when a
"server" case runs; marked `vllm`).
A new engine joins by adding a `Subject` to `make_subject`.

Progress is observed, never slept for: engines under test expose `generated_tokens`,
`samples_started` (per request), `wait_progress` and `running_requests`. Every wait has a
deadline, so a broken engine fails its test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import pytest
import pytest_asyncio

from asyncroll.engines import (
    Engine,
    EngineDeadError,
    GenerateRequest,
    SampleOutput,
    SampleRequest,
    SamplingConfig,
    SimEngine,
)
from asyncroll.types import Int32Array
from tests.conftest import VLLM_MAX_MODEL_LEN

DEADLINE_S = 60.0  # for any single wait; every operation here takes well under a second
RUN_TO_END_S = 600.0  # for a request of `long_budget` tokens run to its end (16k over HTTP)
SIM_TOKEN_S = 0.02  # SimEngine's per-token latency: a long request runs for hours
# The server's `Subject.shorter_budgets` (the keep-pause test prints how many tokens its
# request made before the pause landed: the first budget is meant to be several times that)
SERVER_SHORTER_BUDGETS = (1024, 4096)
PROMPT = np.array([0, 5, 6, 7], dtype=np.int32)


class ObservableEngine(Engine, Protocol):
    """What the suite needs beyond the protocol, to wait on progress instead of time."""

    @property
    def generated_tokens(self) -> int: ...

    @property
    def running_requests(self) -> int: ...

    def samples_started(self, request_id: str) -> int: ...

    async def wait_generated(self, tokens: int, timeout: float) -> None: ...

    async def wait_progress(self, predicate: Callable[[], bool], timeout: float) -> None: ...


@dataclass
class Subject:
    engine: ObservableEngine
    long_budget: int  # tokens per sample that take far longer than an abort to land
    shorter_budgets: tuple[int, ...] = ()
    """Budgets tried before `long_budget` where a request must still run when a pause lands
    and then run to its end (`keep_pause_round`): an attempt in which a request ran to its
    end before the pause landed proves nothing and is run again with the next budget. The
    first is some times the tokens a request makes before a pause lands, so that it is the
    one that runs; the last, `long_budget`, is what every attempt used before."""
    observe_each_token: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext
    """Within it, `generated_tokens` counts every token as it is sampled (engines that report
    progress in chunks switch to one token per chunk), where `delivered_at_pause`; elsewhere
    progress comes often enough for `samples_started` to see each sample's first tokens."""

    delivered_at_pause: bool = True
    """Whether every token sampled before `pause_generation` has reached the caller when it
    returns. vLLM's server offers no such point (its own pause sleeps 20 ms "for intuitive
    ordering, not correctness"), so over HTTP tokens in transit still arrive after it, each
    labelled with the version it was sampled under."""

    started: list[asyncio.Task[Sequence[SampleOutput]]] = field(default_factory=list)
    """Every request started through `start`/`start_together`; the fixture cancels any still
    running after a failed test, so that one failure does not cascade into the next tests."""

    async def start(self, request: GenerateRequest) -> asyncio.Task[Sequence[SampleOutput]]:
        """Start `request` and return once each of its samples has its first token."""
        (task,) = await self.start_together(request)
        return task

    async def start_together(
        self, *requests: GenerateRequest
    ) -> list[asyncio.Task[Sequence[SampleOutput]]]:
        """Start `requests` together and return once every sample of each has its first token,
        told apart per request (a rise of the engine's token count would not say whose token
        it was: with one request running, the next could still be waiting for its first)."""
        tasks = [asyncio.create_task(self.engine.generate(request)) for request in requests]
        self.started.extend(tasks)
        waiting = asyncio.ensure_future(
            asyncio.gather(*(self._samples_started(request) for request in requests))
        )
        await asyncio.wait([*tasks, waiting], return_when=asyncio.FIRST_COMPLETED)
        if not waiting.done():  # a request ended first: let its error (or result) show
            waiting.cancel()
            ended = next(task for task in tasks if task.done())
            raise AssertionError(f"a request ended before it got going: {await ended}")
        await waiting
        return tasks

    async def _samples_started(self, request: GenerateRequest) -> None:
        rid, k = request.request_id, len(request.samples)
        await self.engine.wait_progress(lambda: self.engine.samples_started(rid) >= k, DEADLINE_S)

    async def cancel_started(self) -> None:
        """Cancel the requests a test started and left running, and wait for them to end."""
        running = [task for task in self.started if not task.done()]
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running, timeout=DEADLINE_S)


RUN = uuid.uuid4().hex[:8]


def make_request(
    request_id: str,
    budgets: Sequence[int],
    *,
    prefixes: Sequence[Int32Array] | None = None,
    prompt: Int32Array = PROMPT,
) -> GenerateRequest:
    """One sample per budget (eos ignored, so each runs to its budget unless aborted). Ids
    get this run's prefix: the vLLM engine is shared with other tests, and an id names one
    request for an engine's lifetime."""
    prefixes = prefixes if prefixes is not None else [np.zeros(0, np.int32)] * len(budgets)
    return GenerateRequest(
        request_id=f"{RUN}-{request_id}",
        prompt_tokens=prompt,
        samples=tuple(SampleRequest(p, b) for p, b in zip(prefixes, budgets, strict=True)),
        sampling=SamplingConfig(max_new_tokens=max(budgets), ignore_eos=True),
    )


async def within_deadline(request: GenerateRequest, engine: Engine) -> Sequence[SampleOutput]:
    async with asyncio.timeout(DEADLINE_S):
        return await engine.generate(request)


async def finished(
    task: asyncio.Task[Sequence[SampleOutput]], deadline_s: float = DEADLINE_S
) -> Sequence[SampleOutput]:
    async with asyncio.timeout(deadline_s):
        return await task


def check_outputs(outputs: Sequence[SampleOutput], request: GenerateRequest) -> None:
    """The shape every `generate` result has, whatever happened to the request."""
    assert len(outputs) == len(request.samples)
    for out, sample in zip(outputs, request.samples, strict=True):
        assert out.tokens.dtype == np.int32 and out.tokens.ndim == 1
        assert out.logprobs.dtype == np.float32 and out.logprobs.ndim == 1
        assert out.versions.dtype == np.int32 and out.versions.ndim == 1
        assert len(out.tokens) == len(out.logprobs) == len(out.versions)
        assert len(out.tokens) <= sample.max_new_tokens
        assert out.finish_reason in {"stop", "length", "abort"}


def make_subject(kind: str, vllm_engine: object = None) -> Subject:
    if kind == "sim":
        return Subject(SimEngine(vocab_size=512, per_token_latency_s=SIM_TOKEN_S), 1 << 20)
    from asyncroll.engines import VLLMEngine, VLLMServerEngine

    assert isinstance(vllm_engine, VLLMEngine | VLLMServerEngine)
    engine = vllm_engine

    def streaming_every(tokens: int) -> Callable[[], AbstractContextManager[None]]:
        @contextlib.contextmanager
        def streaming() -> Iterator[None]:
            saved, engine.stream_interval = engine.stream_interval, tokens
            try:
                yield
            finally:
                engine.stream_interval = saved

        return streaming

    each_token = streaming_every(1)
    if isinstance(engine, VLLMServerEngine):  # HTTP round trips: a longer request
        from tests.vllm.server import SERVER_MAX_MODEL_LEN

        budget = SERVER_MAX_MODEL_LEN - len(PROMPT) - 8
        # Its count is not checked one by one (see delivered_at_pause), and an event per token
        # of two 16k-token requests costs 2 cores more than generating them: chunks of 16.
        return Subject(
            engine,
            budget,
            observe_each_token=streaming_every(16),
            delivered_at_pause=False,
            shorter_budgets=SERVER_SHORTER_BUDGETS,
        )
    return Subject(engine, VLLM_MAX_MODEL_LEN - len(PROMPT) - 8, observe_each_token=each_token)


def skip_without_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # missing, or broken (a CUDA torchvision next to the CPU torch)
        pytest.skip(f"vllm is not importable: {type(exc).__name__}: {exc}")


ENGINES = [
    "sim",
    pytest.param("vllm", marks=pytest.mark.vllm),
    pytest.param("server", marks=pytest.mark.vllm),
]


@pytest.fixture(params=ENGINES)
def engine_kind(request: pytest.FixtureRequest) -> str:
    if request.param != "sim":
        skip_without_vllm()
    return str(request.param)


@pytest.fixture
def new_subject(request: pytest.FixtureRequest, engine_kind: str) -> Subject:
    """Synchronous, so that it may set up the session's vLLM engine only when it is needed."""
    if engine_kind == "sim":
        return make_subject("sim")
    if engine_kind == "server":
        return make_subject("server", request.getfixturevalue("server_engine"))
    return make_subject("vllm", request.getfixturevalue("vllm_engine"))


@pytest_asyncio.fixture
async def subject(new_subject: Subject, engine_kind: str) -> AsyncIterator[Subject]:
    """An engine at version 0, not paused; left that way for the next test."""
    yield new_subject
    engine = new_subject.engine
    left_running = engine.running_requests
    await new_subject.cancel_started()  # after a failed test, so that the next starts clean
    if engine_kind == "sim":
        await engine.close()
    else:
        await engine.update_weights(None, version=0)
    assert left_running == 0, "a test left requests running"


@pytest_asyncio.fixture
async def own_subject(request: pytest.FixtureRequest, engine_kind: str) -> AsyncIterator[Subject]:
    """An engine the test may close: SimEngine's own; a client of its own on the shared
    server; for vLLM in process, the session's LoRA engine, which the closing test ends after
    every test that uses it (`closes_the_lora_engine`: tests/vllm/conftest.py's
    `closing_order`), rather than an engine started for it alone."""
    if engine_kind == "sim":
        yield make_subject("sim")
        return
    if engine_kind == "server":  # a client of its own on the shared server
        from tests.vllm.server import server_engine_on

        server = request.getfixturevalue("vllm_server")
        weights = request.getfixturevalue("server_weights_dir")
        client = server_engine_on(server.url, weights)
        try:
            yield make_subject("server", client)
        finally:
            await asyncio.wait_for(client.close(), DEADLINE_S)
        return
    yield make_subject("vllm", request.getfixturevalue("vllm_lora_engine"))


# -- outputs -------------------------------------------------------------------------------------


async def test_one_output_per_sample_in_order_with_only_new_tokens(subject: Subject) -> None:
    """Distinct budgets show the order; the continued sample (a 6-token prefix) gets only its
    3 new tokens back, not prefix + new."""
    prefix = np.array([8, 9, 10, 11, 12, 13], dtype=np.int32)
    empty = np.zeros(0, np.int32)
    request = make_request("shape", [2, 3, 5], prefixes=[empty, prefix, empty])
    outputs = await within_deadline(request, subject.engine)
    check_outputs(outputs, request)
    assert [(len(o.tokens), o.finish_reason) for o in outputs] == [
        (2, "length"),
        (3, "length"),
        (5, "length"),
    ]
    for out in outputs:
        assert out.tokens.min() >= 0 and out.tokens.max() < subject.engine.vocab_size
        assert (out.logprobs <= 0).all() and (out.versions == 0).all()


# -- aborts --------------------------------------------------------------------------------------


async def test_abort_before_generate_starts(subject: Subject) -> None:
    """The abort comes first; the `generate` that follows returns at once, empty, "abort"."""
    engine = subject.engine
    await engine.abort(f"{RUN}-early")
    request = make_request("early", [subject.long_budget] * 2)
    outputs = await within_deadline(request, engine)
    check_outputs(outputs, request)
    assert [(o.finish_reason, len(o.tokens)) for o in outputs] == [("abort", 0)] * 2
    assert engine.running_requests == 0


async def test_abort_while_running_returns_the_partial_samples(subject: Subject) -> None:
    engine = subject.engine
    request = make_request("running", [subject.long_budget] * 2)
    task = await subject.start(request)
    await engine.abort(f"{RUN}-running")
    outputs = await finished(task)
    check_outputs(outputs, request)
    for out in outputs:
        assert out.finish_reason == "abort"
        assert 0 < len(out.tokens) < subject.long_budget
    assert engine.running_requests == 0
    (after,) = await within_deadline(make_request("after-running", [4]), engine)
    assert (after.finish_reason, len(after.tokens)) == ("length", 4)


async def test_abort_after_finish_affects_nothing(subject: Subject) -> None:
    """A late abort is a no-op: a request running beside it and later ones are untouched, and
    the late abort is not kept for a `generate` that reuses the ended id."""
    engine = subject.engine
    (done,) = await within_deadline(make_request("ended", [3]), engine)
    assert done.finish_reason == "length"
    beside = make_request("beside", [6])
    beside_task = asyncio.create_task(engine.generate(beside))
    await engine.abort(f"{RUN}-ended")
    (beside_out,) = await finished(beside_task)
    assert (beside_out.finish_reason, len(beside_out.tokens)) == ("length", 6)
    (again,) = await within_deadline(make_request("ended", [5]), engine)
    assert (again.finish_reason, len(again.tokens)) == ("length", 5)


# -- request ids ---------------------------------------------------------------------------------


async def test_a_running_id_is_refused_and_the_running_request_is_unaffected(
    subject: Subject,
) -> None:
    engine = subject.engine
    request = make_request("twice", [subject.long_budget])
    task = await subject.start(request)
    with pytest.raises(ValueError, match="twice"):
        await within_deadline(make_request("twice", [4]), engine)
    assert not task.done()
    await engine.abort(f"{RUN}-twice")
    (out,) = await finished(task)
    assert out.finish_reason == "abort" and len(out.tokens) > 0


async def test_a_fresh_id_after_many_aborted_ones_is_unaffected(subject: Subject) -> None:
    """More early aborts than any engine remembers: they neither grow memory without bound
    (the engine forgets the oldest) nor reach a request with a new id."""
    engine = subject.engine
    for i in range(10_000):
        await engine.abort(f"never-started-{i}")
    (out,) = await within_deadline(make_request("fresh", [4]), engine)
    assert (out.finish_reason, len(out.tokens)) == ("length", 4)
    assert engine.running_requests == 0


# -- pause, versions -----------------------------------------------------------------------------


def ran_out(out: SampleOutput, budget: int) -> bool:
    """Whether `out` ran to its end before any pause or update reached it."""
    return (out.finish_reason, len(out.tokens)) == ("length", budget) and bool(
        (out.versions == 0).all()
    )


async def keep_pause_round(
    subject: Subject, tag: str, keep_budget: int, cut_budget: int, *, last: bool
) -> Sequence[SampleOutput] | None:
    """`test_keep_pause_freezes_requests_and_updates_in_between_restamp`'s scenario with
    requests of these budgets; what the kept request returned, or None (never when `last`)
    when a request ran to its end before the pause landed, which proves nothing."""
    engine = subject.engine
    keep_req = make_request(tag, [keep_budget])
    with subject.observe_each_token():
        cut_req = make_request(f"{tag}-cut", [cut_budget])
        keep, cut = await subject.start_together(keep_req, cut_req)

        def keep_ran_out() -> bool:  # its last tokens may still arrive after the pause
            return not last and keep.done() and ran_out(keep.result()[0], keep_budget)

        await engine.pause_generation()
        try:
            await engine.update_weights(None, version=1)
            frozen_at = engine.generated_tokens
            await engine.pause_generation()  # one more round trip: still nothing new
            if subject.delivered_at_pause:
                assert engine.generated_tokens == frozen_at
            if keep_ran_out():
                await engine.abort(f"{RUN}-{tag}-cut")
                await finished(cut)
                return None
            assert not keep.done(), keep.result()
            await engine.abort(f"{RUN}-{tag}-cut")
            (partial,) = await finished(cut)
            if not last and ran_out(partial, cut_budget):
                await engine.abort(f"{RUN}-{tag}")
                await finished(keep)
                return None
            assert partial.finish_reason == "abort"
            assert 0 < len(partial.tokens) < cut_budget
            assert (partial.versions == 0).all()
            if keep_ran_out():
                return None
            assert not keep.done()
            await engine.update_weights(None, version=2)
        finally:
            await engine.resume_generation()
        outputs = await finished(keep, RUN_TO_END_S)
    check_outputs(outputs, keep_req)
    return outputs


async def test_keep_pause_freezes_requests_and_updates_in_between_restamp(
    subject: Subject,
) -> None:
    """Paused in place with updates to versions 1 then 2 in between: frozen requests make no
    progress, one aborted while frozen returns its partial, and the other completes after
    resume with its first tokens at version 0 and its last at version 2. No token is labelled
    1: one would have been sampled while paused. Where the engine delivers every token
    sampled before the pause by the time it returns, the count also stays put across a
    control round trip. Run again with longer requests (`Subject.shorter_budgets`) where one
    ran to its end before the pause landed."""
    engine = subject.engine
    if not engine.supports_keep_pause:
        pytest.skip("engine cannot pause in place")
    if isinstance(engine, SimEngine):
        budgets = [(40, subject.long_budget)]
    else:
        budgets = [(b, b) for b in (*subject.shorter_budgets, subject.long_budget)]
    for attempt, (budget, cut_budget) in enumerate(budgets):
        last = attempt == len(budgets) - 1
        outputs = await keep_pause_round(subject, f"frozen{attempt}", budget, cut_budget, last=last)
        if outputs is not None and (last or not ran_out(outputs[0], budget)):
            break
        await engine.update_weights(None, version=0)  # ran out first: again, longer
    assert outputs is not None
    (out,) = outputs
    print(f"{budget}-token request: {int((out.versions == 0).sum())} tokens before the pause")
    assert (out.finish_reason, len(out.tokens)) == ("length", budget)
    assert out.versions[0] == 0 and out.versions[-1] == 2
    assert (np.diff(out.versions) >= 0).all() and 1 not in out.versions


async def test_update_weights_stamps_later_tokens(subject: Subject) -> None:
    engine = subject.engine
    await engine.update_weights(None, version=3)
    (out,) = await within_deadline(make_request("stamped", [5]), engine)
    assert len(out.tokens) == 5 and (out.versions == 3).all()


# -- bad input, deadlines ------------------------------------------------------------------------


async def test_out_of_vocab_ids_raise_at_once_and_the_engine_serves_on(subject: Subject) -> None:
    """Checked before generating: with a long budget a late check would blow the deadline."""
    engine = subject.engine
    vocab = engine.vocab_size
    long = subject.long_budget
    bad_prompt = make_request("oov-prompt", [long], prompt=np.array([0, vocab], np.int32))
    bad_prefix = make_request("oov-prefix", [long], prefixes=[np.array([5, -1], np.int32)])
    for request in (bad_prompt, bad_prefix):
        with pytest.raises(ValueError, match="vocab"):
            await within_deadline(request, engine)
    assert engine.running_requests == 0
    (out,) = await within_deadline(make_request("after-oov", [4]), engine)
    assert (out.finish_reason, len(out.tokens)) == ("length", 4)


async def test_a_cancelled_generate_leaves_nothing_running(subject: Subject) -> None:
    """A caller's deadline cancels `generate`: it raises at once and its request is gone from
    the engine, so a pause right after does not wait on it."""
    engine = subject.engine
    task = await subject.start(make_request("cancelled", [subject.long_budget] * 2))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await finished(task)
    assert engine.running_requests == 0
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):  # lands before a long request could end
            await engine.generate(make_request("timed-out", [subject.long_budget]))
    assert engine.running_requests == 0
    async with asyncio.timeout(DEADLINE_S):
        await engine.pause_generation()
        await engine.resume_generation()


# -- closing -------------------------------------------------------------------------------------


@pytest.mark.closes_the_lora_engine
async def test_a_closed_engine_is_dead(own_subject: Subject) -> None:
    """A request running at close raises `EngineDeadError`, and so does every later call but
    `abort` and `close`, which stay harmless for cleanup paths."""
    engine = own_subject.engine
    task = await own_subject.start(make_request("at-close", [own_subject.long_budget]))
    async with asyncio.timeout(DEADLINE_S):
        await engine.close()
    with pytest.raises(EngineDeadError):
        await finished(task)
    with pytest.raises(EngineDeadError):
        await within_deadline(make_request("after-close", [4]), engine)
    for control in (
        engine.pause_generation(),
        engine.resume_generation(),
        engine.update_weights(None, version=5),
    ):
        with pytest.raises(EngineDeadError):
            async with asyncio.timeout(DEADLINE_S):
                await control
    async with asyncio.timeout(DEADLINE_S):
        await engine.abort(f"{RUN}-at-close")
        await engine.abort(f"{RUN}-never-seen")
        await engine.close()
    assert engine.running_requests == 0


@pytest.mark.parametrize("then", ["resume", "abort"])
async def test_a_zero_latency_sim_request_started_while_paused_waits(then: str) -> None:
    """`SimEngine` without latency (the producer's tests run it so) finished a request the
    moment it started, paused or not: a keep-mode pause froze nothing new, and the tokens
    carried the version of before an update made during the pause."""
    engine = SimEngine(vocab_size=512)
    await engine.pause_generation()
    call = asyncio.ensure_future(engine.generate(make_request("sim-paused", [3])))
    await engine.wait_progress(lambda: engine.calls == 1, 5.0)
    await engine.update_weights(None, version=1)
    assert not call.done() and engine.running_requests == 1
    if then == "resume":
        await engine.resume_generation()
        (out,) = await finished(call)
        assert (out.finish_reason, out.versions.tolist()) == ("length", [1, 1, 1])
    else:
        await engine.abort(f"{RUN}-sim-paused")
        (out,) = await finished(call)
        assert (out.finish_reason, len(out.tokens)) == ("abort", 0)
    await engine.close()
