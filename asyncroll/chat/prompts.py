"""Prompts from a dataset of text or chat messages, through the model's tokenizer, rendered once.

A row is a mapping, as a Hugging Face dataset, a JSONL file or a list of dicts gives them:

* ``{"messages": [...], ...}`` or ``{"prompt": [...], ...}``: OpenAI-format chat messages (TRL's
  "conversational" rows use ``prompt``), optionally with ``tools``. They are rendered by the
  tokenizer's chat template with ``add_generation_prompt=True``: the ids are exactly what
  ``tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
  tokenize=True)`` returns (`asyncroll.chat.template.render_prompt_ids`, the one renderer of
  first prompts, which chat episodes and agents use too).
* ``{"prompt": "text", ...}``: plain text, encoded by ``tokenizer.encode`` (with the tokenizer's
  special tokens, a BOS say, unless ``add_special_tokens=False``).

The ids are computed here, once, and are the ids the engine samples from and the trainer trains
on: nothing downstream renders or tokenizes the prompt again. The whole row rides along as the
prompt's metadata (the messages or text included, which is what a text reward reads back), so
every field must be something a group can store (`asyncroll.codec.encode_value`); a field that
is not, a row the template rejects, a message of an unknown role, a row with neither field, or a
prompt that leaves the engine no room to generate raises `PromptError` naming the row and what
to change, before any work is spent on it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeGuard

import numpy as np

from asyncroll.chat.template import CHAT_ROLES, ChatError, render_prompt_ids
from asyncroll.codec import CodecError, encode_value
from asyncroll.types import Int32Array, Prompt

RESERVED_FIELDS = frozenset({"prompts", "completions", "completion_ids"})
"""Row fields a text reward passes under its own names, so a row may not hold them."""


class PromptError(ValueError):
    """A dataset row that cannot become a prompt; the message names the row and the field."""


class ChatTokenizer(Protocol):
    """What prompt building needs of a tokenizer: a transformers `PreTrainedTokenizerBase`
    (`AutoTokenizer.from_pretrained(...)`) has it."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: Any, **kwargs: Any) -> Any: ...


class PromptBuilder:
    """Turns dataset rows into `Prompt`s with one tokenizer and one set of options.

    `chat_template` overrides the tokenizer's own (e.g. `asyncroll.chat.TINY_CHAT_TEMPLATE`);
    `template_kwargs` go to the template as its variables (``{"enable_thinking": False}`` for
    Qwen3's); `max_model_len` (the engine's `max_model_len`) refuses a prompt that leaves no
    room to generate; `roles` are the message roles accepted (templates silently drop roles
    they do not know, so an unknown one is refused here).
    """

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        task: str = "default",
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        add_special_tokens: bool = True,
        max_model_len: int | None = None,
        roles: Iterable[str] = CHAT_ROLES,
    ) -> None:
        if not isinstance(task, str):
            raise ValueError(f"task must be a str, got {type(task).__name__}")
        if max_model_len is not None and max_model_len < 2:
            raise ValueError(f"max_model_len={max_model_len}: must be >= 2 (prompt + a token)")
        template_kwargs = dict(template_kwargs or {})
        clash = template_kwargs.keys() & _TEMPLATE_ARGS
        if clash:
            raise ValueError(
                f"template_kwargs may not set {sorted(clash)}: the builder sets them itself"
            )
        self.tokenizer = tokenizer
        self.task = task
        self.chat_template = chat_template
        self.template_kwargs = template_kwargs
        self.add_special_tokens = add_special_tokens
        self.max_model_len = max_model_len
        self.roles = frozenset(roles)

    def build(self, row: Mapping[str, Any], index: int = 0) -> Prompt:
        """The prompt of one row (`index`: its place in the dataset, named in errors and in the
        default prompt id "<task>/<index>"); `PromptError` if it cannot be one."""
        where = f"row {index}"
        if not isinstance(row, Mapping):
            raise PromptError(f"{where} is a {type(row).__name__}, not a mapping of fields")
        metadata = _metadata(row, where)
        if "messages" in row:
            tokens = self._render(row["messages"], row.get("tools"), f"{where} 'messages'")
        elif "prompt" in row and not isinstance(row["prompt"], str):
            tokens = self._render(row["prompt"], row.get("tools"), f"{where} 'prompt'")
        elif "prompt" in row:
            if row.get("tools") is not None:
                raise PromptError(
                    f"{where} has 'tools' but its 'prompt' is text: tools need chat messages"
                )
            tokens = self._encode(row["prompt"], where)
        else:
            raise PromptError(
                f"{where} has neither 'messages' nor 'prompt' (its fields: {sorted(row)}): "
                "rename the column that holds the chat messages or the text"
            )
        if self.max_model_len is not None and len(tokens) >= self.max_model_len:
            raise PromptError(
                f"{where}: its prompt is {len(tokens)} tokens, which leaves no room to generate "
                f"within max_model_len={self.max_model_len}: shorten or drop it"
            )
        return Prompt(
            tokens=tokens, task=self.task, prompt_id=f"{self.task}/{index}", metadata=metadata
        )

    def prompts(self, rows: Iterable[Mapping[str, Any]]) -> Iterable[Prompt]:
        """The rows' prompts, built lazily as the producer draws them. Iterating again iterates
        `rows` again, so a list or a dataset (not a one-shot generator) gives a source that a
        resumed producer can skip forward through exactly."""
        return _RowPrompts(self, rows)

    def _render(self, messages: Any, tools: Any, where: str) -> Int32Array:
        _check_messages(messages, self.roles, where)
        if tools is not None and (
            isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Sequence)
        ):
            raise PromptError(
                f"{where}: 'tools' must be a list of tools, got {type(tools).__name__}"
            )
        try:
            ids = render_prompt_ids(
                self.tokenizer,
                messages,
                tools=tools,
                chat_template=self.chat_template,
                template_kwargs=self.template_kwargs,
            )
        except ChatError as exc:  # the template's error, or a ValueError for no template
            raise PromptError(f"{where}: {exc}") from exc
        return _ids(ids, where)

    def _encode(self, text: str, where: str) -> Int32Array:
        return _ids(self.tokenizer.encode(text, add_special_tokens=self.add_special_tokens), where)


_TEMPLATE_ARGS = frozenset(
    {"tools", "chat_template", "add_generation_prompt", "tokenize", "return_dict"}
)


class _RowPrompts:
    """A re-iterable lazy view of rows as prompts."""

    def __init__(self, builder: PromptBuilder, rows: Iterable[Mapping[str, Any]]) -> None:
        self._builder = builder
        self._rows = rows

    def __iter__(self) -> Iterator[Prompt]:
        return self.from_index(0)[1]

    def from_index(self, start: int) -> tuple[int, Iterator[Prompt]]:
        """The prompts from row `start` on, without rendering the rows before it (a resumed
        producer skips its cursor so: `asyncroll.prompts.SkipsAhead`), and how many rows were
        skipped (fewer than `start` when the rows run out first). Rows that can be indexed (a
        list, a Hugging Face dataset) are not even read; others are read and dropped."""
        rows, build = self._rows, self._builder.build
        if start and _indexable(rows):
            count = len(rows)
            skipped = min(start, count)
            return skipped, (build(rows[i], i) for i in range(skipped, count))
        it = iter(rows)  # (from the start, iterating: a dataset's rows come faster that way)
        skipped = sum(1 for _ in itertools.islice(it, start))
        return skipped, (build(row, i) for i, row in enumerate(it, skipped))


def _indexable(rows: Any) -> TypeGuard[Sequence[Mapping[str, Any]]]:
    """Rows to index by position: a sequence, or what behaves as one (a `datasets.Dataset`)."""
    if isinstance(rows, Sequence):
        return not isinstance(rows, str | bytes)
    return (
        hasattr(rows, "__len__") and hasattr(rows, "__getitem__") and not isinstance(rows, Mapping)
    )


def chat_prompts(
    rows: Iterable[Mapping[str, Any]],
    tokenizer: ChatTokenizer,
    *,
    task: str = "default",
    chat_template: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    add_special_tokens: bool = True,
    max_model_len: int | None = None,
    roles: Iterable[str] = CHAT_ROLES,
) -> Iterable[Prompt]:
    """The prompts of a dataset of chat messages or text, built lazily:
    ``Producer(engine, chat_prompts(rows, tokenizer), ...)``. The same as
    ``PromptBuilder(tokenizer, ...).prompts(rows)``; see `PromptBuilder` for the options."""
    builder = PromptBuilder(
        tokenizer,
        task=task,
        chat_template=chat_template,
        template_kwargs=template_kwargs,
        add_special_tokens=add_special_tokens,
        max_model_len=max_model_len,
        roles=roles,
    )
    return builder.prompts(rows)


def _check_messages(messages: Any, roles: frozenset[str], where: str) -> None:
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
        raise PromptError(f"{where} must be a list of messages, got {type(messages).__name__}")
    if not messages:
        raise PromptError(f"{where} is an empty list of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise PromptError(
                f"{where}: message {i} is a {type(message).__name__}, not a mapping with "
                "'role' and 'content'"
            )
        role = message.get("role")
        if role not in roles:
            raise PromptError(
                f"{where}: message {i} has role {role!r}; the known roles are {sorted(roles)}"
            )


def _ids(ids: Any, where: str) -> Int32Array:
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
        raise PromptError(f"{where}: the tokenizer gave no token ids (got {arr.shape} {arr.dtype})")
    out: Int32Array = arr.astype(np.int32)
    out.flags.writeable = False
    return out


def _metadata(row: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The row as metadata, each field checked as a group will store it."""
    metadata = dict(row)
    for key, value in metadata.items():
        if not isinstance(key, str):
            raise PromptError(f"{where}: field names must be str, got {key!r}")
        if key in RESERVED_FIELDS:
            raise PromptError(
                f"{where}: field {key!r} is one a text reward passes itself "
                f"({sorted(RESERVED_FIELDS)}): rename it"
            )
        try:
            encode_value(value)
        except CodecError as exc:
            raise PromptError(
                f"{where}: field {key!r} cannot ride along as metadata: {exc}"
            ) from None
    return metadata
