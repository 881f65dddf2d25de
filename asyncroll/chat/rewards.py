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
cost more than the decode (see `benchmarks/text_reward.py`).
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


def decode_completions(
    group: RolloutGroup, tokenizer: DecodeTokenizer, *, skip_special_tokens: bool = True
) -> list[str]:
    """Each sample's tokens as text, in sample order, decoded as TRL decodes completions."""
    texts = tokenizer.batch_decode(
        [s.tokens.tolist() for s in group.samples], skip_special_tokens=skip_special_tokens
    )
    return list(texts)


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
        self.skip_special_tokens = skip_special_tokens
        self.thread_min_tokens = thread_min_tokens
        self.takes = _accepted_names(fn)
        name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
        self.__qualname__ = f"text_reward({name})"  # what reward errors name

    def decoded(self, group: RolloutGroup) -> tuple[list[str], Any]:
        """The completions' texts and the prompt (as the dataset gave it, else decoded)."""
        texts = decode_completions(
            group, self.tokenizer, skip_special_tokens=self.skip_special_tokens
        )
        metadata = group.metadata
        if "messages" in metadata:
            prompt = metadata["messages"]
        elif "prompt" in metadata:
            prompt = metadata["prompt"]
        else:
            prompt = self.tokenizer.batch_decode([group.prompt_tokens.tolist()])[0]
        return texts, prompt

    def kwargs(self, group: RolloutGroup, texts: list[str], prompt: Any) -> dict[str, Any]:
        n = group.num_samples
        chat = not isinstance(prompt, str)
        kwargs: dict[str, Any] = {
            "prompts": [prompt] * n,
            "completions": [[{"role": "assistant", "content": t}] for t in texts]
            if chat
            else texts,
            "completion_ids": [s.tokens.tolist() for s in group.samples],
        }
        prompt_field = "messages" if "messages" in group.metadata else "prompt"
        for key, value in group.metadata.items():
            if key != prompt_field and key not in kwargs:
                kwargs[key] = [value] * n
        if self.takes is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in self.takes}
        return kwargs


class _SyncTextReward(_TextCall):
    """A sync text reward: the producer runs it (decode included) in a reward worker thread."""

    def __call__(self, group: RolloutGroup) -> Any:
        texts, prompt = self.decoded(group)
        return self.fn(**self.kwargs(group, texts, prompt))


class _AsyncTextReward(_TextCall):
    """An async text reward: awaited on the loop, its large groups decoded in a thread."""

    async def __call__(self, group: RolloutGroup) -> Any:
        if group.num_tokens >= self.thread_min_tokens:
            texts, prompt = await anyio.to_thread.run_sync(
                self.decoded, group, abandon_on_cancel=True
            )
        else:
            texts, prompt = self.decoded(group)
        result = self.fn(**self.kwargs(group, texts, prompt))
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
