"""Pure steps of one attempt at a group: check the prompt, build the engine request, check and
merge the engine's answer, check the rewards.

Each check raises `RolloutError` with a message a person can act on; the producer turns it into
a FAILED group. Nothing here awaits or keeps state, so each step is tested on its own.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import msgspec
import numpy as np

from asyncroll.engines.base import GenerateRequest, SampleOutput, SampleRequest, SamplingConfig
from asyncroll.types import (
    Float32Array,
    Int32Array,
    Prompt,
    RolloutGroup,
    RolloutState,
    Status,
    extended_state,
    sample_status,
    scored_state,
)

_LOGPROB_TOLERANCE = 1e-4  # float rounding can put log(1) a hair above 0
_INT32 = np.iinfo(np.int32)  # the dtype of token ids and versions


class RolloutError(ValueError):
    """Why one group failed (bad prompt, malformed engine output, bad rewards)."""


def prompt_array(tokens: Any, vocab_size: int, max_model_len: int | None) -> Int32Array:
    """The prompt as an int32 array, or `RolloutError` saying what is wrong with it."""
    if isinstance(tokens, str | bytes):
        raise RolloutError(
            f"prompt tokens are a {type(tokens).__name__}, not token ids: tokenize text first"
        )
    try:
        arr = np.asarray(tokens)
    except (ValueError, TypeError) as exc:
        raise RolloutError(f"prompt tokens are not an array of ids: {exc}") from None
    if arr.ndim != 1 or arr.size == 0:
        raise RolloutError(
            f"prompt must be a non-empty 1-D list of token ids, got shape {arr.shape}"
        )
    if arr.dtype.kind not in "iu":
        raise RolloutError(f"prompt token ids must be integers, got dtype {arr.dtype}")
    low, high = int(arr.min()), int(arr.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise RolloutError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
    if max_model_len is not None and arr.size >= max_model_len:
        raise RolloutError(
            f"prompt of {arr.size} tokens leaves no room to generate: max_model_len={max_model_len}"
        )
    return arr.astype(np.int32)


def check_prompt_fields(prompt: Prompt) -> None:
    """`RolloutError` unless the prompt's task, id and metadata have the types its group
    holds. `Prompt` does not check them (nor does a mapping a source yields), and the codec
    writes any msgpack type but reads a group back only with these: a group stored with an int
    `prompt_id` would fail only when handed out, taking its batch out of the ledger with it."""
    if not isinstance(prompt.task, str):
        raise RolloutError(f"its task must be a str, got {type(prompt.task).__name__}")
    if not isinstance(prompt.prompt_id, str | None):
        raise RolloutError(
            f"its prompt_id must be a str or None, got {type(prompt.prompt_id).__name__}"
        )
    metadata = prompt.metadata
    if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
        raise RolloutError("its metadata must be a dict with str keys")


def token_budget(group: RolloutGroup, sampling: SamplingConfig, max_model_len: int | None) -> int:
    """Response tokens a sample of this group may have in all (prompt + response must fit)."""
    if max_model_len is None:
        return sampling.max_new_tokens
    return min(sampling.max_new_tokens, max_model_len - len(group.prompt_tokens))


def budget_warning(sampling: SamplingConfig, max_model_len: int | None) -> str | None:
    """What to say when no sample can get `max_new_tokens` (a prompt takes at least one of the
    model's positions), or None: every budget is capped by `token_budget`, silently otherwise."""
    if max_model_len is None or sampling.max_new_tokens < max_model_len:
        return None
    return (
        f"max_new_tokens={sampling.max_new_tokens} does not fit the engine's max_model_len="
        f"{max_model_len}: every sample gets at most max_model_len minus its prompt's length; "
        "lower max_new_tokens or raise max_model_len"
    )


def fresh_samples(group_size: int) -> tuple[RolloutState, ...]:
    """`group_size` new PENDING samples, each an object of its own. Not one shared placeholder:
    a frozen struct's `extra` dict is still writable (a reward function may annotate it), and
    every state built from a sample shares its dict, so one placeholder would carry what was
    written on one sample to every sample of the run."""
    return tuple([RolloutState() for _ in range(group_size)])


def unfinished(group: RolloutGroup) -> list[int]:
    """Indices of the samples that still need tokens (everything not COMPLETED)."""
    return [i for i, s in enumerate(group.samples) if s.status is not Status.COMPLETED]


def build_request(
    group: RolloutGroup, request_id: str, sampling: SamplingConfig, budget: int
) -> GenerateRequest:
    """The engine request for the group's unfinished samples, each with what is left of
    `budget`. A sample with nothing left is a bug upstream (`Producer.load_state_dict` finishes
    those of a checkpoint resumed with a smaller budget): no engine is handed a budget below 1."""
    todo = unfinished(group)
    left = [budget - len(group.samples[i].tokens) for i in todo]
    if left and min(left) < 1:
        raise ValueError(f"a sample of group {group.uid} has no budget left ({budget} tokens)")
    samples = tuple(
        SampleRequest(group.samples[i].tokens, n) for i, n in zip(todo, left, strict=True)
    )
    return GenerateRequest(
        request_id=request_id, prompt_tokens=group.prompt_tokens, samples=samples, sampling=sampling
    )


def merge_outputs(
    group: RolloutGroup,
    request: GenerateRequest,
    outputs: Sequence[SampleOutput],
    *,
    vocab_size: int,
    version: int,
) -> tuple[RolloutState, ...]:
    """The group's samples after this attempt: each unfinished sample extended by its output.

    Checks what a buggy engine could get wrong: the number of outputs, array types and lengths,
    token ids outside the vocabulary, logprobs that are NaN, infinite or positive, versions that
    decrease or run ahead of `version`, more tokens than the budget, unknown finish reasons.

    The work is per group, not per sample: each field of the outputs is joined into one new
    array (the only copy, so nothing the engine returned stays referenced), every check is one
    vectorised reduction over the whole group, and each sample's new tokens are a view into
    the joined arrays. This is the boundary where engine output is validated.
    """
    todo = unfinished(group)
    if len(outputs) != len(todo):
        raise RolloutError(f"engine returned {len(outputs)} samples for {len(todo)} requested")
    if not todo:
        return group.samples
    for out in outputs:
        if not isinstance(out, SampleOutput):
            raise RolloutError(f"engine returned a {type(out).__name__}, not a SampleOutput")
    tokens, logprobs, versions, ends = _joined(outputs)
    _check_group(group, todo, request, tokens, logprobs, versions, ends, vocab_size, version)
    samples = list(group.samples)
    start = 0
    for idx, req, out, end in zip(todo, request.samples, outputs, ends, strict=True):
        chunk = (tokens[start:end], logprobs[start:end], versions[start:end])
        samples[idx] = _extended(samples[idx], req, out, *chunk)
        start = end
    return tuple(samples)


def _joined(
    outputs: Sequence[SampleOutput],
) -> tuple[Int32Array, Float32Array, Int32Array, list[int]]:
    """Each field of the outputs joined into one new 1-D array of its dtype, and where each
    output ends in them; `RolloutError` for arrays of the wrong rank, kind or length."""
    try:
        tokens = _join([out.tokens for out in outputs], np.int32, "i")
        logprobs = _join([out.logprobs for out in outputs], np.float32, "f")
        versions = _join([out.versions for out in outputs], np.int32, "i")
    except (TypeError, ValueError) as exc:
        raise RolloutError(str(exc)) from None
    lengths = [len(out.tokens) for out in outputs]  # each part is a 1-D sequence by now
    for out, n in zip(outputs, lengths, strict=True):
        if len(out.logprobs) != n or len(out.versions) != n:
            raise RolloutError(
                f"{n} tokens, {len(out.logprobs)} logprobs, {len(out.versions)} versions"
            )
    return tokens, logprobs, versions, list(itertools.accumulate(lengths))


def _join(parts: list[Any], dtype: type[np.generic], kind: str) -> Any:
    """`parts` joined into one new 1-D array of `dtype`: one `np.concatenate` when they are
    1-D arrays of that dtype (what engines return), else each converted as `_as` does."""
    try:
        joined = np.concatenate(parts)
    except (TypeError, ValueError):
        joined = None  # 0-d parts, mixed ranks, ragged lists: `_as` says which
    if joined is not None and joined.dtype == dtype and joined.ndim == 1:
        return joined
    return np.concatenate([_as(part, dtype, kind) for part in parts])


def _check_group(
    group: RolloutGroup,
    todo: list[int],
    request: GenerateRequest,
    tokens: Int32Array,
    logprobs: Float32Array,
    versions: Int32Array,
    ends: list[int],
    vocab_size: int,
    version: int,
) -> None:
    """The checks of `merge_outputs`, each over the whole group at once."""
    start = 0
    for req, end in zip(request.samples, ends, strict=True):
        if end - start > req.max_new_tokens:
            raise RolloutError(
                f"engine returned {end - start} tokens for a budget of {req.max_new_tokens}"
            )
        start = end
    if not len(tokens):
        return
    if int(tokens.view(np.uint32).max()) >= vocab_size:  # negative ids wrap to huge
        raise RolloutError(f"engine returned a token id outside the vocabulary [0, {vocab_size})")
    if not (logprobs.min() > -np.inf and logprobs.max() <= _LOGPROB_TOLERANCE):  # NaN: False
        raise RolloutError("engine returned a logprob that is NaN, infinite or positive")
    low, high = int(versions.min()), int(versions.max())
    # Non-decreasing first, so that each sample's ends bound its entries: a version that dips
    # or jumps mid-chunk would make the sample look fresher (or staler) than it is. All equal
    # (the common case) is non-decreasing.
    if low != high:
        drops = versions[1:] < versions[:-1]
        for end in ends[:-1]:  # a step from one sample to the next is not a decrease
            if 0 < end < len(versions):
                drops[end - 1] = False
        if bool(drops.any()):
            raise RolloutError("engine stamped versions that decrease within a sample")
    resumed = any(len(group.samples[idx].versions) for idx in todo)
    if low >= 0 and high <= version and not resumed:
        return  # every fresh sample lies within [0, version]
    start = 0
    for idx, end in zip(todo, ends, strict=True):
        prefix = group.samples[idx].versions
        previous = int(prefix[-1]) if len(prefix) else 0
        if end > start and (int(versions[start]) < previous or int(versions[end - 1]) > version):
            raise RolloutError(
                f"engine stamped versions {int(versions[start])}..{int(versions[end - 1])} "
                f"outside [{previous}, {version}]"
            )
        start = end


def _extended(
    sample: RolloutState,
    req: SampleRequest,
    out: SampleOutput,
    tokens: Int32Array,
    logprobs: Float32Array,
    versions: Int32Array,
) -> RolloutState:
    """`sample` extended by its checked new arrays, with the status its finish reason gives."""
    n = len(tokens)
    try:
        status = sample_status(out.finish_reason)
    except ValueError as exc:
        raise RolloutError(str(exc)) from None
    finish = out.finish_reason
    if status is Status.ABORTED and n == req.max_new_tokens:
        status, finish = Status.COMPLETED, "length"  # the abort landed on the last token
    experts = sample.routed_experts
    if experts is not None or out.routed_experts is not None:
        experts = _merged_experts(sample, out.routed_experts, n)
    if len(sample.tokens):
        tokens = np.concatenate([sample.tokens, tokens])
        logprobs = np.concatenate([sample.logprobs, logprobs])
        versions = np.concatenate([sample.versions, versions])
    return extended_state(sample, tokens, logprobs, versions, status, finish, experts)


def _merged_experts(sample: RolloutState, new: Any, n: int) -> Any:
    """Routed experts of the prefix and of the `n` new tokens, one row per token, or None.

    Both parts must carry them (or the part without any must have no token): experts for
    only some of a sample's tokens would misalign router replay silently.
    """
    old, prefix = sample.routed_experts, len(sample.tokens)
    if new is not None and len(new) != n:
        raise RolloutError(f"engine returned routed experts for {len(new)} of {n} tokens")
    if new is None or old is None:
        if (new is None and old is not None and n) or (old is None and new is not None and prefix):
            raise RolloutError("engine returned routed experts for only part of a sample")
        return old if new is None else new
    if old.shape[1:] != new.shape[1:] or old.dtype != new.dtype:
        raise RolloutError(
            f"routed experts change shape or dtype within a sample: {old.shape[1:]} {old.dtype} "
            f"then {new.shape[1:]} {new.dtype}"
        )
    return np.concatenate([old, new])


def _as(arr: Any, dtype: type[np.generic], kind: str) -> Any:
    """`arr` as a 1-D array of `dtype` without copying when it already is one."""
    if isinstance(arr, np.ndarray) and arr.dtype == dtype and arr.ndim == 1:
        return arr
    out = np.asarray(arr)
    if out.ndim != 1 or (out.size and out.dtype.kind not in (kind, "u" if kind == "i" else kind)):
        raise TypeError(f"expected a 1-D {np.dtype(dtype).name} array, got {out.dtype} {out.shape}")
    if not out.size:
        return np.zeros(0, dtype)
    if kind == "i":  # a cast would wrap an id past int32 around into the vocabulary
        low, high = int(out.min()), int(out.max())
        if low < _INT32.min or high > _INT32.max:
            bad = low if low < _INT32.min else high
            raise TypeError(f"{out.dtype} value {bad} does not fit int32")
    return out.astype(dtype)


def check_rewards(values: Any, n: int) -> list[float]:
    """Rewards as n finite floats, or `RolloutError` saying what the reward function got wrong.

    Takes a sequence of numbers (Python numbers, numpy scalars, 0-d arrays or tensors) or a 1-D
    numpy array or torch tensor. Bools are refused: a reward of True is more often a returned
    comparison than a meant 1.0.
    """
    values = _reward_sequence(values, n)
    if len(values) != n:
        raise RolloutError(f"reward function returned {len(values)} rewards for {n} samples")
    out: list[float] = []
    for v in values:
        f = _reward_float(v)
        if not math.isfinite(f):
            raise RolloutError(f"reward {f} is not finite")
        out.append(f)
    return out


def _reward_sequence(values: Any, n: int) -> Any:
    """`values` as something of a length to iterate: 1-D arrays and tensors as Python lists."""
    ndim = getattr(values, "ndim", None)
    if isinstance(ndim, int):  # a numpy array or scalar, or a torch tensor
        if ndim != 1:
            raise RolloutError(
                f"reward function returned a {ndim}-d {type(values).__name__}, not a 1-D array "
                f"of {n} rewards"
            )
        return values.tolist()  # Python scalars, checked below like any others
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise RolloutError(f"reward function returned {type(values).__name__}, not {n} numbers")
    if isinstance(values, (Mapping, AbstractSet)):  # iterates as keys, or in no order
        raise RolloutError(
            f"reward function returned a {type(values).__name__}, not {n} numbers in the "
            "samples' order: return a list"
        )
    return values


def _reward_float(v: Any) -> float:
    """One reward as a float, or `RolloutError` saying why it is not one."""
    if getattr(v, "ndim", None) == 0 and hasattr(v, "item"):
        v = v.item()  # a numpy scalar, 0-d array or 0-d tensor: its Python scalar
    if isinstance(v, bool):
        raise RolloutError(f"reward {v!r} is a bool, not a number: return float(...) if meant")
    if not isinstance(v, numbers.Real):
        raise RolloutError(f"reward {v!r} ({type(v).__name__}) is not a number")
    try:
        return float(v)
    except OverflowError:
        raise RolloutError(f"reward {v} is too large for a float") from None


def with_rewards(
    samples: tuple[RolloutState, ...], rewards: list[float]
) -> tuple[RolloutState, ...]:
    return tuple([scored_state(s, r) for s, r in zip(samples, rewards, strict=True)])


def truncated(sample: RolloutState, budget: int) -> RolloutState:
    """A partial single-turn sample of `budget` tokens or more, finished as "length" at
    `budget`: what a run with that budget would have made of it."""
    experts = sample.routed_experts
    return msgspec.structs.replace(
        sample,
        tokens=np.array(sample.tokens[:budget]),
        logprobs=np.array(sample.logprobs[:budget]),
        versions=np.array(sample.versions[:budget]),
        routed_experts=None if experts is None else np.array(experts[:budget]),
        status=Status.COMPLETED,
        finish_reason="length",
    )


def interrupted(samples: tuple[RolloutState, ...]) -> tuple[RolloutState, ...]:
    """Samples of an attempt that was cut off without an answer: whatever had not finished is
    ABORTED with the tokens it had before the attempt (possibly none), so it can resume."""
    return tuple(
        s
        if s.status in (Status.COMPLETED, Status.ABORTED)
        else msgspec.structs.replace(s, status=Status.ABORTED, finish_reason="abort")
        for s in samples
    )
