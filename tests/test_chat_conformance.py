"""Chat episodes over real chat templates: random conversations (system, user, assistant with
reasoning and tool calls, tool results; 1-6 turns), the policy's replies simulated as the ids
the template would give them. Where the template keeps the conversation's prefix, each turn's
prompt ids are exactly the template's ids for that context; where it does not (Qwen3 drops
earlier turns' reasoning once a user message follows), the stream keeps the sampled ids and the
new messages' ids are the template's tail; the trained ids are the sampled ones, always."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncroll.chat import PromptBuilder, PromptError, tiny_chat_tokenizer
from asyncroll.chat.template import ChatError, ChatFormat
from tests.chat.templates import TRL_TEMPLATES, qwen3_tokenizer, trl_tokenizer

WORDS = ["hello", "2 + 2", "the answer", "über", "数字", "x", "a b c", "42", '{"k": 1}', "ok."]
TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"{name} numbers",
     "parameters": {"type": "object", "properties": {"a": {"type": "integer"}},
                    "required": ["a"]}}}
    for name in ("add", "lookup")
]  # fmt: skip

text = st.lists(st.sampled_from(WORDS), min_size=1, max_size=4).map(" ".join)
call = st.builds(
    lambda name, a: {"type": "function", "function": {"name": name, "arguments": {"a": a}}},
    st.sampled_from(["add", "lookup"]),
    st.integers(0, 999),
)


# What some templates need: tool call arguments as a JSON string (OpenAI's own form), and the
# tokens a policy ends its turn with where the template's EOS is not it (GLM samples the next
# role's token; gpt-oss ends a tool call with <|call|> and an answer with <|return|>).
STRING_ARGUMENTS = {"deepseekv3", "deepseek_r1_distill"}
END_OF_TURN = {
    "glm4moe": ("<|observation|>", "<|user|>"),
    "gptoss": ("<|call|>", "<|return|>", "<|end|>"),
}


@st.composite
def conversations(
    draw: Any, tools: bool = True, reasoning: bool = True, string_arguments: bool = False
) -> list[dict[str, Any]]:
    """[system?] user, then 1-6 assistant turns; each followed by tool results (when it
    called tools) or a user message, the last one by nothing."""
    msgs: list[dict[str, Any]] = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(text)})
    msgs.append({"role": "user", "content": draw(text)})
    turns = draw(st.integers(1, 6))
    for t in range(turns):
        reply: dict[str, Any] = {"role": "assistant", "content": draw(text)}
        if reasoning and draw(st.booleans()):
            reply["reasoning_content"] = draw(text)
        calls = draw(st.lists(call, max_size=2)) if tools else []
        if string_arguments:
            calls = [{**c, "function": {**c["function"], "arguments": json.dumps(
                c["function"]["arguments"])}} for c in calls]  # fmt: skip
        if calls:
            reply["tool_calls"] = calls
        msgs.append(reply)
        if t == turns - 1:
            break
        if calls:
            msgs.extend({"role": "tool", "content": draw(text)} for _ in calls)
        else:
            msgs.append({"role": "user", "content": draw(text)})
    return msgs


def simulated_reply(fmt: ChatFormat, context: list[Any], reply: Any, after: list[Any]) -> str:
    """The text a policy following the template samples for `reply` after `context`: the
    template's rendering of it up to and including its end-of-turn string. Where the
    generation prompt is not how the template writes the turn's start in history (DeepSeek's
    prompt opens `<think>` that history closes at once), the reply starts where the two part."""
    start = fmt.render_text(context, generation_prompt=True)
    for tail in ([], after):
        full = fmt.render_text([*context, reply, *tail], generation_prompt=bool(tail))
        rest = full[len(os.path.commonprefix([start, full])) :]  # noqa: RUF071 (text)
        ends = [(i, s) for s in fmt.end_of_turn if (i := rest.find(s)) >= 0]
        if ends:
            i, s = min(ends)
            return rest[: i + len(s)]
    return rest + fmt.end_of_turn[0]  # ends where the template shows nothing (a last turn)


# Where the template renders new messages differently after a longer history: DeepSeek's
# templates write `<｜tool▁outputs▁begin｜>` only before the conversation's first tool output
# (a flag they never reset); the bridge, rendered after one reply, writes it every tool round.
TAIL_DIFFERENCE = dict.fromkeys(("deepseekv3", "deepseek_r1_distill"), "<｜tool▁outputs▁begin｜>")


def run_conversation(
    fmt: ChatFormat, msgs: list[dict[str, Any]], tail_difference: str = ""
) -> list[tuple[int, bool]]:
    """Drive the conversation through the format as a chat episode does; check each turn.
    Returns, per later turn, the length of its context and whether the stream is the
    template's rendering of it."""
    first = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    ids = fmt.prompt_ids(msgs[:first])
    mask = [0] * len(ids)
    # The first prompt is the template's own tokenization; the rest of the stream is text
    # encoded piece by piece: the two agree on the first prompt's text.
    assert ids == fmt.encode(fmt.render_text(msgs[:first], generation_prompt=True))
    text = fmt.render_text(msgs[:first], generation_prompt=True)
    sampled: list[list[int]] = []
    seen: list[tuple[int, bool]] = []
    i = first
    while True:
        reply = msgs[i]
        j = i + 1
        while j < len(msgs) and msgs[j]["role"] != "assistant":
            j += 1
        new = msgs[i + 1 : j]
        reply_text = simulated_reply(fmt, msgs[:i], reply, new)
        reply_ids = fmt.encode(reply_text)
        sampled.append(reply_ids)
        ids += reply_ids
        mask += [1] * len(reply_ids)
        text += reply_text
        if not new:
            break
        bridge_text = fmt.bridge_text(reply, new)
        bridge = fmt.bridge(reply, new)
        assert bridge == fmt.encode(bridge_text)
        ids += bridge
        mask += [0] * len(bridge)
        text += bridge_text
        # The next turn's prompt, against the template's rendering of that context.
        full = fmt.render_text(msgs[:j], generation_prompt=True)
        tail_ok = full.endswith(bridge_text) or (
            tail_difference and full.endswith(bridge_text.replace(tail_difference, "", 1))
        )
        assert tail_ok, "the new messages' ids are not the template's tail"
        if text == full:
            assert ids == fmt.encode(full), "same text, other ids: the bridge split a token"
        seen.append((j, text == full))
        i = j
    # Trained: exactly the sampled ids, in order.
    trained = [t for t, m in zip(ids, mask, strict=True) if m]
    assert trained == [t for r in sampled for t in r]
    return seen


SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


@SETTINGS
@given(conversations())
def test_qwen3_real_template_keeps_the_sampled_stream(msgs: list[dict[str, Any]]) -> None:
    fmt = ChatFormat(qwen3_tokenizer(), tools=TOOLS)
    assert fmt.end_of_turn == ("<|im_end|>",) and fmt.stop_token_ids == (151645,)
    for end, same in run_conversation(fmt, msgs):
        # The documented difference, and only it: in history, Qwen3 writes an assistant
        # turn's `<think>` block only when the turn follows the last user message and its
        # reasoning is not empty. The policy sampled one every turn (the generation prompt
        # leaves it open), so the stream is the template's exactly when every earlier reply
        # keeps its block.
        context = msgs[:end]
        last_user = max(i for i, m in enumerate(context) if m["role"] == "user")
        kept = all(
            i > last_user and bool(m.get("reasoning_content"))
            for i, m in enumerate(context)
            if m["role"] == "assistant"
        )
        assert same == kept, (end, context)


@pytest.mark.parametrize("name", TRL_TEMPLATES)
def test_trl_templates_keep_the_sampled_stream(name: str) -> None:
    tokenizer = trl_tokenizer(name)
    try:
        fmt = ChatFormat(tokenizer, tools=TOOLS, end_of_turn=END_OF_TURN.get(name))
    except ChatError as exc:
        pytest.fail(f"{name}: {exc}")

    @SETTINGS
    @given(conversations(string_arguments=name in STRING_ARGUMENTS))
    def check(msgs: list[dict[str, Any]]) -> None:
        try:
            fmt.render_text(msgs, generation_prompt=False)
        except ChatError:
            return  # a conversation this template rejects (e.g. tool roles): see below
        run_conversation(fmt, msgs, TAIL_DIFFERENCE.get(name, ""))

    check()


@pytest.mark.parametrize("name", ["qwen3 (real)", *TRL_TEMPLATES])
def test_end_of_turn_text_in_a_tool_call_does_not_move_the_bridge(name: str) -> None:
    """A reply whose tool call's arguments (and name) hold the template's end-of-turn
    strings gets the bridge of the same reply without them: what the template writes after
    the reply's end-of-turn token, not the call's tail."""
    tokenizer = qwen3_tokenizer() if name == "qwen3 (real)" else trl_tokenizer(name)
    fmt = ChatFormat(tokenizer, tools=TOOLS, end_of_turn=END_OF_TURN.get(name))
    eot = "".join(fmt.end_of_turn)

    def reply(text: str) -> dict[str, Any]:
        args: Any = {"a": f"s.split({text!r})"}
        if name in STRING_ARGUMENTS:
            args = json.dumps(args)
        call = {"type": "function", "function": {"name": f"add{text}", "arguments": args}}
        return {"role": "assistant", "content": "ok", "tool_calls": [call]}

    after = [{"role": "tool", "content": "2"}]
    try:
        clean = fmt.bridge_text(reply(""), after)
    except ChatError:
        pytest.skip(f"{name} rejects a tool call followed by a tool result")
    assert fmt.bridge_text(reply(eot), after) == clean


def template_tokenizer(name: str, tiny_model: Any) -> Any:
    if name == "qwen3 (real)":
        return qwen3_tokenizer()
    if name == "tiny":
        return tiny_chat_tokenizer(tiny_model)
    return trl_tokenizer(name)


@pytest.mark.parametrize("name", ["qwen3 (real)", "tiny", *TRL_TEMPLATES])
def test_one_first_prompt_renderer_gives_the_template_s_own_ids(name: str, tiny_model: Any) -> None:
    """Dataset prompts (`PromptBuilder`) and chat episodes' and agents' first prompts
    (`ChatFormat.prompt_ids`) render through one function, and its ids are exactly
    `apply_chat_template(..., add_generation_prompt=True)`'s, with and without tools, for
    every first prompt of random conversations (each context before an assistant turn)."""
    tokenizer = template_tokenizer(name, tiny_model)
    fmt = ChatFormat(tokenizer, tools=TOOLS, end_of_turn=END_OF_TURN.get(name))
    bare = ChatFormat(tokenizer, end_of_turn=END_OF_TURN.get(name))
    builder = PromptBuilder(tokenizer)

    @settings(SETTINGS, max_examples=10)
    @given(conversations(string_arguments=name in STRING_ARGUMENTS))
    def check(msgs: list[dict[str, Any]]) -> None:
        cuts = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        for context in (msgs[:cut] for cut in cuts):
            for chat, tools in ((fmt, TOOLS), (bare, None)):
                try:
                    expected = tokenizer.apply_chat_template(
                        context, tools=tools, add_generation_prompt=True, return_dict=False
                    )
                except Exception:  # a context this template rejects: all three refuse it
                    with pytest.raises(ChatError, match="chat template rejected"):
                        chat.prompt_ids(context)
                    with pytest.raises(PromptError, match="row 0 'messages': the chat template"):
                        builder.build({"messages": context, "tools": tools})
                    continue
                assert chat.prompt_ids(context) == expected
                row = {"messages": context, "tools": tools}
                assert builder.build(row).tokens.tolist() == expected

    check()
