"""A policy's reply as a chat message: content, reasoning and tool calls, parsed from the
sampled ids by a maintained parser (docs/chat-episodes.md says which and why).

`RenderersParser` wraps the `renderers` package's `parse_response`, whose parsers are written
per model family (Qwen3, Llama 3, DeepSeek V3/R1, GLM-4.5, gpt-oss, ...) and report each tool
call attempt with a status (ok, invalid JSON, unclosed block, ...), so a malformed call is
visible instead of silently dropped. `TextParser` is for templates without a parser: the whole
reply is content. Any object with the `ReplyParser` method works.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import msgspec

__all__ = ["RenderersParser", "Reply", "ReplyParser", "TextParser", "ToolCall", "ToolCallError"]


class ToolCallError(ValueError):
    """A reply's tool calls did not all parse (raised by `Reply.checked_tool_calls`)."""


class ToolCall(msgspec.Struct, frozen=True):
    """One tool call attempt. `status` is "ok" when it parsed; otherwise why not
    ("invalid_json", "unclosed_block", "missing_name", ...) and `raw` is what was sampled."""

    name: str | None
    arguments: dict[str, Any] | str | None
    raw: str
    status: str = "ok"
    id: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def message(self) -> dict[str, Any]:
        """As an OpenAI `tool_calls` entry."""
        call: dict[str, Any] = {
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if self.id is not None:
            call["id"] = self.id
        return call


class Reply(msgspec.Struct, frozen=True):
    """One policy turn as a chat message, with the exact ids it came from.

    `ids` are the sampled ids (the trained ones), `finish_reason` is "stop" (ended at an
    end-of-turn token, the last of `ids`) or "length" (cut by the token limit)."""

    content: str
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]
    ids: tuple[int, ...]
    finish_reason: str

    @property
    def truncated(self) -> bool:
        return self.finish_reason != "stop"

    def checked_tool_calls(self) -> tuple[ToolCall, ...]:
        """The tool calls, or `ToolCallError` naming each one that did not parse (and saying
        so when the reply was cut inside one by the length limit)."""
        bad = [(i, c) for i, c in enumerate(self.tool_calls) if not c.ok]
        if not bad:
            return self.tool_calls
        cut = " (the reply was cut by the length limit)" if self.truncated else ""
        parts = "; ".join(f"call {i}: {c.status}: {c.raw[:200]!r}" for i, c in bad)
        raise ToolCallError(f"{len(bad)} tool call(s) did not parse{cut}: {parts}")

    def message(self) -> dict[str, Any]:
        """As an OpenAI assistant message (tool calls that parsed only)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        calls = [c.message() for c in self.tool_calls if c.ok]
        if calls:
            out["tool_calls"] = calls
        return out


class ReplyParser(Protocol):
    """Parses a reply's sampled ids (the end-of-turn token included when it was sampled)."""

    def parse(self, ids: Sequence[int], *, prompt_ids: Sequence[int]) -> Reply: ...


class RenderersParser:
    """`renderers.create_renderer(tokenizer, config).parse_response`, as a `ReplyParser`.

    `config` is a renderers config (e.g. `renderers.Qwen3RendererConfig()`); None lets
    renderers pick one from the tokenizer's name. `tools` are the tool specs of the
    conversation (some formats read argument types from them)."""

    def __init__(
        self,
        tokenizer: Any,
        config: Any = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        import renderers  # a dev/chat dependency: imported only by those who parse with it

        self.renderer = renderers.create_renderer(tokenizer, config)
        self.tools = [dict(t) for t in tools] if tools else None
        self.stop_ids = frozenset(int(i) for i in self.renderer.get_stop_token_ids())

    def parse(self, ids: Sequence[int], *, prompt_ids: Sequence[int]) -> Reply:
        ids = [int(i) for i in ids]
        finish = "stop" if ids and ids[-1] in self.stop_ids else "length"
        parsed = self.renderer.parse_response(ids, tools=self.tools, prompt_ids=list(prompt_ids))
        calls = tuple(
            ToolCall(name=c.name, arguments=c.arguments, raw=c.raw, status=str(c.status), id=c.id)
            for c in parsed.tool_calls
        )
        return Reply(parsed.content, parsed.reasoning_content, calls, tuple(ids), finish)


class TextParser:
    """The reply's text (its stop token left out) as content: no reasoning, no tool calls.
    For chat templates without a structured parser."""

    def __init__(self, tokenizer: Any, stop_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.stop_ids = frozenset(int(i) for i in stop_token_ids)

    def parse(self, ids: Sequence[int], *, prompt_ids: Sequence[int]) -> Reply:
        ids = [int(i) for i in ids]
        stopped = bool(ids) and ids[-1] in self.stop_ids
        body = ids[:-1] if stopped else ids
        text = str(self.tokenizer.decode(body, skip_special_tokens=False))
        return Reply(text, None, (), tuple(ids), "stop" if stopped else "length")
