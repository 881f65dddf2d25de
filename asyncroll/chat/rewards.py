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
Several functions (TRL's ``reward_funcs`` list, with ``weights``) share one decode and add up.
A function may be sync or async, and is called as the producer calls any reward: a sync one in
a reward worker thread with `reward_timeout_s` as its deadline, an async one on the event loop
within the same deadline; one that raises or passes the deadline fails its group with the
reason.

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
import pickle
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import anyio.to_thread

from asyncroll.types import RolloutGroup

TextRewardFn = Callable[..., Sequence[float] | Awaitable[Sequence[float]]]
"""A reward on text: keyword arguments as described in this module, one reward per sample."""

THREAD_MIN_TOKENS = 256
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
    """What text rewards are called with (the decode, then the keyword arguments), and how the
    rewards of several functions add up."""

    def __init__(
        self,
        fns: Sequence[TextRewardFn],
        weights: Sequence[float] | None,
        tokenizer: DecodeTokenizer,
        *,
        skip_special_tokens: bool,
        thread_min_tokens: int,
    ) -> None:
        if not callable(getattr(tokenizer, "batch_decode", None)):
            raise ValueError(
                f"text_reward needs a tokenizer with batch_decode, got {type(tokenizer).__name__}"
            )
        if thread_min_tokens < 0:
            raise ValueError(f"thread_min_tokens={thread_min_tokens}: must be >= 0")
        self.fns = [(fn, _accepted_names(fn)) for fn in fns]
        self.weights = None if weights is None else [float(w) for w in weights]
        self.names = [getattr(fn, "__qualname__", None) or type(fn).__qualname__ for fn in fns]
        self.tokenizer = tokenizer
        self.decode = batch_decoder(tokenizer, skip_special_tokens=skip_special_tokens)
        self.thread_min_tokens = thread_min_tokens
        self.__qualname__ = f"text_reward({', '.join(self.names)})"  # what reward errors name

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
        return kwargs

    @staticmethod
    def call(fn: TextRewardFn, takes: frozenset[str] | None, kwargs: dict[str, Any]) -> Any:
        if takes is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in takes}
        return fn(**kwargs)

    def combined(self, results: list[Any], n: int) -> Any:
        """The rewards of the functions' `results` (see `_combined`)."""
        return _combined(self.names, self.weights, results, n)


class _SyncTextReward(_TextCall):
    """Sync text rewards: the producer runs them (decode included) in a reward worker thread,
    or, with ``reward_executor="process"``, decodes in a thread and sends the text (never the
    tokenizer) to a worker process that calls the functions (`split_for_processes`)."""

    def __call__(self, group: RolloutGroup) -> Any:
        kwargs = self.arguments(group)
        results = [self.call(fn, takes, kwargs) for fn, takes in self.fns]
        if any(inspect.isawaitable(r) for r in results):  # a sync wrapper of an async judge
            return self._awaited(results, group.num_samples)
        return self.combined(results, group.num_samples)

    def split_for_processes(
        self,
    ) -> tuple[Callable[[RolloutGroup], dict[str, Any]], Callable[[dict[str, Any]], Any]]:
        """(the decode, run here; the functions on its keyword arguments, run in a worker).
        `ValueError` naming a function that cannot be pickled."""
        for fn, name in zip(self.fns, self.names, strict=True):
            try:
                pickle.dumps(fn[0])
            except Exception as exc:
                raise ValueError(
                    f"reward_executor='process' sends text_reward's function {name!r} (not the "
                    f"tokenizer: the text is decoded here) to worker processes, and it cannot "
                    f"be pickled ({type(exc).__name__}: {exc}): define it at module level, or "
                    "keep reward_executor='thread'"
                ) from None
        return self.arguments, _RemoteText(self.fns, self.weights, self.names)

    async def _awaited(self, results: list[Any], n: int) -> Any:
        for i, result in enumerate(results):
            while inspect.isawaitable(result):
                result = await result
            results[i] = result
        return self.combined(results, n)


class _RemoteText:
    """The text functions of a `_SyncTextReward` in a worker process: called on the keyword
    arguments decoded in the trainer's process, their rewards added up as there."""

    def __init__(
        self,
        fns: list[tuple[TextRewardFn, frozenset[str] | None]],
        weights: list[float] | None,
        names: list[str],
    ) -> None:
        self.fns = fns
        self.weights = weights
        self.names = names

    def __call__(self, kwargs: dict[str, Any]) -> Any:
        results = [_TextCall.call(fn, takes, kwargs) for fn, takes in self.fns]
        return _combined(self.names, self.weights, results, len(kwargs["completion_ids"]))


class _AsyncTextReward(_TextCall):
    """Async text rewards: awaited on the loop in order, large groups decoded in a thread."""

    async def __call__(self, group: RolloutGroup) -> Any:
        if group.num_tokens >= self.thread_min_tokens:
            kwargs = await anyio.to_thread.run_sync(self.arguments, group, abandon_on_cancel=True)
        else:
            kwargs = self.arguments(group)
        results = []
        for fn, takes in self.fns:
            result = self.call(fn, takes, kwargs)
            while inspect.isawaitable(result):
                result = await result
            results.append(result)
        return self.combined(results, group.num_samples)


def text_reward(
    fn: TextRewardFn | Sequence[TextRewardFn],
    tokenizer: DecodeTokenizer,
    *,
    weights: Sequence[float] | None = None,
    skip_special_tokens: bool = True,
    thread_min_tokens: int = THREAD_MIN_TOKENS,
) -> Callable[[RolloutGroup], Any]:
    """The producer's reward function (`RewardFn`) for a reward on text:
    ``Producer(engine, prompts, text_reward(fn, tokenizer))``. See the module docstring for
    what `fn` is called with.

    Several functions (TRL's ``reward_funcs=[...]``, ``reward_weights=[...]``) share one decode
    and give each sample the weighted sum of their rewards (`weights`: one per function, 1.0 by
    default). They must be all sync or all async, since one group's call runs either in a
    worker thread or on the loop."""
    fns = list(fn) if isinstance(fn, Sequence) else [fn]
    if not fns:
        raise ValueError("text_reward needs at least one reward function")
    for f in fns:
        if not callable(f):
            raise ValueError(f"text_reward needs callables, got {type(f).__name__}")
    if weights is not None and len(weights) != len(fns):
        raise ValueError(f"text_reward got {len(weights)} weights for {len(fns)} functions")
    kinds = {_is_async(f) for f in fns}
    if len(kinds) > 1:
        raise ValueError(
            "text_reward's functions must be all sync or all async: write the sync ones as "
            "async def (or the async ones as sync functions)"
        )
    cls = _AsyncTextReward if kinds == {True} else _SyncTextReward
    return cls(
        fns,
        weights,
        tokenizer,
        skip_special_tokens=skip_special_tokens,
        thread_min_tokens=thread_min_tokens,
    )


def _combined(names: list[str], weights: list[float] | None, results: list[Any], n: int) -> Any:
    """One function's result as it is (the producer checks it); several functions' as their
    weighted sum per sample, where a None (the function does not apply to that sample, as in
    TRL) adds nothing."""
    if len(results) == 1 and weights is None:
        return results[0]
    weights = weights or [1.0] * len(results)
    total = [0.0] * n
    scored = [False] * n
    for name, weight, values in zip(names, weights, results, strict=True):
        values = list(values)
        if len(values) != n:
            raise ValueError(f"reward function {name} returned {len(values)} rewards for {n}")
        for i, value in enumerate(values):
            if value is not None:
                total[i] += weight * float(value)
                scored[i] = True
    if not all(scored):
        raise ValueError(
            f"no reward function scored sample {scored.index(False)} (each returned None)"
        )
    return total


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
