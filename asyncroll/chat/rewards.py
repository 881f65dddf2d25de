"""Rewards on decoded text, written as TRL's `reward_funcs` are: `text_reward` adapts one to the
producer's `RewardFn` (which is called with a `RolloutGroup` of token ids).

The function is called once per group, with keyword arguments holding one entry per sample, in
sample order (TRL's convention, so a TRL reward function works unchanged)::

    def reward(completions, answer, **kwargs) -> list[float]: ...
    async def judge(prompts, completions, **kwargs) -> list[float]: ...

* ``completions``: each sample's tokens decoded with ``skip_special_tokens=True`` (as TRL
  decodes them: the end-of-turn token and other special tokens are gone). For a chat prompt
  each entry is ``[{"role": "assistant", "content": text}]``, for a text prompt the text.
* ``prompts``: the prompt as the dataset gave it (its messages, or its text), from the group's
  metadata (see `asyncroll.chat.prompts`); a group built from token ids alone gets its ids
  decoded, special tokens kept.
* ``completion_ids``: each sample's token ids, as lists.
* every other metadata field (``answer``, ``tools``...) under its own name.

A function that takes ``**kwargs`` gets them all; one that does not gets only those it names.
It may be sync or async, and is called as the producer calls any reward: a sync one in a reward
worker thread with `reward_timeout_s` as its deadline, an async one on the event loop within
the same deadline; one that raises or passes the deadline fails its group with the reason.

Decoding stays off the event loop: a sync function's group is decoded in its worker thread
(with ``reward_in_thread=False`` both run on the loop); an async function's group is decoded in
a worker thread once it holds `thread_min_tokens` tokens or more, below which a thread hop would
cost the loop more than the decode. A thread is only off the loop if it lets go of the GIL:
transformers' `batch_decode` holds it throughout, so where it computes exactly that, the Rust
tokenizer's `decode_batch` is called instead (`batch_decoder`; `benchmarks/text_reward.py`
measures both).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import anyio.to_thread

from asyncroll.types import RolloutGroup

TextRewardFn = Callable[..., Sequence[float] | Awaitable[Sequence[float]]]
"""A reward on text: keyword arguments as described in this module, one reward per sample."""

THREAD_MIN_TOKENS = 4096
"""Below this many tokens in a group, an async text reward decodes on the event loop."""


class DecodeTokenizer(Protocol):
    """What text rewards need of a tokenizer: transformers tokenizers have it."""

    def batch_decode(self, sequences: Any, **kwargs: Any) -> Any: ...


Decoder = Callable[[list[list[int]]], list[str]]
"""Token id lists to texts, one per list."""

# Where transformers defines the decode path of its Rust-backed ("fast") tokenizers: version 5's
# TokenizersBackend and version 4's PreTrainedTokenizerFast, under PreTrainedTokenizerBase.
_TRANSFORMERS_DECODE = frozenset(
    {
        "transformers.tokenization_utils_base",
        "transformers.tokenization_utils_tokenizers",
        "transformers.tokenization_utils_fast",
    }
)


def batch_decoder(tokenizer: DecodeTokenizer, *, skip_special_tokens: bool = True) -> Decoder:
    """How a group's samples are decoded: `tokenizer.batch_decode(ids, skip_special_tokens=...)`,
    or, where that is exactly what it computes, the Rust tokenizer's own `decode_batch`.

    transformers decodes a batch one sequence at a time in Python, each through the Rust
    tokenizer's `decode` (which holds the GIL), then cleans up spaces if the tokenizer asks for
    it. `tokenizers.Tokenizer.decode_batch` runs the same `decode` on each sequence with the GIL
    released, so a decode in a worker thread no longer stalls the event loop (measured in
    `benchmarks/text_reward.py`). It is taken only for a tokenizer whose decode path is
    transformers' own, unchanged by its class, and that does not clean up spaces; any other
    tokenizer is called through `batch_decode` as it is."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    cls = type(tokenizer)
    if (
        callable(getattr(backend, "decode_batch", None))
        and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
        and all(
            getattr(getattr(cls, name, None), "__module__", None) in _TRANSFORMERS_DECODE
            for name in ("batch_decode", "decode", "_decode")
        )
    ):
        fast: Any = backend

        def decode(ids: list[list[int]]) -> list[str]:
            return list(fast.decode_batch(ids, skip_special_tokens=skip_special_tokens))

        return decode

    def decode_slow(ids: list[list[int]]) -> list[str]:
        return list(tokenizer.batch_decode(ids, skip_special_tokens=skip_special_tokens))

    return decode_slow


def decode_completions(
    group: RolloutGroup, tokenizer: DecodeTokenizer, *, skip_special_tokens: bool = True
) -> list[str]:
    """Each sample's tokens as text, in sample order, decoded as TRL decodes completions (see
    `batch_decoder`)."""
    decode = batch_decoder(tokenizer, skip_special_tokens=skip_special_tokens)
    return decode([s.tokens.tolist() for s in group.samples])


class _TextCall:
    """What a text reward is called with: the decode, then the keyword arguments."""

    def __init__(
        self,
        fn: TextRewardFn,
        tokenizer: DecodeTokenizer,
        *,
        skip_special_tokens: bool,
        thread_min_tokens: int,
    ) -> None:
        if not callable(fn):
            raise ValueError(f"text_reward needs a callable, got {type(fn).__name__}")
        if not callable(getattr(tokenizer, "batch_decode", None)):
            raise ValueError(
                f"text_reward needs a tokenizer with batch_decode, got {type(tokenizer).__name__}"
            )
        if thread_min_tokens < 0:
            raise ValueError(f"thread_min_tokens={thread_min_tokens}: must be >= 0")
        self.fn = fn
        self.tokenizer = tokenizer
        self.decode = batch_decoder(tokenizer, skip_special_tokens=skip_special_tokens)
        self.thread_min_tokens = thread_min_tokens
        self.takes = _accepted_names(fn)
        name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
        self.__qualname__ = f"text_reward({name})"  # what reward errors name

    def arguments(self, group: RolloutGroup) -> dict[str, Any]:
        """The keyword arguments for `group`: its samples decoded, its prompt and metadata."""
        ids = [s.tokens.tolist() for s in group.samples]
        texts = self.decode(ids)
        metadata, n = group.metadata, len(ids)
        prompt_field = "messages" if "messages" in metadata else "prompt"
        if prompt_field in metadata:
            prompt = metadata[prompt_field]
        else:  # a group of token ids alone: its prompt as text, special tokens kept
            prompt = self.tokenizer.batch_decode([group.prompt_tokens.tolist()])[0]
        kwargs: dict[str, Any] = {
            "prompts": [prompt] * n,
            "completions": (
                texts
                if isinstance(prompt, str)
                else [[{"role": "assistant", "content": t}] for t in texts]
            ),
            "completion_ids": ids,
        }
        for key, value in metadata.items():
            if key != prompt_field and key not in kwargs:
                kwargs[key] = [value] * n
        if self.takes is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in self.takes}
        return kwargs


class _SyncTextReward(_TextCall):
    """A sync text reward: the producer runs it (decode included) in a reward worker thread."""

    def __call__(self, group: RolloutGroup) -> Any:
        return self.fn(**self.arguments(group))


class _AsyncTextReward(_TextCall):
    """An async text reward: awaited on the loop, its large groups decoded in a thread."""

    async def __call__(self, group: RolloutGroup) -> Any:
        if group.num_tokens >= self.thread_min_tokens:
            kwargs = await anyio.to_thread.run_sync(self.arguments, group, abandon_on_cancel=True)
        else:
            kwargs = self.arguments(group)
        result = self.fn(**kwargs)
        while inspect.isawaitable(result):
            result = await result
        return result


def text_reward(
    fn: TextRewardFn,
    tokenizer: DecodeTokenizer,
    *,
    skip_special_tokens: bool = True,
    thread_min_tokens: int = THREAD_MIN_TOKENS,
) -> Callable[[RolloutGroup], Any]:
    """The producer's reward function (`RewardFn`) for a reward on text:
    ``Producer(engine, prompts, text_reward(fn, tokenizer))``. See the module docstring for
    what `fn` is called with."""
    cls = _AsyncTextReward if _is_async(fn) else _SyncTextReward
    return cls(
        fn, tokenizer, skip_special_tokens=skip_special_tokens, thread_min_tokens=thread_min_tokens
    )


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004
    )


def _accepted_names(fn: Callable[..., Any]) -> frozenset[str] | None:
    """The keyword names `fn` takes, or None if it takes any (``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: give it everything
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    )
