"""The OpenAI-compatible agent endpoint, driven by the official `openai` client, on the real
Qwen3 tokenizer and template with a scripted engine and with `SimEngine` (simulations: they
return the ids a test gives them, or random ids): every call is a turn of its episode, tool
calls reach the agent as `tool_calls` objects, streaming and non-streaming give the same
episode, bad input gets an OpenAI-shaped error and the run goes on, pauses and weight updates
stay invisible with exact versions and logprobs."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from asyncroll import Episode, Producer, SamplingConfig, SimEngine
from asyncroll.agents import Agent, AgentEndpoint, agent_reward
from asyncroll.chat.parse import RenderersParser, ReplyParser
from asyncroll.chat.template import ChatFormat
from asyncroll.episode import RolloutFn
from asyncroll.outcomes import FailureReason
from asyncroll.types import RolloutGroup
from tests.chat.templates import qwen3_tokenizer
from tests.test_chat_episodes import END_IN_ARGUMENTS, ScriptEngine, end_in_call_ids

openai = pytest.importorskip("openai")
aiohttp = pytest.importorskip("aiohttp")

DEADLINE_S = 60.0
TOOLS = [{"type": "function", "function": {"name": "add", "description": "add",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]  # fmt: skip
FIRST = [{"role": "user", "content": "add 1"}]
SAMPLING = SamplingConfig(max_new_tokens=64)
MODEL = "asyncroll-policy"


@pytest.fixture(scope="module")
def fmt() -> ChatFormat:
    return ChatFormat(qwen3_tokenizer(), tools=TOOLS)


Parser = Callable[[Sequence[dict[str, Any]] | None], ReplyParser]


@pytest.fixture(scope="module")
def parser(fmt: ChatFormat) -> Parser:
    """The Qwen3 reply parser for a call's tools."""
    renderers = pytest.importorskip("renderers")
    tok = fmt.tokenizer

    def make(tools: Sequence[dict[str, Any]] | None) -> RenderersParser:
        return RenderersParser(tok, renderers.Qwen3RendererConfig(), tools=tools)

    return make


def client(base_url: str) -> Any:
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30.0)


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><|im_end|>'
ANSWER = "The sum is 2.<|im_end|>"


async def tool_agent(base_url: str, episode: Episode, *, stream: bool = False) -> float:
    """Plain OpenAI-client agent: call the model, run the tool it asks for, call again."""
    c = client(base_url)
    messages: list[dict[str, Any]] = [dict(m) for m in FIRST]
    for _ in range(3):
        message, finish = await ask(c, messages, stream=stream)
        messages.append(message)
        if not message.get("tool_calls"):
            return 1.0 if "2" in (message["content"] or "") and finish == "stop" else 0.0
        for call in message["tool_calls"]:
            args = json.loads(call["function"]["arguments"])
            messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": str(args["a"] + 1)}
            )
    return 0.0


async def ask(
    c: Any, messages: list[dict[str, Any]], *, stream: bool
) -> tuple[dict[str, Any], str]:
    """One call, as the assistant message to send back and its finish reason."""
    if not stream:
        r = await c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        choice = r.choices[0]
        return choice.message.model_dump(exclude_none=True, exclude={"reasoning_content"}), str(
            choice.finish_reason
        )
    content, calls, finish = "", [], ""
    events = await c.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, stream=True
    )
    async for chunk in events:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += [
            {
                "id": tc.id,
                "type": "function",
                "function": {"name": tc.function.name, "arguments": tc.function.arguments},
            }
            for tc in delta.tool_calls or ()
        ]
        finish = chunk.choices[0].finish_reason or finish
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message, finish


async def produce(
    engine: Any, prompt: list[int], rollout_fn: RolloutFn, *, prompts: int = 1,
    keep: list[Producer] | None = None, **limits: Any,
) -> tuple[list[Any], list[RolloutGroup]]:  # fmt: skip
    """Run `prompts` groups of `rollout_fn` on `prompt` until each is produced or dropped; the
    drop records and the groups. `limits` override the producer's settings (one group of one
    sample per batch, 4 turns, 4096 tokens, `SAMPLING`); `keep` gets the producer (for an
    agent that updates weights)."""
    drops: list[Any] = []
    settings: dict[str, Any] = {
        "group_size": 1, "batch_size": 1, "max_turns": 4, "max_episode_tokens": 4096,
        "sampling": SAMPLING, **limits,
    }  # fmt: skip
    producer = Producer(
        engine, [prompt] * prompts, agent_reward, rollout_fn=rollout_fn, on_drop=drops.append,
        **settings,
    )  # fmt: skip
    if keep is not None:
        keep.append(producer)
    groups: list[RolloutGroup] = []
    async with producer:
        while len(groups) + len(drops) < prompts:
            done = asyncio.ensure_future(producer.produce_batch(1, timeout=DEADLINE_S))
            ended = len(drops)
            failed = asyncio.ensure_future(
                producer._changed.wait_until(lambda n=ended: len(drops) > n)
            )
            await asyncio.wait([done, failed], timeout=DEADLINE_S, return_when="FIRST_COMPLETED")
            if done.done() and done.exception() is None:
                groups += done.result().groups
            for task in (done, failed):
                task.cancel()
            if not (done.done() or failed.done()):
                raise TimeoutError("no group ended")
    producer.check_ledger()
    return drops, groups


async def run_episode(
    engine: Any, fmt: ChatFormat, parser: Parser, first: list[dict[str, Any]], agent: Agent,
    *, endpoint: AgentEndpoint | None = None, **limits: Any,
) -> tuple[list[Any], list[RolloutGroup]]:  # fmt: skip
    """`produce` with `agent` behind a fresh `AgentEndpoint(fmt, parser)` served around the
    run (or `endpoint`, which the test serves itself, or not), the prompt `first` as `fmt`
    renders it; the episodes' URLs are all closed at the end."""
    prompt = fmt.prompt_ids(first)
    if endpoint is not None:
        out = await produce(engine, prompt, endpoint.rollout(agent), **limits)
    else:
        async with AgentEndpoint(fmt, parser, sampling=SAMPLING) as endpoint:
            out = await produce(engine, prompt, endpoint.rollout(agent), **limits)
    assert endpoint.sessions == 0
    return out


def ids(fmt: ChatFormat, text: str) -> list[int]:
    return fmt.encode(text)


# -- the happy path: tools, streaming, exact tokens ---------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_calling_openai_agent_records_exactly_the_tokens_the_engine_saw(
    fmt: ChatFormat, parser: Parser, stream: bool
) -> None:
    engine = ScriptEngine([(ids(fmt, CALL), "stop"), (ids(fmt, ANSWER), "stop")])
    seen: list[Any] = []

    async def agent(base_url: str, episode: Episode) -> float:
        assert base_url.startswith("http://127.0.0.1:")
        seen.append(episode)
        return await tool_agent(base_url, episode, stream=stream)

    drops, (group,) = await run_episode(engine, fmt, parser, FIRST, agent)
    assert not drops
    (sample,) = group.samples
    assert sample.extra["reward"] == 1.0  # the tool call reached the agent; the answer parsed
    first, second = engine.requests
    prompt = fmt.prompt_ids(FIRST)
    assert first.prompt_tokens.tolist() == prompt and second.prompt_tokens.tolist() == prompt
    call = ids(fmt, CALL)
    bridge = fmt.bridge({"role": "assistant", "content": ""}, [{"role": "tool", "content": "2"}])
    assert first.samples[0].prefix.tolist() == []
    assert second.samples[0].prefix.tolist() == call + bridge  # the stream, never re-rendered
    assert sample.tokens.tolist() == call + bridge + ids(fmt, ANSWER)
    mask = sample.loss_mask
    assert mask is not None
    assert mask.tolist() == [1] * len(call) + [0] * len(bridge) + [1] * len(ids(fmt, ANSWER))
    im_end = fmt.stop_token_ids[0]
    assert im_end in first.sampling.stop_token_ids


@pytest.mark.parametrize("spelling", END_IN_ARGUMENTS)
async def test_end_of_turn_text_in_a_tool_call_s_arguments_adds_only_the_template_s_ids(
    fmt: ChatFormat, parser: Parser, spelling: str
) -> None:
    """The reply's tool call holds `<|im_end|>` as ordinary tokens (or as its JSON escape):
    the agent gets the call with that text, and the next call appends what the real Qwen3
    template writes after the reply's `<|im_end|>` token, its own ids and nothing else."""
    call = end_in_call_ids(fmt, spelling)
    im_end = call[-1]
    engine = ScriptEngine([(call, "stop"), (ids(fmt, ANSWER), "stop")])
    sent: list[dict[str, Any]] = []

    async def agent(base_url: str, episode: Episode) -> float:
        c = client(base_url)
        r = await c.chat.completions.create(model=MODEL, messages=FIRST, tools=TOOLS)
        message = r.choices[0].message.model_dump(exclude_none=True)
        (tc,) = message["tool_calls"]
        assert json.loads(tc["function"]["arguments"])["s"].count("<|im_end|>") == 1
        tool = {"role": "tool", "tool_call_id": tc["id"], "content": "2"}
        sent.extend([*FIRST, message, tool])
        await c.chat.completions.create(model=MODEL, messages=sent, tools=TOOLS)
        return 1.0

    drops, (group,) = await run_episode(engine, fmt, parser, FIRST, agent)
    assert not drops
    full = fmt.tokenizer.apply_chat_template(
        sent, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    (sample,) = group.samples
    bridge = sample.tokens.tolist()[len(call) : -len(ids(fmt, ANSWER))]
    assert sample.tokens.tolist() == call + bridge + ids(fmt, ANSWER)
    assert bridge == list(full[-len(bridge) :]) and full[-len(bridge) - 1] == im_end
    plain = fmt.bridge({"role": "assistant", "content": ""}, [{"role": "tool", "content": "2"}])
    assert bridge == plain  # what it writes after any tool call
    assert engine.requests[1].samples[0].prefix.tolist() == call + bridge


async def test_streaming_and_not_give_the_same_episode(fmt: ChatFormat, parser: Parser) -> None:
    samples = []
    for stream in (False, True):
        engine = ScriptEngine([(ids(fmt, CALL), "stop"), (ids(fmt, ANSWER), "stop")])

        async def agent(base_url: str, episode: Episode, s: bool = stream) -> float:
            return await tool_agent(base_url, episode, stream=s)

        _, (group,) = await run_episode(engine, fmt, parser, FIRST, agent)
        samples.append(group.samples[0])
    a, b = samples
    assert a.tokens.tolist() == b.tokens.tolist()
    assert a.loss_mask is not None and b.loss_mask is not None
    assert a.loss_mask.tolist() == b.loss_mask.tolist()
    assert a.extra == b.extra


# -- bad input: an OpenAI-shaped error, the run goes on -----------------------------------------


async def raw(url: str, body: Any, *, method: str = "POST") -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with s.request(method, url, data=data) as r:
            return r.status, await r.json()


async def test_bad_calls_get_openai_errors_and_the_episode_goes_on(
    fmt: ChatFormat, parser: Parser
) -> None:
    engine = ScriptEngine([(ids(fmt, CALL), "stop"), (ids(fmt, ANSWER), "stop")])
    errors: dict[str, tuple[int, Any]] = {}

    async def agent(base_url: str, episode: Episode) -> float:
        url = base_url + "/chat/completions"
        good = {"model": MODEL, "messages": FIRST, "tools": TOOLS}
        errors["json"] = await raw(url, b"{not json")
        errors["model"] = await raw(url, {**good, "model": "gpt-4o"})
        errors["temperature"] = await raw(url, {**good, "temperature": 0.5})
        errors["n"] = await raw(url, {**good, "n": 2})
        errors["stop"] = await raw(url, {**good, "stop": ["the end"]})
        errors["unknown"] = await raw(url, {**good, "frobnicate": 1})
        errors["prompt"] = await raw(url, {**good, "messages": [{"role": "user", "content": "x"}]})
        errors["tools"] = await raw(url, {**good, "tools": None})
        status, models = await raw(base_url + "/models", None, method="GET")
        assert status == 200 and [m["id"] for m in models["data"]] == [MODEL]
        c = client(base_url)
        r = await c.chat.completions.create(
            model=MODEL, messages=FIRST, tools=TOOLS, temperature=1.0
        )
        message = r.choices[0].message.model_dump(exclude_none=True)
        (tc,) = message["tool_calls"]
        tool = {"role": "tool", "tool_call_id": tc["id"], "content": "2"}
        # the same call again: the client lost the answer; it gets the same one, no new turn
        again = await c.chat.completions.create(model=MODEL, messages=FIRST, tools=TOOLS)
        assert again.choices[0].message.tool_calls[0].id == tc["id"]
        assert again.id == r.id
        changed = {
            **message,
            "tool_calls": [{**tc, "function": {"name": "add", "arguments": '{"a": 5}'}}],
        }
        errors["rewrite"] = await raw(url, {**good, "messages": [*FIRST, changed, tool]})
        fake = {"role": "assistant", "content": "I did it"}
        errors["assistant"] = await raw(url, {**good, "messages": [*FIRST, message, tool, fake]})
        errors["nothing new"] = await raw(url, {**good, "messages": [*FIRST, message]})
        r2 = await c.chat.completions.create(
            model=MODEL, messages=[*FIRST, message, tool], tools=TOOLS
        )
        return 1.0 if "2" in (r2.choices[0].message.content or "") else 0.0

    drops, (group,) = await run_episode(engine, fmt, parser, FIRST, agent)
    assert not drops and group.samples[0].extra["reward"] == 1.0
    assert len(engine.requests) == 2  # nothing refused reached the engine; the retry did not
    expect = {
        "json": (400, "not valid JSON"),
        "model": (404, "'gpt-4o' does not exist here"),
        "temperature": (400, "the producer samples with temperature=1.0"),
        "n": (400, "n=1"),
        "stop": (400, "a stop string must be one token"),
        "unknown": (400, "unrecognized request argument(s): frobnicate"),
        "prompt": (400, "differ from the episode's prompt"),
        "tools": (400, "differ from the episode's prompt"),
        "rewrite": (400, "messages[1] differs from the episode's history"),
        "assistant": (400, "messages[3] is an assistant message the policy did not sample"),
        "nothing new": (400, "the messages end with the episode's last reply"),
    }
    for name, (status, text) in expect.items():
        got_status, body = errors[name]
        assert got_status == status, (name, body)
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert text in body["error"]["message"], (name, body)


MALFORMED_TOOL_CALLS = {
    "a string": "add(1)",
    "a number": 5,
    "an entry that is a string": ["add"],
    "function a string": [{"id": "c", "type": "function", "function": "add"}],
    "no name": [{"id": "c", "type": "function", "function": {"arguments": "{}"}}],
    "arguments a number": [{"id": "c", "type": "function", "function": {"name": "add",
                            "arguments": 1}}],
}  # fmt: skip


async def test_malformed_tool_calls_in_a_request_are_400_and_the_episode_goes_on(
    fmt: ChatFormat, parser: Parser
) -> None:
    """In the first call's messages (a few-shot assistant message) and in a later call's
    history: each is refused with OpenAI's error shape naming the field; the episode's next
    good call is its next turn, and the group lands."""
    engine = ScriptEngine([(ids(fmt, CALL), "stop"), (ids(fmt, ANSWER), "stop")])
    errors: dict[str, tuple[int, Any]] = {}

    async def agent(base_url: str, episode: Episode) -> float:
        url = base_url + "/chat/completions"
        good = {"model": MODEL, "tools": TOOLS}
        for name, bad in MALFORMED_TOOL_CALLS.items():
            shot = {"role": "assistant", "content": "", "tool_calls": bad}
            errors[f"first, {name}"] = await raw(url, {**good, "messages": [*FIRST, shot, *FIRST]})
        c = client(base_url)
        r = await c.chat.completions.create(model=MODEL, messages=FIRST, tools=TOOLS)
        message = r.choices[0].message.model_dump(exclude_none=True)
        tool = {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "2"}
        for name, bad in MALFORMED_TOOL_CALLS.items():
            broken = {**message, "tool_calls": bad}
            errors[f"later, {name}"] = await raw(url, {**good, "messages": [*FIRST, broken, tool]})
        r2 = await c.chat.completions.create(
            model=MODEL, messages=[*FIRST, message, tool], tools=TOOLS
        )
        return 1.0 if "2" in (r2.choices[0].message.content or "") else 0.0

    drops, (group,) = await run_episode(engine, fmt, parser, FIRST, agent)
    assert not drops and group.samples[0].extra["reward"] == 1.0
    assert len(engine.requests) == 2
    assert len(errors) == 2 * len(MALFORMED_TOOL_CALLS)
    for name, (status, body) in errors.items():
        assert status == 400, (name, body)
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["type"] == "invalid_request_error", (name, body)
        assert body["error"]["param"].startswith("messages[1].tool_calls"), (name, body)


async def test_a_finished_or_unknown_episode_is_404_and_concurrent_calls_are_409(
    fmt: ChatFormat, parser: Parser
) -> None:
    gate = asyncio.Event()

    entered = asyncio.Event()

    class Held(ScriptEngine):
        async def generate(self, request: Any) -> Any:
            entered.set()
            await gate.wait()
            return await super().generate(request)

    engine = Held([(ids(fmt, ANSWER), "stop")])
    urls: list[str] = []
    busy: list[tuple[int, Any]] = []

    async def agent(base_url: str, episode: Episode) -> float:
        urls.append(base_url)
        c = client(base_url)
        first = asyncio.ensure_future(
            c.chat.completions.create(model=MODEL, messages=FIRST, tools=TOOLS)
        )
        await asyncio.wait_for(entered.wait(), DEADLINE_S)
        busy.append(
            await raw(
                base_url + "/chat/completions", {"model": MODEL, "messages": FIRST, "tools": TOOLS}
            )
        )
        gate.set()
        await first
        return 1.0

    async with AgentEndpoint(fmt, parser, sampling=SAMPLING) as endpoint:
        drops, (_,) = await run_episode(engine, fmt, parser, FIRST, agent, endpoint=endpoint)
        assert not drops
        ((status, body),) = busy
        assert status == 409 and body["error"]["code"] == "call_in_progress"
        (url,) = urls  # the episode ended, the endpoint still serves
        status, body = await raw(url + "/chat/completions", {"model": MODEL, "messages": FIRST})
        assert status == 404 and body["error"]["code"] == "episode_not_found"
        guess = url.rsplit("/", 2)[0] + "/not-a-token/v1/models"
        assert (await raw(guess, None, method="GET"))[0] == 404


async def raw_any(
    url: str, body: bytes | None = None, *, method: str = "POST"
) -> tuple[int, str, Any]:
    """(status, content type, body as JSON or text), whatever the server answered."""
    async with aiohttp.ClientSession() as s, s.request(method, url, data=body) as r:
        text = await r.text()
        try:
            return r.status, r.content_type, json.loads(text)
        except ValueError:
            return r.status, r.content_type, text


async def test_errors_aiohttp_would_answer_itself_have_openai_s_shape(
    fmt: ChatFormat, parser: Parser
) -> None:
    """An unknown path (the episode token left out of the base URL), a wrong method, a body
    over `max_body_bytes`: each an OpenAI-shaped JSON error, the unknown URL as
    `episode_not_found`; the episode then goes on."""
    engine = ScriptEngine([(ids(fmt, ANSWER), "stop")])
    got: dict[str, tuple[int, str, Any]] = {}

    async def agent(base_url: str, episode: Episode) -> float:
        root = base_url.rsplit("/", 2)[0]
        good = json.dumps({"model": MODEL, "messages": FIRST, "tools": TOOLS}).encode()
        got["no token"] = await raw_any(root + "/v1/chat/completions", good)
        got["no token, models"] = await raw_any(root + "/v1/models", method="GET")
        got["method"] = await raw_any(base_url + "/chat/completions", method="GET")
        got["unknown path"] = await raw_any(base_url + "/embeddings", good)
        got["too large"] = await raw_any(base_url + "/chat/completions", good + b" " * 4096)
        c = client(base_url)
        r = await c.chat.completions.create(model=MODEL, messages=FIRST, tools=TOOLS)
        return 1.0 if r.choices[0].finish_reason == "stop" else 0.0

    endpoint = AgentEndpoint(fmt, parser, sampling=SAMPLING, max_body_bytes=2048)
    async with endpoint:
        drops, (group,) = await run_episode(engine, fmt, parser, FIRST, agent, endpoint=endpoint)
    assert not drops and group.samples[0].extra["reward"] == 1.0
    expect = {
        "no token": (404, "episode_not_found", "no such episode"),
        "no token, models": (404, "episode_not_found", "no such episode"),
        "method": (405, "method_not_allowed", "GET is not allowed"),
        "unknown path": (404, None, "Invalid URL (POST /"),
        "too large": (413, "request_too_large", "max_body_bytes=2048"),
    }
    for name, (status, code, text) in expect.items():
        got_status, kind, body = got[name]
        assert (got_status, kind) == (status, "application/json"), (name, body)
        assert set(body["error"]) == {"message", "type", "param", "code"}, (name, body)
        assert body["error"]["code"] == code and text in body["error"]["message"], (name, body)


BOOLEANS = {"temperature": True, "n": True, "top_logprobs": False, "top_p": True,
            "presence_penalty": False}  # fmt: skip


async def test_json_booleans_are_not_numbers(fmt: ChatFormat, parser: Parser) -> None:
    """`true` equals 1 and `false` 0 in Python: OpenAI refuses them where a number is
    expected (400), and so does the endpoint, before anything is sampled."""
    engine = ScriptEngine([(ids(fmt, ANSWER), "stop")])
    got: dict[str, tuple[int, Any]] = {}

    async def agent(base_url: str, episode: Episode) -> float:
        url = base_url + "/chat/completions"
        good = {"model": MODEL, "messages": FIRST, "tools": TOOLS}
        for field, value in BOOLEANS.items():
            got[field] = await raw(url, {**good, field: value})
        c = client(base_url)
        await c.chat.completions.create(model=MODEL, messages=FIRST, tools=TOOLS)
        return 1.0

    drops, (_,) = await run_episode(engine, fmt, parser, FIRST, agent)
    assert not drops and len(engine.requests) == 1
    for field, value in BOOLEANS.items():
        status, body = got[field]
        assert status == 400, (field, body)
        assert body["error"]["param"] == field
        assert f"{field}={value!r}: give a number, not a boolean" in body["error"]["message"]


async def test_a_call_waiting_when_the_producer_stops_says_the_run_stopped(
    fmt: ChatFormat, parser: Parser
) -> None:
    """A call in the engine when the producer stops: its answer says the run stopped (not a
    500 with an empty reason, the text of a cancellation), and a later call is 404."""
    entered = asyncio.Event()

    class Hung(ScriptEngine):
        async def generate(self, request: Any) -> Any:
            entered.set()
            await asyncio.Event().wait()  # never answers: the producer's stop cancels it
            raise AssertionError("unreachable")

    urls: list[str] = []
    started = asyncio.Event()

    async def agent(base_url: str, episode: Episode) -> float:
        urls.append(base_url)
        started.set()
        await asyncio.Event().wait()  # the call is made from outside, by the test
        return 0.0

    async with AgentEndpoint(fmt, parser, sampling=SAMPLING) as endpoint:
        producer = Producer(
            Hung([]), [fmt.prompt_ids(FIRST)], agent_reward, rollout_fn=endpoint.rollout(agent),
            group_size=1, batch_size=1, max_turns=4, sampling=SAMPLING,
        )  # fmt: skip
        async with producer:
            batch = asyncio.ensure_future(producer.produce_batch(1, timeout=DEADLINE_S))
            await asyncio.wait_for(started.wait(), DEADLINE_S)
            body = json.dumps({"model": MODEL, "messages": FIRST, "tools": TOOLS}).encode()
            call = asyncio.ensure_future(raw_any(urls[0] + "/chat/completions", body))
            await asyncio.wait_for(entered.wait(), DEADLINE_S)
        batch.cancel()
        status, _, answer = await asyncio.wait_for(call, DEADLINE_S)
        assert status == 503, answer
        assert answer["error"]["code"] == "run_stopped"
        assert "the run stopped before this call was answered" in answer["error"]["message"]
        later = await raw_any(urls[0] + "/chat/completions", body)
        assert later[0] == 404 and later[2]["error"]["code"] == "episode_not_found"


class Signalling(SimEngine):
    """SimEngine that says when a request of an episode (its session) reaches it."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.started: dict[str, asyncio.Event] = defaultdict(asyncio.Event)

    async def generate(self, request: Any) -> Any:
        self.started[request.session].set()
        return await super().generate(request)


async def test_a_call_past_the_token_budget_is_refused_with_a_clear_message(
    fmt: ChatFormat, parser: Parser
) -> None:
    engine = ScriptEngine([(ids(fmt, CALL), "stop")])
    errors: list[Any] = []

    async def agent(base_url: str, episode: Episode) -> float:
        c = client(base_url)
        r = await c.chat.completions.create(model=MODEL, messages=FIRST, tools=TOOLS)
        message = r.choices[0].message.model_dump(exclude_none=True)
        tool = {
            "role": "tool",
            "tool_call_id": message["tool_calls"][0]["id"],
            "content": "2" * 400,
        }
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(
                model=MODEL, messages=[*FIRST, message, tool], tools=TOOLS
            )
        errors.append(info.value)
        return 0.5

    drops, (group,) = await run_episode(engine, fmt, parser, FIRST, agent, max_episode_tokens=64)
    assert not drops and group.samples[0].extra["reward"] == 0.5
    (err,) = errors
    assert err.code == "context_length_exceeded" and "token budget is spent" in err.message


class Recording(ChatFormat):
    """A chat format that records what it tokenizes: (characters, the thread it ran on)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.encoded: list[tuple[int, int]] = []

    def encode(self, text: str) -> list[int]:
        self.encoded.append((len(text), threading.get_ident()))
        return super().encode(text)

    def prompt_ids(self, messages: Any) -> list[int]:
        text = self.render_text(messages, generation_prompt=True)
        self.encoded.append((len(text), threading.get_ident()))
        return super().prompt_ids(messages)


HUGE = "word " * 20_000  # 100,000 characters, 20,000 tokens: far past a 512-token budget


@pytest.mark.parametrize("call", ["first", "later"])
async def test_a_huge_call_is_refused_without_tokenizing_it_on_the_event_loop(
    fmt: ChatFormat, parser: Parser, call: str
) -> None:
    """A call's messages far past what the episode can hold (a later call's tool result
    past the token budget; a first call's messages longer than the prompt) are refused after
    tokenizing a prefix of a few times the limit, not all of them, and that work runs in a
    worker thread: the event loop (every other agent, the producer, the trainer) goes on.
    The episode goes on too."""
    rec = Recording(fmt.tokenizer, tools=TOOLS)
    engine = ScriptEngine([(ids(rec, CALL), "stop"), (ids(rec, ANSWER), "stop")])
    errors: list[Any] = []
    work: list[tuple[int, int]] = []  # what the huge call tokenized
    loop_thread = threading.get_ident()

    async def agent(base_url: str, episode: Episode) -> float:
        rec.encoded.clear()  # the test's own, above
        c = client(base_url)
        if call == "first":
            with pytest.raises(openai.BadRequestError) as info:
                await c.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": HUGE}], tools=TOOLS
                )
            errors.append(info.value)
            work.extend(rec.encoded)
        r = await c.chat.completions.create(model=MODEL, messages=FIRST, tools=TOOLS)
        message = r.choices[0].message.model_dump(exclude_none=True)
        tool_id = message["tool_calls"][0]["id"]
        if call == "later":
            rec.encoded.clear()
            huge = {"role": "tool", "tool_call_id": tool_id, "content": HUGE}
            with pytest.raises(openai.BadRequestError) as info:
                await c.chat.completions.create(
                    model=MODEL, messages=[*FIRST, message, huge], tools=TOOLS
                )
            errors.append(info.value)
            work.extend(rec.encoded)
        tool = {"role": "tool", "tool_call_id": tool_id, "content": "2"}
        r = await c.chat.completions.create(
            model=MODEL, messages=[*FIRST, message, tool], tools=TOOLS
        )
        return 1.0 if r.choices[0].message.content == "The sum is 2." else 0.0

    drops, (group,) = await run_episode(engine, rec, parser, FIRST, agent, max_episode_tokens=512)
    assert not drops and group.samples[0].extra["reward"] == 1.0
    (err,) = errors
    if call == "first":
        assert err.code == "prompt_mismatch" and "more than" in err.message
    else:
        assert err.code == "context_length_exceeded" and "needs more than" in err.message
        assert "token budget is spent" in err.message
    # The huge call's tokenizing: a prefix, off the loop (a small call's runs on it).
    assert work and max(n for n, _ in work) < len(HUGE) // 4
    assert all(thread != loop_thread for _, thread in work)


def test_more_ids_than_refuses_only_texts_that_are_over() -> None:
    """From a prefix of the text: a text far over the limit is found so after tokenizing a
    few times the limit; a text within it, however many characters each of its tokens
    spans, is never refused (it is then encoded whole, as before)."""
    rec = Recording(qwen3_tokenizer())
    assert rec.more_ids_than(HUGE, 512)
    assert max(n for n, _ in rec.encoded) < len(HUGE) // 4
    long_tokens = [
        HUGE, " " * 60_000, "a" * 40_000, "<|im_end|>" * 3_000, "数字" * 20_000,
        "x\n" * 30_000, "\u00e9" * 30_000, "e\u0301" * 20_000, "0123456789" * 5_000,
    ]  # fmt: skip
    for text in long_tokens:
        n = len(rec.encode(text))
        assert not rec.more_ids_than(text, n), text[:20]
        if n * 8 >= len(text):  # and far over is found (a run of spaces is 128 per token)
            assert rec.more_ids_than(text, n // 20), text[:20]


async def test_an_agent_that_raises_fails_its_group_with_the_reason(
    fmt: ChatFormat, parser: Parser
) -> None:
    engine = ScriptEngine([(ids(fmt, CALL), "stop"), (ids(fmt, ANSWER), "stop")] * 2)

    async def agent(base_url: str, episode: Episode) -> float:
        c = client(base_url)
        await c.chat.completions.create(
            model=MODEL, messages=[*FIRST, {"role": "user", "content": "x"}], tools=TOOLS
        )
        return 1.0

    drops, groups = await run_episode(engine, fmt, parser, FIRST, agent)
    assert not groups
    (drop,) = drops
    assert drop.reason is FailureReason.ENVIRONMENT_ERROR
    assert "BadRequestError" in drop.error and "differ from the episode's prompt" in drop.error


async def test_a_client_that_disconnects_mid_stream_leaves_the_run_going(
    fmt: ChatFormat, parser: Parser
) -> None:
    """The agent drops the connection after the first chunk, then retries the same call: it
    gets the same turn (trained once), and the episode goes on to its next turn."""
    engine = ScriptEngine([(ids(fmt, CALL), "stop"), (ids(fmt, ANSWER), "stop")])

    async def agent(base_url: str, episode: Episode) -> float:
        body = {"model": MODEL, "messages": FIRST, "tools": TOOLS, "stream": True}
        async with (
            aiohttp.ClientSession() as s,
            s.post(base_url + "/chat/completions", json=body) as r,
        ):
            assert r.status == 200
            await r.content.readline()  # one line, then the connection is dropped
            r.close()
        return await tool_agent(base_url, episode)

    drops, (group,) = await run_episode(engine, fmt, parser, FIRST, agent)
    assert not drops and group.samples[0].extra["reward"] == 1.0
    assert len(engine.requests) == 2


# -- pauses and weight updates: exact versions and logprobs ------------------------------------


@pytest.mark.parametrize("mode", ["abort", "keep"])
async def test_weight_updates_during_calls_keep_versions_and_logprobs_exact(
    fmt: ChatFormat, parser: Parser, mode: str
) -> None:
    """SimEngine (random ids; `<|im_end|>` as its end token) with latency; an agent of each
    group starts a weight update while its second call is in the engine: in abort mode the
    call is aborted and re-submitted, in keep mode paused in place, invisibly either way.
    What each agent got back is exactly the trained part of its sample, with the sample's
    logprobs, and versions never decrease."""
    im_end = fmt.stop_token_ids[0]
    engine = Signalling(
        vocab_size=151936, eos_token_id=im_end, per_token_latency_s=0.002, lengths="uniform",
        min_new_tokens=4, seed=3,
    )  # fmt: skip
    got: dict[str, list[list[float]]] = {}
    holder: list[Producer] = []

    async def agent(base_url: str, episode: Episode) -> float:
        c = client(base_url)
        messages: list[dict[str, Any]] = [dict(m) for m in FIRST]
        lps = got.setdefault(f"{episode.prompt_id}/{episode.index}", [])
        for turn in range(3):
            engine.started[episode.session].clear()
            call = asyncio.ensure_future(
                c.chat.completions.create(
                    model=MODEL, messages=messages, tools=TOOLS, logprobs=True, max_tokens=16
                )
            )
            if turn == 1 and episode.index == 0:
                await asyncio.wait_for(engine.started[episode.session].wait(), DEADLINE_S)
                await asyncio.wait_for(holder[0].update_weights(None), DEADLINE_S)
            choice = (await call).choices[0]
            lps.append([t.logprob for t in choice.logprobs.content])
            if choice.finish_reason == "length":
                break
            messages += [
                choice.message.model_dump(exclude_none=True),
                {"role": "user", "content": "more"},
            ]
        return float(len(lps))

    drops, groups = await run_episode(
        engine, fmt, parser, FIRST, agent, prompts=8, group_size=2, batch_size=2,
        pause_mode=mode, keep=holder,
    )  # fmt: skip
    assert not drops and len(groups) == 8
    mixed = turns = 0
    for g in groups:
        for i, s in enumerate(g.samples):
            assert s.loss_mask is not None
            trained = s.logprobs[s.loss_mask == 1]
            sent = [x for turn in got[f"{g.prompt_id}/{i}"] for x in turn]
            turns += len(got[f"{g.prompt_id}/{i}"])
            assert np.array_equal(trained, np.array(sent, dtype=np.float32))
            assert (np.diff(s.versions) >= 0).all()
            mixed += len(set(s.versions[s.loss_mask == 1].tolist())) > 1
    assert mixed > 0  # a sample holds tokens of several versions
    if mode == "abort":  # calls in flight during an update were aborted and re-submitted
        assert engine.calls > turns
    else:  # paused in place: one engine call per turn
        assert engine.calls == turns


# -- an agent written with the OpenAI Agents SDK -------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_an_openai_agents_sdk_agent_trains_unchanged(
    fmt: ChatFormat, parser: Parser, stream: bool
) -> None:
    """`agents.Agent` with a function tool, run by `Runner`: its calls are the episode's turns
    (the tool call reaches the SDK, which runs the tool and sends its result back)."""
    sdk = pytest.importorskip("agents")
    from agents.models.chatcmpl_converter import Converter
    from agents.models.openai_chatcompletions import OpenAIChatCompletionsModel

    sdk.set_tracing_disabled(True)
    ran: list[int] = []

    @sdk.function_tool
    def add(a: int) -> str:
        """Add one to a."""
        ran.append(a)
        return str(a + 1)

    instructions = "You add numbers."
    first = [{"role": "system", "content": instructions}, *FIRST]
    tools = (dict(Converter.tool_to_openai(add)),)
    sdk_fmt = ChatFormat(fmt.tokenizer, tools=tools)
    engine = ScriptEngine([(ids(fmt, CALL), "stop"), (ids(fmt, ANSWER), "stop")])

    async def agent(base_url: str, episode: Episode) -> float:
        model = OpenAIChatCompletionsModel(model=MODEL, openai_client=client(base_url))
        bot = sdk.Agent(name="adder", instructions=instructions, tools=[add], model=model)
        if stream:
            run = sdk.Runner.run_streamed(bot, FIRST[0]["content"])
            async for _ in run.stream_events():
                pass
            output = run.final_output
        else:
            output = (await sdk.Runner.run(bot, FIRST[0]["content"])).final_output
        return 1.0 if "2" in str(output) else 0.0

    drops, (group,) = await run_episode(engine, sdk_fmt, parser, first, agent)
    assert not drops and ran == [1]
    (sample,) = group.samples
    assert sample.extra["reward"] == 1.0
    assert len(engine.requests) == 2
    assert sample.loss_mask is not None
    assert sample.tokens[sample.loss_mask == 1].tolist() == ids(fmt, CALL) + ids(fmt, ANSWER)


async def test_an_endpoint_not_entered_fails_the_group_saying_so(fmt: ChatFormat) -> None:
    def parser(tools: Any) -> ReplyParser:
        return RenderersParser(fmt.tokenizer)

    async def agent(base_url: str, episode: Episode) -> float:
        raise AssertionError("never called")

    endpoint = AgentEndpoint(fmt, parser, sampling=SAMPLING)  # not entered
    drops, groups = await run_episode(
        ScriptEngine([]), fmt, parser, FIRST, agent, endpoint=endpoint
    )
    assert not groups
    (drop,) = drops
    assert "the AgentEndpoint is not serving: enter it" in drop.error


async def test_a_call_past_max_turns_is_refused_and_the_episode_is_kept(
    fmt: ChatFormat, parser: Parser
) -> None:
    engine = ScriptEngine([(ids(fmt, CALL), "stop")] * 4)
    errors: list[Any] = []

    async def agent(base_url: str, episode: Episode) -> float:
        c = client(base_url)
        messages: list[dict[str, Any]] = [dict(m) for m in FIRST]
        for _ in range(4):  # max_turns=4 in produce
            r = await c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
            message = r.choices[0].message.model_dump(exclude_none=True)
            call_id = message["tool_calls"][0]["id"]
            messages += [message, {"role": "tool", "tool_call_id": call_id, "content": "2"}]
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        errors.append(info.value)
        return 0.25

    drops, (group,) = await run_episode(engine, fmt, parser, FIRST, agent)
    assert not drops and group.samples[0].extra["reward"] == 0.25
    (err,) = errors
    assert err.code == "max_turns_exceeded" and "taken its 4 turns" in err.message
    mask = group.samples[0].loss_mask
    assert mask is not None and int(mask.sum()) == 4 * len(ids(fmt, CALL))


# -- a reply cut by max_tokens: continued after the template's end of turn ---------------------


def tiny_format() -> tuple[ChatFormat, Callable[[Any], Any]]:
    from asyncroll.app.models import build_tiny_model
    from asyncroll.chat.parse import TextParser
    from asyncroll.chat.tiny import tiny_chat_tokenizer

    fmt = ChatFormat(tiny_chat_tokenizer(build_tiny_model()))
    return fmt, lambda tools: TextParser(fmt.tokenizer, fmt.stop_token_ids)


def qwen3_format() -> tuple[ChatFormat, Callable[[Any], Any]]:
    renderers = pytest.importorskip("renderers")
    fmt = ChatFormat(qwen3_tokenizer())
    return fmt, lambda tools: RenderersParser(fmt.tokenizer, renderers.Qwen3RendererConfig())


# (template, the cut reply's text, the next reply's text with its end of turn)
CUT_CASES = {
    "qwen3": (qwen3_format, "The sum is", "2.<|im_end|>"),
    "tiny": (tiny_format, "5 6", "7<|eos|>"),
}


@pytest.mark.parametrize(
    ("template", "cut_by"), [("qwen3", "max_tokens"), ("tiny", "max_tokens"), ("tiny", "stop")]
)
async def test_a_reply_cut_by_max_tokens_is_continued_after_the_templates_end_of_turn(
    template: str, cut_by: str
) -> None:
    """The agent gets the cut reply (`finish_reason="length"`; "stop" where a stop string of
    the call ended it, without an end-of-turn token too) and goes on with a user message:
    the stream keeps the sampled ids, then the template's own end-of-turn token and the user
    message's bridge, both untrained; the whole equals the template's render of the
    conversation (the cut ids are the text's own encoding here), so nothing was re-rendered
    and nothing is missing. A call that rewrites the cut reply is still refused."""
    make, cut_text, answer_text = CUT_CASES[template]
    fmt, parser = make()
    first = [{"role": "user", "content": "add 1"}]
    more = {"role": "user", "content": "go on"}
    cut, answer = fmt.encode(cut_text), fmt.encode(answer_text)
    finish = "length" if cut_by == "max_tokens" else "stop"
    engine = ScriptEngine([(cut, finish), (answer, "stop")])
    limit: dict[str, Any] = (
        {"max_tokens": len(cut)} if cut_by == "max_tokens" else {"stop": [cut_text[-1]]}
    )
    seen: dict[str, Any] = {}

    async def agent(base_url: str, episode: Episode) -> float:
        c = client(base_url)
        r = await c.chat.completions.create(model=MODEL, messages=first, **limit)
        seen["finish"] = r.choices[0].finish_reason
        message = r.choices[0].message.model_dump(exclude_none=True)
        seen["content"] = message["content"]
        rewritten = {**message, "content": message["content"] + " 2"}
        seen["rewrite"] = await raw(
            base_url + "/chat/completions",
            {"model": MODEL, "messages": [*first, rewritten, more]},
        )
        r = await c.chat.completions.create(model=MODEL, messages=[*first, message, more])
        seen["second"] = r.choices[0].finish_reason, r.choices[0].message.content
        return 1.0

    drops, (group,) = await run_episode(engine, fmt, parser, first, agent)
    assert not drops
    assert seen["finish"] == finish and seen["content"] == cut_text
    status, body = seen["rewrite"]
    assert status == 400 and body["error"]["code"] == "conversation_rewritten"
    assert seen["second"] == ("stop", answer_text.rsplit("<|", 1)[0])
    (end,) = fmt.encode(fmt.end_of_turn[0])
    bridge = fmt.bridge({"role": "assistant", "content": cut_text}, [more])
    (sample,) = group.samples
    assert len(engine.requests) == 2
    if cut_by == "stop":  # the stop string's token is a stop id of the call, not a turn's end
        assert cut[-1] in engine.requests[0].sampling.stop_token_ids
    assert engine.requests[1].samples[0].prefix.tolist() == [*cut, end, *bridge]
    assert sample.tokens.tolist() == [*cut, end, *bridge, *answer]
    assert sample.loss_mask is not None
    assert sample.loss_mask.tolist() == [1] * len(cut) + [0] * (1 + len(bridge)) + [1] * len(answer)
    # The template's own render of the conversation, the cut reply as its text, is the stream.
    rendered = fmt.render_text(
        [*first, {"role": "assistant", "content": cut_text}, more], generation_prompt=True
    )
    assert fmt.encode(rendered) == fmt.prompt_ids(first) + sample.tokens.tolist()[: -len(answer)]


async def test_a_reply_cut_by_the_episode_budget_ends_the_episode_with_a_clear_message() -> None:
    """A cut reply that used the last of the episode's tokens leaves no room for the end of
    turn and the next messages: the next call is refused, the episode kept as it is."""
    fmt, parser = tiny_format()
    first = [{"role": "user", "content": "add 1"}]
    cut = fmt.encode("5 6 7 8")
    engine = ScriptEngine([(cut, "length")])
    errors: list[Any] = []

    async def agent(base_url: str, episode: Episode) -> float:
        c = client(base_url)
        r = await c.chat.completions.create(model=MODEL, messages=first)
        message = r.choices[0].message.model_dump(exclude_none=True)
        with pytest.raises(openai.BadRequestError) as info:
            more = {"role": "user", "content": "go on"}
            await c.chat.completions.create(model=MODEL, messages=[*first, message, more])
        errors.append(info.value)
        return 0.5

    drops, (group,) = await run_episode(
        engine, fmt, parser, first, agent, max_episode_tokens=len(cut)
    )
    assert not drops
    (err,) = errors
    assert err.code == "context_length_exceeded" and "token budget is spent" in err.message
    (sample,) = group.samples
    assert sample.tokens.tolist() == cut and sample.extra["reward"] == 0.5


async def test_a_later_call_renders_what_follows_the_reply_once() -> None:
    """A later call renders the template after the last reply once (`ChatFormat.after_reply`:
    the end of turn and the new messages' bridge), checks the episode's budget against those
    ids, then appends them: the check does not render them a second time. After a cut reply
    (the end of turn added) and after one that ended its turn alike."""
    base, parser = tiny_format()
    renders: list[int] = []

    class Counting(ChatFormat):
        def after_reply(self, reply: Any, new_messages: Sequence[Any]) -> tuple[str, str]:
            renders[-1] += 1
            return super().after_reply(reply, new_messages)

    fmt = Counting(base.tokenizer)
    first = [{"role": "user", "content": "add 1"}]
    cut, ended = fmt.encode("5 6"), fmt.encode("7<|eos|>")
    engine = ScriptEngine([(cut, "length"), (ended, "stop"), (ended, "stop")])

    async def agent(base_url: str, episode: Episode) -> float:
        c = client(base_url)
        messages: list[dict[str, Any]] = [dict(m) for m in first]
        for turn in range(3):
            renders.append(0)
            r = await c.chat.completions.create(model=MODEL, messages=messages)
            message = r.choices[0].message.model_dump(exclude_none=True)
            messages += [message, {"role": "user", "content": f"turn {turn}"}]
        return 1.0

    drops, (group,) = await run_episode(engine, fmt, parser, first, agent)
    assert not drops and group.samples[0].extra["reward"] == 1.0
    assert renders == [0, 1, 1]  # the first call's prompt is compared, not rendered after


async def test_chat_episode_add_after_a_cut_reply_closes_the_turn_only_when_asked() -> None:
    """The chat layer under the endpoint: `add` after a cut reply is refused by default (the
    message names `after_cut`); with `after_cut=True` it appends the template's end of turn
    and the bridge, untrained, and says so in `differences`."""
    from asyncroll.chat.episode import ChatEpisode
    from asyncroll.chat.template import ChatError

    fmt, parser = tiny_format()
    first = [{"role": "user", "content": "add 1"}]
    more = [{"role": "user", "content": "go on"}]
    cut = fmt.encode("5 6")
    engine = ScriptEngine([(cut, "length")])
    got: dict[str, Any] = {}

    async def rollout(episode: Episode) -> None:
        chat = ChatEpisode(episode, fmt, parser(None), messages=first)
        await chat.reply()
        with pytest.raises(ChatError, match="after_cut=True"):
            chat.add(more)
        got["ids"] = chat.add(more, after_cut=True)
        got["differences"] = chat.differences
        episode.extra["reward"] = 0.0

    drops, (group,) = await produce(engine, fmt.prompt_ids(first), rollout, max_episode_tokens=64)
    assert not drops
    bridge = fmt.bridge({"role": "assistant", "content": "5 6"}, more)
    assert got["ids"] == [*fmt.stop_token_ids, *bridge]
    (note,) = got["differences"]
    assert "did not end its turn" in note and "'<|eos|>' appended as context" in note
    (sample,) = group.samples
    assert sample.tokens.tolist() == [*cut, *got["ids"]]
    assert sample.loss_mask is not None
    assert sample.loss_mask.tolist() == [1] * len(cut) + [0] * len(got["ids"])


async def test_chat_episode_continuation_appends_only_where_it_was_computed() -> None:
    """`add` in two steps: `continuation` renders and appends nothing; `append` appends
    exactly what `add` would; a continuation appended twice, or after the episode moved on
    (another add and reply), is refused rather than spliced into the wrong place."""
    from asyncroll.chat.episode import ChatEpisode
    from asyncroll.chat.template import ChatError

    fmt, parser = tiny_format()
    first = [{"role": "user", "content": "add 1"}]
    more = [{"role": "user", "content": "go on"}]
    ended = fmt.encode("5 6<|eos|>")
    engine = ScriptEngine([(ended, "stop"), (ended, "stop")])
    got: dict[str, Any] = {}

    async def rollout(episode: Episode) -> None:
        chat = ChatEpisode(episode, fmt, parser(None), messages=first)
        await chat.reply()
        step = chat.continuation(more)
        got["before"] = episode.tokens.tolist()
        got["ids"] = chat.append(step)
        with pytest.raises(ChatError, match="compute it again"):
            chat.append(step)  # twice
        await chat.reply()
        with pytest.raises(ChatError, match="compute it again"):
            chat.append(step)  # after the episode moved on
        got["messages"] = chat.messages
        episode.extra["reward"] = 0.0

    drops, (group,) = await produce(engine, fmt.prompt_ids(first), rollout, max_episode_tokens=64)
    assert not drops
    assert got["before"] == ended  # continuation() appended nothing
    bridge = fmt.bridge({"role": "assistant", "content": "5 6"}, more)
    assert got["ids"] == bridge
    assert [m["role"] for m in got["messages"]] == ["user", "assistant", "user", "assistant"]
    (sample,) = group.samples
    assert sample.tokens.tolist() == [*ended, *bridge, *ended]
