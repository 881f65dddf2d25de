"""Where prompts come from: one source or a weighted mix of tasks, with a resumable cursor.

A checkpoint stores how many prompts each task has given (its cursor), which tasks were found
used up, the mix's random state and the prompts waiting to be drawn again; on resume the same
sources are skipped forward by the cursor. That is exact as long as a source yields the same
prompts in the same order each time it is iterated (a list, a file, a seeded generator
factory).

The prompts waiting to be drawn again are stored encoded (`encode_prompt`, through
`codec.encode_value`), so that their metadata may hold what a group's may: numpy arrays and
scalars, torch tensors. They come back with arrays as numpy arrays and tuples as lists.
"""

from __future__ import annotations

import enum
import random
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec
import numpy as np

from asyncroll.codec import CodecError, decode_value, encode_value
from asyncroll.types import Prompt

PromptLike = Prompt | Mapping[str, Any] | Iterable[int]
PromptSource = Iterable[PromptLike] | AsyncIterable[PromptLike]


class _End(enum.Enum):
    """The end of a source. Not None: a source may yield None (a hole in a dataset), which is a
    bad prompt to fail and count, not a reason to drop every prompt after it."""

    END = enum.auto()


class CursorState(msgspec.Struct, frozen=True, kw_only=True):
    """The resumable position of a `PromptStream` (part of a producer checkpoint)."""

    drawn: dict[str, int]  # prompts drawn so far, per task
    rng_state: list[Any] | None  # the task mix's random state
    requeued: list[bytes]  # prompts to draw again before any new one, as `encode_prompt` bytes
    # Tasks found used up. Finding it costs the mix a draw, so a resumed mix must not find it
    # again: every choice after that extra draw would differ from the run's.
    exhausted: list[str] = []


_PROMPT_FIELDS = frozenset(Prompt.__struct_fields__)


@runtime_checkable
class SkipsAhead(Protocol):
    """A source that can start at an index without producing the items before it (a source
    whose items cost work, as `chat_prompts` renders each row): a resumed producer skips the
    checkpoint's drawn prompts through it instead of building every one again."""

    def from_index(self, start: int) -> tuple[int, Iterator[Any]]:
        """How many items were skipped (fewer than `start` when the source runs out first)
        and an iterator of the items from there on."""
        ...


def encode_prompt(prompt: Prompt) -> bytes:
    """A prompt as bytes for a checkpoint; `CodecError` naming the prompt if a field cannot be
    carried (see `codec.encode_value`)."""
    try:
        return encode_value({f: getattr(prompt, f) for f in Prompt.__struct_fields__})
    except CodecError as exc:
        raise CodecError(f"prompt {prompt.prompt_id!r} cannot be checkpointed: {exc}") from None


def decode_prompt(data: bytes) -> Prompt:
    """The prompt of `encode_prompt` bytes; `CodecError` if they are not one."""
    fields = decode_value(data)
    if not isinstance(fields, dict) or fields.keys() != _PROMPT_FIELDS:
        raise CodecError(f"not an encoded prompt: expected the fields {sorted(_PROMPT_FIELDS)}")
    if not isinstance(fields["task"], str) or not isinstance(fields["metadata"], dict):
        raise CodecError("not an encoded prompt: task must be a str and metadata a dict")
    if not isinstance(fields["prompt_id"], str | None):
        raise CodecError("not an encoded prompt: prompt_id must be a str or None")
    return Prompt(**fields)


def _requeued_prompts(state: CursorState) -> list[Prompt]:
    """The re-queued prompts of a cursor; `ValueError` naming the first that does not decode."""
    prompts = []
    for i, data in enumerate(state.requeued):
        try:
            prompts.append(decode_prompt(data))
        except CodecError as exc:
            raise ValueError(f"the checkpoint's re-queued prompt {i} is corrupt: {exc}") from None
    return prompts


def as_prompt(item: PromptLike | None, task: str, index: int, *, mixed: bool = False) -> Prompt:
    """Normalize a source item; the prompt id defaults to "<task>/<index in its source>".
    Anything that is not a `Prompt` or a mapping (None included) is taken as its tokens, checked
    when its group starts. `mixed`: the source is a `TaskMix`'s, whose name is the task of all
    it gives: a mapping without a task takes it, and a `Prompt` built for another task (chat
    prompts built without `task=`, say) is refused rather than counted under the wrong task.

    Two mistakes that would fail every prompt alike raise `ValueError` saying what to do (the
    producer stops with it): a mapping with keys that are not `Prompt` fields (chat rows not
    rendered by `chat_prompts`), and text (a str or bytes) where token ids belong."""
    if isinstance(item, Mapping):
        unknown = sorted(map(repr, set(item) - _PROMPT_FIELDS))
        if unknown:
            raise ValueError(
                f"prompt {index} of task {task!r} has keys {', '.join(unknown)} that a Prompt "
                f"does not take (its fields: {', '.join(Prompt.__struct_fields__)}): render "
                "chat rows with asyncroll.chat.chat_prompts(rows, tokenizer), and put other "
                "fields under metadata"
            )
        item = Prompt(**({"task": task} | dict(item) if mixed else item))
    if isinstance(item, str | bytes):
        raise ValueError(
            f"prompt {index} of task {task!r} is a {type(item).__name__}, not token ids: "
            "tokenize text first (tokenizer(text).input_ids), or build chat prompts with "
            "asyncroll.chat.chat_prompts(rows, tokenizer)"
        )
    if isinstance(item, Prompt):
        prompt = item
        if mixed and prompt.task != task:
            raise ValueError(
                f"TaskMix source {task!r} gave prompt {prompt.prompt_id!r} of task "
                f"{prompt.task!r}: build its prompts with task={task!r} (e.g. "
                f"chat_prompts(rows, tokenizer, task={task!r}))"
            )
    else:
        prompt = Prompt(tokens=item, task=task)
    if prompt.prompt_id is None:
        prompt = msgspec.structs.replace(prompt, prompt_id=f"{prompt.task}/{index}")
    return prompt


class _TaskSource:
    """One iterable, sync or async, with the count of items drawn from it."""

    def __init__(self, task: str, source: PromptSource, *, mixed: bool = False) -> None:
        self.task = task
        self.source = source
        self.mixed = mixed  # a TaskMix's source: every prompt it gives is of `task`
        self.drawn = 0
        self._skip = 0
        self._sync: Iterator[PromptLike] | None = None
        self._async: AsyncIterator[PromptLike] | None = None
        self.exhausted = False
        self.may_wait = isinstance(source, AsyncIterable)  # drawing awaits the source

    def seek(self, drawn: int, *, exhausted: bool = False) -> None:
        """Resume after `drawn` items (skipped before the next one is drawn). `exhausted`: the
        run found the source used up, so it leaves the mix at once (finding that again would
        cost the mix a draw the run did not make); `skip` still checks that it holds `drawn`."""
        if self._sync is not None or self._async is not None:
            raise RuntimeError("seek() after drawing has started")
        self.drawn = self._skip = drawn
        self.exhausted = exhausted

    @property
    def skipping(self) -> bool:
        """Items given before a checkpoint are still to be skipped."""
        return self._skip > 0

    async def skip(self) -> None:
        """Skip the items a resumed source gave before the checkpoint; `ValueError` if it runs
        out first (it is not the same source). A `SkipsAhead` source skips them without
        producing them."""
        fresh = self._sync is None and self._async is None
        if self._skip and fresh and isinstance(self.source, SkipsAhead):
            skipped, self._sync = self.source.from_index(self._skip)
            self._skip -= skipped
        while self._skip:
            if await self._next_raw() is _End.END:
                raise ValueError(
                    f"task {self.task!r} ran out {self._skip} prompts before the checkpoint's "
                    "cursor: resume with the same prompt source"
                )
            self._skip -= 1

    async def next(self) -> Prompt | None:
        await self.skip()
        item = _End.END if self.exhausted else await self._next_raw()
        if item is _End.END:
            self.exhausted = True
            return None
        prompt = as_prompt(item, self.task, self.drawn, mixed=self.mixed)
        self.drawn += 1
        return prompt

    async def _next_raw(self) -> PromptLike | Literal[_End.END] | None:
        """The source's next item as is (None included), or `_End.END`."""
        if self._sync is None and self._async is None:
            if isinstance(self.source, AsyncIterable):
                self._async = aiter(self.source)
            else:
                self._sync = iter(self.source)
        if self._async is not None:
            try:
                return await anext(self._async)
            except StopAsyncIteration:
                return _End.END
        assert self._sync is not None
        return next(self._sync, _End.END)


class TaskMix:
    """A weighted mix of prompt sources, one per task: each draw picks a task with probability
    proportional to its weight among the tasks not yet exhausted (seeded, resumable)."""

    def __init__(
        self,
        tasks: Mapping[str, PromptSource],
        weights: Mapping[str, float] | None = None,
        seed: int = 0,
    ) -> None:
        if not tasks:
            raise ValueError("TaskMix needs at least one task")
        if not all(isinstance(task, str) for task in tasks):
            raise ValueError(f"TaskMix task names must be str, got {sorted(map(repr, tasks))}")
        weights = dict(weights) if weights is not None else dict.fromkeys(tasks, 1.0)
        if set(weights) != set(tasks):
            raise ValueError(
                f"TaskMix weights name tasks {sorted(weights)} but the sources are {sorted(tasks)}"
            )
        if not all(w > 0 and np.isfinite(w) for w in weights.values()):
            raise ValueError(f"TaskMix weights must be finite and > 0, got {weights}")
        self.sources = {t: _TaskSource(t, s, mixed=True) for t, s in tasks.items()}
        self.weights = weights
        self.rng = random.Random(seed)


class PromptStream:
    """The producer's prompts: draws from a source or a `TaskMix`, re-queues, resumes."""

    def __init__(self, source: PromptSource | TaskMix) -> None:
        if isinstance(source, TaskMix):
            self._mix: TaskMix | None = source
            self._sources = source.sources
        else:
            self._mix = None
            self._sources = {"default": _TaskSource("default", source)}
        self._requeued: deque[Prompt] = deque()

    @property
    def exhausted(self) -> bool:
        """No prompt left to draw: every source ran dry and nothing is re-queued."""
        return not self._requeued and all(
            s.exhausted and not s.skipping for s in self._sources.values()
        )

    @property
    def may_wait(self) -> bool:
        """Whether the next draw may wait on a source (an async iterable): only such a draw
        needs a deadline; drawing from iterators never yields to the event loop."""
        return not self._requeued and any(
            s.may_wait for s in self._sources.values() if not s.exhausted or s.skipping
        )

    def requeue(self, prompt: Prompt) -> None:
        """Draw this prompt again (an expired group's prompt), before any new one."""
        self._requeued.append(prompt)

    def unread(self, prompt: Prompt) -> None:
        """Put back the prompt just drawn, to be drawn next."""
        self._requeued.appendleft(prompt)

    async def next(self) -> Prompt | None:
        """The next prompt, or None once every source is exhausted."""
        if self._requeued:
            return self._requeued.popleft()
        for source in self._sources.values():
            if source.exhausted:  # used up before a checkpoint: still the same source?
                await source.skip()
        while True:
            live = [s for s in self._sources.values() if not s.exhausted]
            if not live:
                return None
            if self._mix is None:
                source = live[0]
            else:
                weights = [self._mix.weights[s.task] for s in live]
                source = self._mix.rng.choices(live, weights)[0]
            prompt = await source.next()
            if prompt is not None:
                return prompt

    def state(self) -> CursorState:
        return CursorState(
            drawn={t: s.drawn for t, s in self._sources.items()},
            rng_state=_to_list(self._mix.rng.getstate()) if self._mix else None,
            requeued=[encode_prompt(p) for p in self._requeued],
            exhausted=[t for t, s in self._sources.items() if s.exhausted],
        )

    def check(self, state: CursorState) -> None:
        """Raise `ValueError` if `state` cannot be loaded into this stream."""
        self._checked(state)

    def _checked(self, state: CursorState) -> list[Prompt]:
        """`check`, returning the decoded re-queued prompts for `load`."""
        if set(state.drawn) != set(self._sources):
            raise ValueError(
                f"the checkpoint's tasks {sorted(state.drawn)} differ from this producer's "
                f"{sorted(self._sources)}: resume with the same prompt sources"
            )
        if (state.rng_state is None) != (self._mix is None):
            raise ValueError("the checkpoint and this producer differ in using a TaskMix")
        if not set(state.exhausted) <= set(self._sources):
            raise ValueError(f"the checkpoint's used-up tasks {state.exhausted} are not all tasks")
        return _requeued_prompts(state)

    def load(self, state: CursorState) -> None:
        """Continue from `state`; call before the first draw. All or nothing."""
        requeued = self._checked(state)
        for task, drawn in state.drawn.items():
            self._sources[task].seek(drawn, exhausted=task in state.exhausted)
        if self._mix is not None and state.rng_state is not None:
            self._mix.rng.setstate(_to_tuple(state.rng_state))
        self._requeued = deque(requeued)


def _to_list(value: Any) -> Any:
    return [_to_list(v) for v in value] if isinstance(value, tuple) else value


def _to_tuple(value: Any) -> Any:
    return tuple(_to_tuple(v) for v in value) if isinstance(value, list) else value
