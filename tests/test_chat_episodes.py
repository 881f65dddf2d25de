"""Chat episodes on the real Qwen3 tokenizer and template with a scripted engine (a
simulation: it returns the ids a test gives it): bad input gets a clear error at the call or
fails its group with a reason; a non-canonical BPE split is trained and continued as sampled."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from asyncroll import Episode, Producer, SamplingConfig
from asyncroll.chat.episode import ChatEpisode
from asyncroll.chat.parse import RenderersParser, TextParser, ToolCallError
from asyncroll.chat.template import ChatError, ChatFormat
from asyncroll.engines.base import GenerateRequest, SampleOutput, Weights
from asyncroll.outcomes import FailureReason
from asyncroll.types import RolloutGroup
from tests.chat.templates import qwen3_tokenizer, trl_tokenizer

DEADLINE_S = 30.0
TOOLS = [{"type": "function", "function": {"name": "add", "description": "add",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]  # fmt: skip
FIRST = [{"role": "user", "content": "add 1"}]
SAMPLING = SamplingConfig(max_new_tokens=64)


class ScriptEngine:
    """Answers call k with `script[k]` (ids, finish reason); records every request."""

    vocab_size = 151936
    max_model_len: int | None = None
    supports_keep_pause = False
    adapter_slots: int | None = None
    pause_bound_s: float | None = None

    def __init__(self, script: Sequence[tuple[list[int], str]]) -> None:
        self.script = list(script)
        self.requests: list[GenerateRequest] = []
        self.version = 0

    def payload_bytes(self, max_new_tokens: int) -> int:
        return 0

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        self.requests.append(request)
        ids, finish = self.script[len(self.requests) - 1]
        n = len(ids)
        return [
            SampleOutput(
                tokens=np.array(ids, dtype=np.int32),
                logprobs=np.full(n, -1.0, dtype=np.float32),
                versions=np.zeros(n, dtype=np.int32),
                finish_reason=finish,
            )
        ]

    async def abort(self, request_id: str) -> None:
        pass

    async def pause_generation(self) -> None:
        raise NotImplementedError

    async def resume_generation(self) -> None:
        raise NotImplementedError

    async def update_weights(self, weights: Weights | None, *, version: int) -> None:
        self.version = version

    async def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def fmt() -> ChatFormat:
    return ChatFormat(qwen3_tokenizer(), tools=TOOLS)


@pytest.fixture(scope="module")
def parser() -> RenderersParser:
    renderers = pytest.importorskip("renderers")

    return RenderersParser(qwen3_tokenizer(), renderers.Qwen3RendererConfig(), tools=TOOLS)


def ids_of(fmt: ChatFormat, text: str) -> list[int]:
    return fmt.encode(text)


async def zero(group: RolloutGroup) -> list[float]:
    return [0.0] * len(group.samples)


async def run_one(
    fmt: ChatFormat, script: Sequence[tuple[list[int], str]], agent: Callable[..., Any],
    *, sampling: SamplingConfig = SAMPLING,
) -> tuple[list[Any], list[RolloutGroup], ScriptEngine]:  # fmt: skip
    """One group of one episode (the producer sampling with `sampling`); its drop records
    (a FAILED group) or its group."""
    engine = ScriptEngine(script)
    drops: list[Any] = []
    producer = Producer(
        engine, [fmt.prompt_ids(FIRST)], zero, group_size=1, batch_size=1, rollout_fn=agent,
        on_drop=drops.append, max_turns=4, max_episode_tokens=4096, sampling=sampling,
    )  # fmt: skip
    groups: list[RolloutGroup] = []
    async with producer:
        done = asyncio.ensure_future(producer.produce_batch(1, timeout=DEADLINE_S))
        failed = asyncio.ensure_future(producer._changed.wait_until(lambda: bool(drops)))
        await asyncio.wait([done, failed], timeout=DEADLINE_S, return_when="FIRST_COMPLETED")
        if done.done() and done.exception() is None:  # else exhausted: its one prompt failed
            groups = list(done.result().groups)
        for task in (done, failed):
            task.cancel()
    producer.check_ledger()
    return drops, groups, engine


# -- bad input: a clear error at the call -------------------------------------------------------


def test_an_unknown_role_is_refused_at_the_call(fmt: ChatFormat) -> None:
    with pytest.raises(ChatError, match=r"message 1 has role 'robot': use one of"):
        fmt.prompt_ids([{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}])
    # Qwen3's template drops a "developer" message without a word: taken, it would vanish
    # from the prompt and from every bridge. Prompts and episodes accept the same roles.
    with pytest.raises(ChatError, match=r"message 0 has role 'developer'"):
        fmt.prompt_ids([{"role": "developer", "content": "be brief"}, *FIRST])
    with pytest.raises(ChatError, match="give a mapping with 'role'"):
        fmt.prompt_ids([{"content": "no role"}])


def test_the_docs_quote_the_unknown_role_error_as_it_is(fmt: ChatFormat) -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "chat-episodes.md").read_text()
    (quoted,) = re.findall(r'\("(message 1 has role \'robot\'[^"]*)"', doc)
    with pytest.raises(ChatError) as info:
        fmt.prompt_ids([{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}])
    assert str(info.value) == quoted


def test_a_message_list_the_template_rejects_is_a_chat_error(fmt: ChatFormat) -> None:
    with pytest.raises(ChatError, match=r"the chat template rejected the messages: .*content"):
        fmt.prompt_ids([{"role": "user"}])  # no content
    with pytest.raises(ChatError, match=r"the chat template rejected the messages: .*iterable"):
        fmt.bridge({"role": "assistant", "content": "", "tool_calls": 5}, FIRST)
    # A template's own raise_exception (Gemma 3: roles must alternate).
    gemma = ChatFormat(trl_tokenizer("gemma3"))
    with pytest.raises(ChatError, match="rejected the messages: TemplateError: Conversation roles"):
        gemma.prompt_ids([*FIRST, *FIRST])


def test_an_assistant_message_cannot_be_added_as_context(fmt: ChatFormat) -> None:
    with pytest.raises(ChatError, match="the policy's turns are sampled"):
        fmt.bridge({"role": "assistant", "content": "x"}, [{"role": "assistant", "content": "y"}])


# -- bad input inside an episode: the group fails with a reason ---------------------------------


async def test_a_tool_call_that_does_not_parse_fails_the_group_with_its_text(
    fmt: ChatFormat, parser: RenderersParser
) -> None:
    bad = ids_of(fmt, '<tool_call>\n{"name": "add", "arguments": {a: 1}}\n</tool_call><|im_end|>')
    seen: list[Any] = []

    async def agent(episode: Episode) -> None:
        chat = ChatEpisode(episode, fmt, parser, messages=FIRST)
        reply = await chat.reply()
        seen.append(reply)
        reply.checked_tool_calls()  # raises: the rollout function does not handle it

    drops, _, _ = await run_one(fmt, [(bad, "stop")], agent)
    (reply,) = seen
    assert [c.status for c in reply.tool_calls] == ["invalid_json"]
    assert reply.message().get("tool_calls") is None  # a call that did not parse is not sent on
    (drop,) = drops
    assert drop.reason is FailureReason.ENVIRONMENT_ERROR
    assert "ToolCallError" in drop.error and "invalid_json" in drop.error and "{a: 1}" in drop.error


async def test_a_reply_cut_inside_a_tool_call_cannot_be_continued(
    fmt: ChatFormat, parser: RenderersParser
) -> None:
    cut = ids_of(fmt, '<tool_call>\n{"name": "add", "argu')
    seen: list[Any] = []

    async def agent(episode: Episode) -> None:
        chat = ChatEpisode(episode, fmt, parser, messages=FIRST)
        reply = await chat.reply()
        seen.append(reply)
        with pytest.raises(ToolCallError, match=r"cut by the length limit.*unclosed_block"):
            reply.checked_tool_calls()
        chat.add([{"role": "tool", "content": "2"}])  # refused: no end of turn to continue

    drops, _, _ = await run_one(fmt, [(cut, "length")], agent)
    (reply,) = seen
    assert reply.truncated and reply.finish_reason == "length"
    (drop,) = drops
    assert drop.reason is FailureReason.ENVIRONMENT_ERROR
    assert "ChatError" in drop.error and "finish reason 'length'" in drop.error


async def test_an_unknown_role_added_mid_episode_fails_the_group(
    fmt: ChatFormat, parser: RenderersParser
) -> None:
    async def agent(episode: Episode) -> None:
        chat = ChatEpisode(episode, fmt, parser, messages=FIRST)
        await chat.reply()
        chat.add([{"role": "environment", "content": "2"}])

    drops, _, _ = await run_one(fmt, [(ids_of(fmt, "ok<|im_end|>"), "stop")], agent)
    (drop,) = drops
    assert "role 'environment'" in drop.error and drop.reason is FailureReason.ENVIRONMENT_ERROR


@pytest.mark.parametrize("order", ["reply twice", "add first"])
async def test_calls_out_of_order_are_refused(
    fmt: ChatFormat, parser: RenderersParser, order: str
) -> None:
    async def agent(episode: Episode) -> None:
        chat = ChatEpisode(episode, fmt, parser, messages=FIRST)
        if order == "add first":
            chat.add([{"role": "user", "content": "x"}])
        await chat.reply()
        await chat.reply()

    script = [(ids_of(fmt, "ok<|im_end|>"), "stop")] * 2
    drops, _, _ = await run_one(fmt, script, agent)
    (drop,) = drops
    needle = "right after a reply" if order == "reply twice" else "add\\(\\) before a reply"
    assert re.search(needle, drop.error), drop.error


# -- exactness: what was sampled is what is trained and continued --------------------------------


async def test_a_bpe_split_that_does_not_survive_decode_then_encode_is_kept(
    fmt: ChatFormat, parser: RenderersParser
) -> None:
    """The policy spells "hello" as h + ello (the tokenizer's own encoding is one token):
    decoding and encoding the reply again would give other ids. The sample trains on the
    sampled ids, and the next turn's request continues exactly them."""
    tok = fmt.tokenizer
    split = [*ids_of(fmt, "h"), *ids_of(fmt, "ello"), *ids_of(fmt, "<|im_end|>")]
    assert ids_of(fmt, tok.decode(split)) != split  # the premise: it does not round-trip
    second = ids_of(fmt, "done<|im_end|>")
    bridges: list[list[int]] = []

    async def agent(episode: Episode) -> None:
        chat = ChatEpisode(episode, fmt, parser, messages=FIRST)
        reply = await chat.reply()
        assert reply.content == "hello"
        bridges.append(chat.add([{"role": "user", "content": "again"}]))
        await chat.reply()

    drops, groups, engine = await run_one(fmt, [(split, "stop"), (second, "stop")], agent)
    assert not drops, drops
    (sample,) = groups[0].samples
    (bridge,) = bridges
    assert sample.tokens.tolist() == split + bridge + second
    assert sample.loss_mask is not None
    assert sample.loss_mask.tolist() == [1] * len(split) + [0] * len(bridge) + [1] * len(second)
    (continued,) = engine.requests[1].samples
    assert continued.prefix.tolist() == split + bridge  # the sampled ids, not a re-encoding
    assert tok.decode(bridge) == "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"


async def test_a_tool_loop_parses_reasoning_and_calls_and_appends_the_results(
    fmt: ChatFormat, parser: RenderersParser
) -> None:
    call = ids_of(
        fmt,
        '<think>\nadd it\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n'
        "</tool_call><|im_end|>",
    )
    final = ids_of(fmt, "<think>\n\n</think>\n\n2<|im_end|>")
    replies: list[Any] = []

    async def agent(episode: Episode) -> None:
        chat = ChatEpisode(episode, fmt, parser, messages=FIRST)
        reply = await chat.reply()
        replies.append(reply)
        (c,) = reply.checked_tool_calls()
        chat.add([{"role": "tool", "content": str(c.arguments["a"] + 1)}])  # type: ignore[index]
        replies.append(await chat.reply())
        episode.extra["messages"] = [m["role"] for m in chat.messages]

    drops, groups, engine = await run_one(fmt, [(call, "stop"), (final, "stop")], agent)
    assert not drops, drops
    # Each turn stops at <|im_end|> (added to the producer's stop tokens).
    assert all(r.sampling.stop_token_ids == (151645,) for r in engine.requests)
    first, last = replies
    assert first.reasoning == "add it" and first.content == ""
    assert [(c.name, c.arguments) for c in first.tool_calls] == [("add", {"a": 1})]
    assert last.content == "2" and not last.tool_calls
    (sample,) = groups[0].samples
    assert sample.extra["messages"] == ["user", "assistant", "tool", "assistant"]
    # The stream is the template's rendering of the whole conversation (a tool loop keeps
    # the reasoning of the turns after the last user message: Qwen3 preserves the prefix).
    messages = [*FIRST, first.message(), {"role": "tool", "content": "2"}]
    expected = fmt.encode(fmt.render_text(messages, generation_prompt=True))
    assert [*fmt.prompt_ids(FIRST), *sample.tokens.tolist()][: len(expected)] == expected


def plain_ids(fmt: ChatFormat, text: str) -> list[int]:
    """`text` as ordinary tokens: special-token text in it (`<|im_end|>`) spelled out piece by
    piece, as a policy can sample it."""
    out = fmt.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return [int(i) for i in out]


# A tool call whose arguments hold the end-of-turn text: sampled as ordinary tokens (a coding
# agent writing s.split("<|im_end|>")), or as the JSON escape the template's tojson undoes.
END_IN_ARGUMENTS = {
    "literal": '{"s": "x.split(\\"<|im_end|>\\")"}',
    "json escape": '{"s": "\\u003c|im_end|\\u003e"}',
}


def end_in_call_ids(fmt: ChatFormat, spelling: str) -> list[int]:
    """A reply that is one such tool call, ended by the real `<|im_end|>` token."""
    args = END_IN_ARGUMENTS[spelling]
    text = '<tool_call>\n{"name": "add", "arguments": ' + args + "}\n</tool_call>"
    return [*plain_ids(fmt, text), *fmt.stop_token_ids]


@pytest.mark.parametrize("spelling", END_IN_ARGUMENTS)
async def test_end_of_turn_text_inside_a_tool_call_is_not_the_reply_s_end(
    fmt: ChatFormat, parser: RenderersParser, spelling: str
) -> None:
    """The bridge after such a reply is what the real Qwen3 template writes after the
    reply's `<|im_end|>` token, id for id: the template's own tokenization of the whole
    conversation ends with exactly these ids, and they are the ones it writes after any
    tool call (nothing of the call's tail, no second `<|im_end|>`)."""
    tok = fmt.tokenizer
    call = end_in_call_ids(fmt, spelling)
    im_end = call[-1]
    assert call.count(im_end) == 1  # the premise: the text inside is ordinary tokens
    tool = {"role": "tool", "content": "2"}
    second = ids_of(fmt, "done<|im_end|>")
    got: dict[str, Any] = {}

    async def agent(episode: Episode) -> None:
        chat = ChatEpisode(episode, fmt, parser, messages=FIRST)
        reply = await chat.reply()
        got["message"] = reply.message()
        got["bridge"] = chat.add([tool])
        await chat.reply()

    drops, groups, engine = await run_one(fmt, [(call, "stop"), (second, "stop")], agent)
    assert not drops, drops
    (c,) = got["message"]["tool_calls"]
    assert "<|im_end|>" in c["function"]["arguments"]["s"]  # parsed: the text is in the call
    bridge = got["bridge"]
    # The template's own tokens for the conversation: everything after the reply's end.
    full = tok.apply_chat_template(
        [*FIRST, got["message"], tool], tools=TOOLS, add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )  # fmt: skip
    assert bridge == list(full[-len(bridge) :]) and full[-len(bridge) - 1] == im_end
    assert bridge == fmt.encode(
        "\n<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    (sample,) = groups[0].samples
    assert sample.tokens.tolist() == call + bridge + second
    assert engine.requests[1].samples[0].prefix.tolist() == call + bridge
    if spelling == "literal":  # the sampled text is the template's: the whole render is the stream
        rendered = fmt.render_text([*FIRST, got["message"], tool], generation_prompt=True)
        assert rendered == tok.decode(fmt.prompt_ids(FIRST) + call + bridge)


async def test_without_sampling_a_chat_episode_samples_with_the_producer_s(
    fmt: ChatFormat, parser: RenderersParser
) -> None:
    """As `Episode.generate` does: the behaviour logprobs must be those of the policy the
    trainer recomputes, so a `ChatEpisode` given no `sampling=` takes the producer's (its
    temperature, top-p/k, seed, budget and stop tokens), the end-of-turn id added."""
    producer_s = SamplingConfig(
        max_new_tokens=48, temperature=0.6, top_p=0.95, top_k=20, seed=7, stop_token_ids=(13,)
    )

    async def agent(episode: Episode) -> None:
        chat = ChatEpisode(episode, fmt, parser, messages=FIRST)
        await chat.reply()

    drops, _, engine = await run_one(
        fmt, [(ids_of(fmt, "ok<|im_end|>"), "stop")], agent, sampling=producer_s
    )
    assert not drops, drops
    (request,) = engine.requests
    assert request.sampling == msgspec.structs.replace(producer_s, stop_token_ids=(13, 151645))
    assert request.samples[0].max_new_tokens == 48


def test_template_kwargs_reach_the_bridge_s_generation_prompt() -> None:
    fmt = ChatFormat(qwen3_tokenizer(), template_kwargs={"enable_thinking": False})
    text = fmt.tokenizer.decode(fmt.bridge({"role": "assistant", "content": "a"}, FIRST))
    assert (
        text
        == "\n<|im_start|>user\nadd 1<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert fmt.prompt_ids(FIRST)[-4:] == fmt.encode("<think>\n\n</think>\n\n")


def test_an_end_of_turn_that_is_not_one_token_is_refused() -> None:
    with pytest.raises(ChatError, match="end_of_turn 'stop here' is 2 tokens, not one"):
        ChatFormat(qwen3_tokenizer(), end_of_turn=["stop here"])


def test_a_tokenizer_without_a_chat_template_is_refused() -> None:
    tok = qwen3_tokenizer()
    bare = type("Bare", (), {"chat_template": None, "encode": tok.encode})()
    with pytest.raises(ChatError, match="no chat_template"):
        ChatFormat(bare)


async def test_another_end_of_turn_than_the_template_s_is_kept_and_said() -> None:
    """GLM ends a turn with the next role's token: a policy that says <|user|> and then gets
    tool results keeps its <|user|> (trained as sampled); `differences` records it."""
    glm = ChatFormat(trl_tokenizer("glm4moe"), end_of_turn=("<|observation|>", "<|user|>"))
    reply_ids = [*glm.encode("2"), *glm.encode("<|user|>")]
    notes: list[str] = []

    async def agent(episode: Episode) -> None:
        chat = ChatEpisode(episode, glm, TextParser(glm.tokenizer, glm.stop_token_ids))
        await chat.reply()
        chat.add([{"role": "tool", "content": "3"}])
        notes.extend(chat.differences)

    drops, groups, _ = await run_one(glm, [(reply_ids, "stop")], agent)
    assert not drops, drops
    assert notes == [
        "after reply 1: the policy ended its turn with '<|user|>' (kept and trained), where "
        "the template writes '<|observation|>'"
    ]
    (sample,) = groups[0].samples
    assert sample.tokens[: len(reply_ids)].tolist() == reply_ids
