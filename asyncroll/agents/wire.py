"""The OpenAI chat-completions wire format: a request checked into a `ChatCall`, a reply turned
into a completion or its stream chunks, and errors in OpenAI's shape.

Sampling fields are checked against the producer's `SamplingConfig` because the behaviour
logprobs the trainer corrects with must be those of the distribution that sampled: a field the
endpoint cannot honour exactly is refused (400), never silently ignored. Fields that change
nothing about sampling (`user`, `metadata`, `store`, ...) are accepted and ignored.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from asyncroll.chat.parse import Reply
from asyncroll.engines.base import SamplingConfig

__all__ = [
    "Answer", "ApiError", "ChatCall", "Known", "chunks", "completion", "known_message",
    "parse_call", "wire_message",
]  # fmt: skip

# Accepted and ignored: they describe the caller, not the sampling.
_IGNORED = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
        "safety_identifier",
    }
)
_HANDLED = frozenset(
    {
        "model", "messages", "tools", "tool_choice", "parallel_tool_calls", "stop", "max_tokens",
        "max_completion_tokens", "stream", "stream_options", "n", "temperature", "top_p", "top_k",
        "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
        "logit_bias", "logprobs", "top_logprobs", "response_format", "reasoning_effort",
        "verbosity",
    }
)  # fmt: skip


class ApiError(Exception):
    """A request the endpoint answers with an error in OpenAI's shape (the run goes on)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.kind = kind

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


class ChatCall(msgspec.Struct, frozen=True, kw_only=True):
    """A checked chat-completions request."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None
    max_tokens: int | None
    stop_ids: tuple[int, ...]
    stream: bool
    include_usage: bool
    logprobs: bool


def _refuse(field: str, value: Any, why: str) -> ApiError:
    return ApiError(400, f"{field}={value!r} is not supported here: {why}", param=field)


def _number(field: str, value: Any) -> None:
    """`value` must be absent or a JSON number: `true` would pass as 1 and `false` as 0
    (OpenAI refuses both where a number is expected)."""
    if value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
        return
    what = "a boolean" if isinstance(value, bool) else f"JSON {type(value).__name__}"
    raise ApiError(400, f"{field}={value!r}: give a number, not {what}", param=field)


def _same(field: str, value: Any, want: Any, *, unset: Any = None) -> None:
    """`value` must be absent or what the producer samples with."""
    _number(field, value)
    if value is None or value == want or (unset is not None and value == unset and want is None):
        return
    raise _refuse(
        field,
        value,
        f"the producer samples with {field}={want!r}, and the trained logprobs must be those "
        "of the distribution that sampled; leave it out or send the same value",
    )


def parse_call(
    raw: bytes, *, model: str, sampling: SamplingConfig, tokenizer: Any
) -> tuple[str, ChatCall]:
    """The request body checked: (model name asked for, the call), or `ApiError`."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body is a JSON {type(body).__name__}, not an object")
    unknown = sorted(k for k in body if k not in _HANDLED and k not in _IGNORED)
    if unknown:
        raise ApiError(
            400, f"unrecognized request argument(s): {', '.join(unknown)}", param=unknown[0]
        )
    asked = body.get("model")
    if asked != model:
        raise ApiError(
            404,
            f"the model {asked!r} does not exist here: this endpoint serves {model!r}",
            code="model_not_found",
            param="model",
        )
    _same("temperature", body.get("temperature"), sampling.temperature)
    _same("top_p", body.get("top_p"), sampling.top_p)
    _same("top_k", body.get("top_k"), sampling.top_k, unset=-1)
    _same("seed", body.get("seed"), sampling.seed)
    for field, neutral in (
        ("presence_penalty", 0),
        ("frequency_penalty", 0),
        ("repetition_penalty", 1),
        ("min_p", 0),
    ):
        _same(field, body.get(field), neutral)
    for field in ("n", "top_logprobs"):
        _number(field, body.get(field))
    if body.get("n") not in (None, 1):
        raise _refuse("n", body["n"], "each call is one turn of one episode: n=1")
    if body.get("logit_bias"):
        raise _refuse("logit_bias", body["logit_bias"], "it changes the sampling distribution")
    if body.get("top_logprobs") not in (None, 0):
        raise _refuse("top_logprobs", body["top_logprobs"], "only the sampled token's logprob")
    for field in ("reasoning_effort", "verbosity"):
        if body.get(field) is not None:
            raise _refuse(
                field,
                body[field],
                "the chat format's template_kwargs decide reasoning (e.g. enable_thinking)",
            )
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise _refuse("response_format", fmt, "constrained decoding is not offered")
    choice = body.get("tool_choice")
    if choice not in (None, "auto") and not (choice == "none" and not body.get("tools")):
        raise _refuse(
            "tool_choice", choice, "the policy decides whether to call a tool: use 'auto'"
        )
    if body.get("parallel_tool_calls") not in (None, True):
        raise _refuse(
            "parallel_tool_calls", body["parallel_tool_calls"], "the policy may call several"
        )
    return asked, ChatCall(
        messages=_messages(body.get("messages")),
        tools=_tools(body.get("tools")),
        max_tokens=_max_tokens(body),
        stop_ids=_stop_ids(body.get("stop"), tokenizer),
        stream=_flag(body, "stream"),
        include_usage=_include_usage(body.get("stream_options")),
        logprobs=_flag(body, "logprobs"),
    )


def _flag(body: Mapping[str, Any], field: str) -> bool:
    value = body.get(field)
    if value not in (None, True, False):
        raise ApiError(400, f"{field}={value!r}: give true or false", param=field)
    return bool(value)


def _include_usage(options: Any) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ApiError(400, f"stream_options={options!r}: give an object", param="stream_options")
    return bool(options.get("include_usage"))


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ApiError(400, f"max_tokens={value!r}: give an integer >= 1", param="max_tokens")
    return value


def _stop_ids(stop: Any, tokenizer: Any) -> tuple[int, ...]:
    """Stop strings that are one token each become stop token ids (exact: the turn ends at the
    sampled token). A longer string would end a turn inside a token: refused."""
    if stop is None:
        return ()
    strings = [stop] if isinstance(stop, str) else stop
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise ApiError(400, f"stop={stop!r}: give a string or a list of strings", param="stop")
    ids = []
    for text in strings:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) != 1:
            raise _refuse(
                "stop",
                text,
                f"it is {len(encoded)} tokens; a stop string must be one token, or the turn "
                "would end inside a sampled token",
            )
        ids.append(int(encoded[0]))
    return tuple(ids)


def _tools(tools: Any) -> tuple[dict[str, Any], ...] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
        for t in tools
    ):
        raise ApiError(400, "tools: give a list of {'type': 'function', ...}", param="tools")
    return tuple(tools)


def _messages(messages: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: give a non-empty list of messages", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] has no role", param=f"messages[{i}]")
        m = dict(m)
        m["content"] = _text(m.get("content"), i)
        if m.get("tool_calls") is not None:
            _check_tool_calls(m["tool_calls"], i)
        out.append(m)
    return tuple(out)


def _check_tool_calls(calls: Any, i: int) -> None:
    """A message's `tool_calls` as OpenAI defines them: a list of {"id": text, "type":
    "function", "function": {"name": text, "arguments": JSON text}} (arguments as an object
    taken too). Anything else is refused here, before it is compared or rendered."""
    field = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ApiError(400, f"{field}={calls!r}: give a list of tool calls", param=field)
    for j, call in enumerate(calls):
        at = f"{field}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise ApiError(
                400,
                f"{at}={call!r}: give {{'id': ..., 'type': 'function', 'function': "
                "{'name': ..., 'arguments': ...}}",
                param=at,
            )
        if not isinstance(call.get("id", ""), str) or call.get("type", "function") != "function":
            raise ApiError(400, f"{at}: 'id' must be text and 'type' must be 'function'", param=at)
        if not isinstance(fn.get("name"), str):
            raise ApiError(
                400, f"{at}.function.name={fn.get('name')!r}: give the tool's name", param=at
            )
        if not isinstance(fn.get("arguments"), str | dict):
            raise ApiError(
                400,
                f"{at}.function.arguments={fn.get('arguments')!r}: give the arguments as JSON text",
                param=at,
            )


def _text(content: Any, i: int) -> str:
    """A message's content as text (text parts joined); other parts are refused."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ApiError(
                    400,
                    f"messages[{i}] has a content part {part!r}: only text parts are supported",
                    param=f"messages[{i}].content",
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ApiError(400, f"messages[{i}].content={content!r}: give text", param="messages")


Known = tuple[Any, ...]
"""A message as compared with the episode's history (see `known_message`)."""


def known_message(m: Mapping[str, Any]) -> Known:
    """What must match for a message to be the one the episode holds: role, text, tool calls
    (id, name, arguments as JSON values), tool_call_id and name. Reasoning fields are left
    out: clients drop them, and the episode keeps the sampled reasoning either way."""
    calls = []
    for call in m.get("tool_calls") or ():
        fn = call.get("function") or {}
        args = fn.get("arguments")
        if isinstance(args, str):
            with contextlib.suppress(ValueError):
                args = json.loads(args)
        calls.append((call.get("id"), fn.get("name"), json.dumps(args, sort_keys=True)))
    return (m.get("role"), m.get("content") or "", tuple(calls), m.get("tool_call_id"))


# -- responses ------------------------------------------------------------------------------------


class Answer(msgspec.Struct, frozen=True, kw_only=True):
    """One turn as the endpoint answers it (kept for a client's retry of the same call)."""

    id: str
    created: int
    model: str
    message: dict[str, Any]
    finish_reason: str
    prompt_tokens: int
    ids: tuple[int, ...]
    logprobs: tuple[float, ...]


def wire_message(reply: Reply, turn: int) -> tuple[dict[str, Any], str]:
    """The reply as an OpenAI assistant message, and its finish reason. Tool calls that did
    not parse are left out (their text was sampled and is trained, but is no call)."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    calls = []
    for i, call in enumerate(c for c in reply.tool_calls if c.ok):
        args = call.arguments
        calls.append(
            {
                "id": call.id or f"call_{turn}_{i}",
                "type": "function",
                "function": {
                    "name": call.name,
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
        )
    if calls:
        message["tool_calls"] = calls
    finish = "length" if reply.truncated else ("tool_calls" if calls else "stop")
    return message, finish


def _usage(answer: Answer) -> dict[str, int]:
    n = len(answer.ids)
    return {
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": n,
        "total_tokens": answer.prompt_tokens + n,
    }


def _logprobs(answer: Answer, tokenizer: Any) -> dict[str, Any]:
    content = []
    for i, lp in zip(answer.ids, answer.logprobs, strict=True):
        text = str(tokenizer.decode([i], skip_special_tokens=False))
        content.append(
            {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
        )
    return {"content": content}


def completion(answer: Answer, *, logprobs: bool, tokenizer: Any) -> dict[str, Any]:
    """The non-streaming response."""
    return {
        "id": answer.id,
        "object": "chat.completion",
        "created": answer.created,
        "model": answer.model,
        "choices": [
            {
                "index": 0,
                "message": answer.message,
                "finish_reason": answer.finish_reason,
                "logprobs": _logprobs(answer, tokenizer) if logprobs else None,
            }
        ],
        "usage": _usage(answer),
    }


def chunks(
    answer: Answer, *, logprobs: bool, include_usage: bool, tokenizer: Any
) -> Sequence[dict[str, Any]]:
    """The streaming response's chunks (the turn is sampled whole, then sent as chunks)."""
    head = {
        "id": answer.id,
        "object": "chat.completion.chunk",
        "created": answer.created,
        "model": answer.model,
    }
    message = answer.message

    def chunk(delta: dict[str, Any], finish: str | None = None, lp: Any = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}
        return {**head, "choices": [choice]}

    out = [chunk({"role": "assistant", "content": ""})]
    if message.get("reasoning_content") is not None:
        out.append(chunk({"reasoning_content": message["reasoning_content"]}))
    lp = _logprobs(answer, tokenizer) if logprobs else None
    out.append(chunk({"content": message["content"]}, None, lp))
    calls = message.get("tool_calls") or []
    if calls:
        out.append(chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}))
    out.append(chunk({}, answer.finish_reason))
    if include_usage:
        out.append({**head, "choices": [], "usage": _usage(answer)})
    return out
