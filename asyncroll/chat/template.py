"""A chat template as token ids: the first prompt, and the tokens that new messages add after
a reply the policy sampled, without re-rendering anything the policy sampled.

The first prompt has one renderer, `render_prompt_ids`, used by dataset prompts
(`asyncroll.chat.prompts`) and by chat episodes and agents (`ChatFormat.prompt_ids`): an
agent's first call is checked against the prompt the dataset gave, so the two must never
render differently.

Why not render the whole conversation each turn: a chat template maps messages to text, and
text back to ids is not the ids the policy sampled. Re-rendering history changes what the
policy saw (Qwen3 drops earlier turns' `<think>` reasoning once a new user message arrives;
gpt-oss writes `<|end|>` where the model sampled `<|return|>`; a byte-level BPE re-encodes a
sampled non-canonical split differently), so the logprobs the trainer corrects with would
belong to other tokens. Instead the sampled ids stay as they are, and only the new messages
are rendered.

How the new messages' tokens are found (`ChatFormat.bridge`): render a stand-in context that
ends with the assistant's reply (its content replaced by a sentinel, its reasoning left out:
nothing after the reply's end may depend on them; its tool calls kept, with any end-of-turn
string taken out of their text, so that a call whose arguments hold "<|im_end|>" is not taken
for the reply's end) and the new messages, with the generation prompt. Everything after the
reply's end-of-turn string is the bridge: the separators the model never samples (Qwen's "\\n"
after `<|im_end|>`), the new messages, the next assistant header. Its text starts right after
a special token, so encoding it alone gives the ids a full render would give there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "CHAT_ROLES",
    "ChatError",
    "ChatFormat",
    "ContextLengthError",
    "Message",
    "render_prompt_ids",
]

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
"""The roles of OpenAI-format messages that chat templates render, for prompts and episodes
alike. Not "developer": Qwen3's template drops such a message without a word."""

Message = Mapping[str, Any]
"""An OpenAI-format chat message: `role`, `content`, optionally `reasoning_content`,
`tool_calls` (assistant) and `tool_call_id` / `name` (tool)."""

_SENTINEL = "ASYNCROLL_REPLY_SENTINEL"
_CUT_MARGIN = 256
"""Ids a prefix of a text may hold beyond the whole text's first ids: where the prefix ends,
a word or a special token's text cut in two encodes to more ids than it does whole."""
_CHARS_PER_ID = 8  # the first prefix checked: this many characters per id of the limit


class ChatError(ValueError):
    """A message list the chat layer cannot turn into tokens (unknown role, a template that
    raises, a bridge that is not where the template says), or a call out of order."""


class ContextLengthError(ChatError):
    """What a call would append holds more ids than the limit it was given
    (`ChatEpisode.continuation(..., max_ids=...)`)."""


class ChatFormat:
    """One tokenizer's chat template, for chat episodes.

    `tokenizer` is a Hugging Face tokenizer with a chat template. `end_of_turn` are the strings
    that end an assistant turn (the stop tokens to sample with); by default the tokenizer's
    EOS token and any special token the template writes right after an assistant's content.
    `tools` (OpenAI function specs) and `template_kwargs` (e.g. `enable_thinking`) are passed
    to every render."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        end_of_turn: Sequence[str] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ChatError("the tokenizer has no chat_template: set tokenizer.chat_template")
        self.tokenizer = tokenizer
        self.tools = [dict(t) for t in tools] if tools else None
        self.template_kwargs = dict(template_kwargs or {})
        self.end_of_turn = tuple(end_of_turn) if end_of_turn else self._detect_end_of_turn()
        ids = []
        for text in self.end_of_turn:
            encoded = tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) != 1:
                raise ChatError(
                    f"end_of_turn {text!r} is {len(encoded)} tokens, not one: give the special "
                    "tokens that end an assistant turn"
                )
            ids.append(int(encoded[0]))
        self.stop_token_ids: tuple[int, ...] = tuple(ids)
        """Sample with these as stop tokens: each turn ends at one of them."""

    def render_text(self, messages: Sequence[Message], *, generation_prompt: bool) -> str:
        """The template's text for `messages`; `ChatError` if a role is unknown or the
        template rejects the list."""
        check_roles(messages)
        try:
            text = self.tokenizer.apply_chat_template(
                [dict(m) for m in messages],
                tools=self.tools,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                **self.template_kwargs,
            )
        except Exception as exc:  # jinja's raise_exception, TemplateError, a KeyError inside
            raise ChatError(
                f"the chat template rejected the messages: {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(text, str):
            raise ChatError(f"the chat template gave {type(text).__name__}, not text")
        return text

    def encode(self, text: str) -> list[int]:
        """Ids of rendered text (special tokens in it are matched, none are added)."""
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

    def more_ids_than(self, text: str, limit: int) -> bool:
        """True when `encode(text)` certainly holds more than `limit` ids, found by encoding
        ever longer prefixes of `text` (never the whole): a text far over the limit costs
        an encoding of a few times the limit, not of the text (4 MiB of tool output against
        a 4,096-token budget: seconds otherwise). False says nothing: encode it.

        A prefix's ids are the whole text's first ids except at the cut (before a space where
        there is one), so a prefix holding more than `limit` + 256 ids means the text does;
        the margin covers a cut word or special token."""
        size = _CHARS_PER_ID * (limit + _CUT_MARGIN)
        while size < len(text):
            space = text.rfind(" ", size // 2, size)
            cut = space if space > 0 and not text[space - 1].isspace() else size
            if len(self.encode(text[:cut])) > limit + _CUT_MARGIN:
                return True
            size *= 4
        return False

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The first prompt: `messages` rendered with the generation prompt
        (`render_prompt_ids`, with this format's tools and template variables)."""
        check_roles(messages)
        return render_prompt_ids(
            self.tokenizer, messages, tools=self.tools, template_kwargs=self.template_kwargs
        )

    def bridge_text(self, reply: Message, new_messages: Sequence[Message]) -> str:
        """What the template writes after `reply`'s end-of-turn string when `new_messages`
        (user, tool or system messages) follow it, up to the next assistant turn's start."""
        return self.after_reply(reply, new_messages)[1]

    def after_reply(self, reply: Message, new_messages: Sequence[Message]) -> tuple[str, str]:
        """(the end-of-turn string the template writes after `reply` when `new_messages`
        follow it, `bridge_text`)."""
        check_roles(new_messages)
        if not new_messages:
            raise ChatError("no new messages: add at least one before the next reply")
        for m in new_messages:
            if m["role"] == "assistant":
                raise ChatError(
                    "an assistant message among the new messages: the policy's turns are "
                    "sampled (reply()), never rendered into the stream"
                )
        # The reply's other fields (its tool calls) stay, since a template may render what
        # follows from them (a tool result's header from its call's name), but with the
        # end-of-turn strings taken out of their text: a call whose arguments hold
        # "<|im_end|>" (sampled as ordinary tokens, or as a JSON escape that tojson undoes)
        # would otherwise be taken for the reply's end, and its tail become the bridge.
        scrub = (*self.end_of_turn, _SENTINEL)
        stand_in = {
            k: _without(v, scrub)
            for k, v in reply.items()
            if k not in ("reasoning_content", "reasoning")
        }
        stand_in["role"] = "assistant"
        stand_in["content"] = _SENTINEL
        base: list[Message] = [{"role": "user", "content": "."}]
        before = self.render_text(base, generation_prompt=True)
        after = self.render_text([*base, stand_in, *new_messages], generation_prompt=True)
        # The reply's end: after its content where the template writes it (some drop the
        # content of a turn with tool calls: then after where the two renders part; DeepSeek's
        # generation prompt opens a `<think>` that history closes at once, so they part
        # inside the generation prompt, not after it).
        parted = len(os.path.commonprefix([before, after]))  # noqa: RUF071 (text, not paths)
        at = after.find(_SENTINEL, parted)
        rest = after[at + len(_SENTINEL) :] if at >= 0 else after[parted:]
        ends = [(i, s) for s in self.end_of_turn if (i := rest.find(s)) >= 0]
        if not ends:
            raise ChatError(
                f"the chat template writes none of end_of_turn={list(self.end_of_turn)} after "
                "an assistant turn followed by these messages: give end_of_turn"
            )
        i, end = min(ends)
        return end, rest[i + len(end) :]

    def bridge(self, reply: Message, new_messages: Sequence[Message]) -> list[int]:
        """Ids of `bridge_text`: appended after the sampled end-of-turn token, untrained."""
        return self.encode(self.bridge_text(reply, new_messages))

    def _detect_end_of_turn(self) -> tuple[str, ...]:
        """The special token right after an assistant's content, and the EOS token."""
        found: list[str] = []
        convo: list[Message] = [
            {"role": "user", "content": "."},
            {"role": "assistant", "content": _SENTINEL},
        ]
        try:
            text = self.render_text(convo, generation_prompt=False)
        except ChatError:
            text = ""
        tail = text[text.find(_SENTINEL) + len(_SENTINEL) :] if _SENTINEL in text else ""
        specials = sorted(self.tokenizer.all_special_tokens + _added(self.tokenizer), key=len)
        for token in reversed(specials):  # the longest special token at the tail's start
            if token and tail.lstrip(" \n").startswith(token):
                found.append(token)
                break
        eos = getattr(self.tokenizer, "eos_token", None)
        if isinstance(eos, str) and eos and eos not in found:
            found.append(eos)
        if not found:
            raise ChatError("cannot tell which token ends an assistant turn: give end_of_turn")
        return tuple(found)


def render_prompt_ids(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """A conversation's first prompt as ids: exactly what `tokenizer.apply_chat_template(
    messages, tools=tools, chat_template=chat_template, add_generation_prompt=True,
    tokenize=True, **template_kwargs)` returns.

    Why the template's own tokenization and not its text through `encode` (as the bridge is
    encoded): this is the definition users compare against, so nothing rests on the two
    agreeing. (They do agree on every template the conformance tests run: transformers encodes
    the rendered text without adding special tokens, as `ChatFormat.encode` does.)

    `ChatError` if there are no messages, the template rejects them, or the tokenizer gives
    no ids; the roles are the caller's to check (which it accepts differs)."""
    if not messages:
        raise ChatError("no messages: a prompt needs at least one")
    try:
        ids = tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=tools,
            chat_template=chat_template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            **dict(template_kwargs or {}),
        )
    except Exception as exc:  # jinja's raise_exception, TemplateError, a KeyError inside
        raise ChatError(
            f"the chat template rejected the messages: {type(exc).__name__}: {exc}"
        ) from exc
    if isinstance(ids, Mapping):  # a tokenizer that ignores return_dict=False
        ids = ids.get("input_ids")
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
        raise ChatError(f"the tokenizer gave no token ids (got {arr.shape} {arr.dtype})")
    return [int(i) for i in arr.tolist()]


def _without(value: Any, texts: Sequence[str]) -> Any:
    """`value` (a message field: text, or JSON-like lists and mappings of it) with every
    occurrence of `texts` removed from its strings, keys included (until none is left: taking
    one out must not join the pieces of another)."""
    if isinstance(value, str):
        while any(t in value for t in texts):
            for t in texts:
                value = value.replace(t, "")
        return value
    if isinstance(value, Mapping):
        return {_without(k, texts): _without(v, texts) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_without(v, texts) for v in value]
    return value


def _added(tokenizer: Any) -> list[str]:
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return [str(t) for t in decoder.values() if getattr(t, "special", False)]


def check_roles(messages: Sequence[Message]) -> None:
    """`ChatError` for a message that is not a mapping with a known role."""
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m:
            raise ChatError(f"message {i} is {m!r}: give a mapping with 'role' and 'content'")
        if m["role"] not in CHAT_ROLES:
            raise ChatError(
                f"message {i} has role {m['role']!r}: use one of {', '.join(sorted(CHAT_ROLES))}"
            )
