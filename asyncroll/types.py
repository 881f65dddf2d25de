"""The data model: one sample (`RolloutState`), the samples of one prompt (`RolloutGroup`).

Token data are numpy arrays, never per-token Python objects: a Python int costs 28 bytes plus
an 8-byte list slot, an int32 costs 4. Structs are frozen so that a status, once classified,
cannot be rewritten by anyone downstream (docs/design.md, invariant 2); "changing" a group means
building a new one with `msgspec.structs.replace`.
"""

from __future__ import annotations

import copy
import enum
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

Int32Array = npt.NDArray[np.int32]
Float32Array = npt.NDArray[np.float32]
UInt8Array = npt.NDArray[np.uint8]

_INT32 = np.dtype(np.int32)
_FLOAT32 = np.dtype(np.float32)
EMPTY_INT32: Int32Array = np.zeros(0, dtype=np.int32)
EMPTY_INT32.flags.writeable = False
EMPTY_FLOAT32: Float32Array = np.zeros(0, dtype=np.float32)
EMPTY_FLOAT32.flags.writeable = False


class Status(enum.StrEnum):
    """Where a sample or a group stands. PENDING is the only status before generation."""

    PENDING = "pending"
    COMPLETED = "completed"
    ABORTED = "aborted"
    FAILED = "failed"
    FILTERED = "filtered"
    EXPIRED = "expired"


class RolloutState(msgspec.Struct, frozen=True, array_like=True, weakref=True):
    """One sampled response to a prompt.

    `tokens`, `logprobs` and `versions` are parallel arrays: token i was sampled with
    log-probability `logprobs[i]` by policy version `versions[i]`. An aborted sample keeps its
    partial arrays so it can be continued; `finish_reason` is the engine's ("stop", "length",
    "abort"). A sample is only ever extended, so `versions` never decreases along it.

    Multi-turn samples (built by an `Episode`) interleave policy and environment tokens:

    * `loss_mask[i]` is 1 for a token the policy sampled (trained on), 0 for one the
      environment or a tool appended (context only). None means every token is the policy's,
      which is what a single-turn sample is: no mask is stored for it.
    * `turn_ends` holds the end offset (exclusive) of each turn, one per `episode.generate` or
      `episode.append` call, in order, the last equal to `len(tokens)`. None: one policy turn.
    * An environment token has logprob 0.0 (it was not sampled: log 1) and the version of the
      newest policy token before it (or the policy version when it was appended, if no policy
      token precedes it), so `versions` stays non-decreasing and environment tokens never make
      a sample look staler or fresher than the policy tokens around it.
    """

    tokens: Int32Array = EMPTY_INT32
    logprobs: Float32Array = EMPTY_FLOAT32
    versions: Int32Array = EMPTY_INT32
    status: Status = Status.PENDING
    finish_reason: str | None = None
    reward: float | None = None
    error: str | None = None
    routed_experts: npt.NDArray[Any] | None = None
    extra: dict[str, Any] = {}
    loss_mask: UInt8Array | None = None
    turn_ends: Int32Array | None = None

    def __post_init__(self) -> None:
        # Runs for every state built (merged, scored, decoded: 24 per group of 8), so the
        # common case is one expression of identity checks; `_check` sorts out the rest.
        tokens, logprobs, versions = self.tokens, self.logprobs, self.versions
        shape = tokens.shape
        if not (
            tokens.dtype is _INT32
            and versions.dtype is _INT32
            and logprobs.dtype is _FLOAT32
            and len(shape) == 1
            and logprobs.shape == shape
            and versions.shape == shape
            and self.loss_mask is None
            and self.turn_ends is None
        ):
            self._check()

    def _check(self) -> None:
        """Raise for arrays of the wrong dtype or shape (dtypes equal to int32/float32 but not
        numpy's own instances, such as a decoded little-endian int32, pass), or for a loss mask
        or turn boundaries that do not fit the tokens (multi-turn samples always come here)."""
        tokens, logprobs, versions = self.tokens, self.logprobs, self.versions
        if tokens.dtype != np.int32 or versions.dtype != np.int32 or logprobs.dtype != np.float32:
            raise TypeError(
                "RolloutState needs tokens/versions as int32 and logprobs as float32 arrays, got "
                f"{tokens.dtype}/{versions.dtype}/{logprobs.dtype}"
            )
        n = len(tokens)
        if (
            tokens.ndim != 1
            or len(logprobs) != n
            or len(versions) != n
            or logprobs.ndim != 1
            or versions.ndim != 1
        ):
            raise ValueError(
                "RolloutState arrays must be 1-D and of one length: "
                f"tokens {tokens.shape}, logprobs {logprobs.shape}, versions {versions.shape}"
            )
        if self.loss_mask is not None or self.turn_ends is not None:
            _check_turns(self.loss_mask, self.turn_ends, n)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_policy_tokens(self) -> int:
        """Tokens the policy sampled (all of them unless a `loss_mask` says otherwise)."""
        mask = self.loss_mask
        return len(self.tokens) if mask is None else int(np.count_nonzero(mask))

    @property
    def num_turns(self) -> int:
        """Turns (policy and environment) that built the sample; 1 for a single-turn one."""
        return 1 if self.turn_ends is None else len(self.turn_ends)


_force = msgspec.structs.force_setattr


def extended_state(
    sample: RolloutState,
    tokens: Int32Array,
    logprobs: Float32Array,
    versions: Int32Array,
    status: Status,
    finish_reason: str,
    routed_experts: npt.NDArray[Any] | None,
) -> RolloutState:
    """`sample` with new arrays, status and finish reason, for arrays the caller has checked
    (the engine boundary: 1-D int32 / float32 / int32 of one length). `msgspec.structs.replace`
    would run `__post_init__` again, and at eight samples a group that repeated check was a
    measurable share of a group's cost. A loss mask or turn boundaries are user input and must
    fit the new length, so a sample that carries either is checked in full."""
    new = copy.copy(sample)  # a copy runs no `__post_init__`; nobody else holds it yet
    _force(new, "tokens", tokens)
    _force(new, "logprobs", logprobs)
    _force(new, "versions", versions)
    _force(new, "status", status)
    _force(new, "finish_reason", finish_reason)
    _force(new, "routed_experts", routed_experts)
    if new.loss_mask is not None or new.turn_ends is not None:
        new._check()
    return new


def scored_state(sample: RolloutState, reward: float) -> RolloutState:
    """`sample` with its reward: no array changes, so nothing of `__post_init__` to re-check."""
    new = copy.copy(sample)
    _force(new, "reward", reward)
    return new


def _check_turns(mask: UInt8Array | None, ends: Int32Array | None, n: int) -> None:
    """Refuse a loss mask or turn boundaries that do not describe `n` tokens: a mask off by one
    would train on the environment's tokens silently."""
    if mask is not None and (mask.dtype != np.uint8 or mask.ndim != 1 or len(mask) != n):
        raise ValueError(
            f"RolloutState.loss_mask must be a 1-D uint8 array of {n} entries (one per token), "
            f"got {mask.dtype} with shape {mask.shape}"
        )
    if ends is not None:
        if ends.dtype != np.int32 or ends.ndim != 1:
            raise TypeError(f"RolloutState.turn_ends must be 1-D int32, got {ends.dtype}")
        if (
            (len(ends) == 0 and n != 0)
            or (len(ends) and (int(ends[-1]) != n or int(ends[0]) < 0))
            or bool((ends[1:] < ends[:-1]).any())
        ):
            raise ValueError(
                f"RolloutState.turn_ends must rise to the number of tokens ({n}), got "
                f"{ends.tolist()}"
            )


_min = np.minimum.reduce  # the ufunc itself: ndarray.min adds a Python-level call


class RolloutGroup(msgspec.Struct, frozen=True, array_like=True, weakref=True):
    """The samples of one prompt: the unit of scheduling, buffering, filtering and staleness.

    `uid` is unique per started group in a producer run; `prompt_id` names the prompt and is
    what survives a re-queue (an expired group's prompt starts again under a new uid).
    `start_version` is the policy version when the group was first started; it stands in for
    the staleness of a group whose samples hold no token yet.
    """

    uid: int
    prompt_id: str
    task: str
    prompt_tokens: Int32Array
    samples: tuple[RolloutState, ...]
    status: Status = Status.PENDING
    error: str | None = None
    metadata: dict[str, Any] = {}
    start_version: int = 0
    attempts: int = 0
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("RolloutGroup needs at least one sample")
        if self.prompt_tokens.dtype != np.int32 or self.prompt_tokens.ndim != 1:
            raise TypeError(
                f"RolloutGroup.prompt_tokens must be a 1-D int32 array, got "
                f"{self.prompt_tokens.dtype} with shape {self.prompt_tokens.shape}"
            )

    @property
    def num_samples(self) -> int:
        return len(self.samples)

    @property
    def num_tokens(self) -> int:
        """Response tokens held by the group (prompt tokens not included)."""
        return sum([len(s.tokens) for s in self.samples])  # a list: no generator frames

    @property
    def min_version(self) -> int:
        """Oldest policy version behind any token; the group's staleness is measured from it.

        The true minimum over every token, not each sample's first entry: the producer only
        builds non-decreasing versions, but a group may also be built by hand or decoded from
        bytes, and a wrong first entry would make a stale group look fresh. One concatenation
        and one reduction (a few us for typical groups), paid once per group by the buffer."""
        versions = [s.versions for s in self.samples if len(s.versions)]
        return int(_min(np.concatenate(versions))) if versions else self.start_version

    def rewards(self) -> npt.NDArray[np.float64]:
        """Rewards of all samples as float64; NaN where a sample has none."""
        return np.array(
            [np.nan if s.reward is None else s.reward for s in self.samples], dtype=np.float64
        )


def group_status(samples: tuple[RolloutState, ...] | list[RolloutState]) -> Status:
    """The status of a group from its samples' statuses: a total function with no fall-through.

    COMPLETED only if every sample is; otherwise by precedence FAILED > ABORTED > EXPIRED >
    FILTERED. A sample still PENDING next to finished ones is a mix no caller may produce, so it
    is an error rather than a guess.
    """
    if not samples:
        raise ValueError("group_status of an empty group")
    seen = {s.status for s in samples}
    if Status.PENDING in seen:
        if seen == {Status.PENDING}:
            return Status.PENDING
        raise ValueError(f"unknown mix of sample statuses: {sorted(seen)}")
    if seen == {Status.COMPLETED}:
        return Status.COMPLETED
    for status in (Status.FAILED, Status.ABORTED, Status.EXPIRED, Status.FILTERED):
        if status in seen:
            return status
    raise AssertionError(f"unreachable: {seen}")


def sample_status(finish_reason: str) -> Status:
    """Status of a sample from the engine's finish reason; unknown reasons are malformed output."""
    match finish_reason:
        case "stop" | "length":
            return Status.COMPLETED
        case "abort":
            return Status.ABORTED
        case _:
            raise ValueError(f"unknown finish_reason {finish_reason!r}")


class Prompt(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt as drawn from a source. `tokens` is validated only when its group starts, so a
    bad prompt becomes a FAILED group instead of stopping the run."""

    tokens: Any
    task: str = "default"
    prompt_id: str | None = None
    metadata: dict[str, Any] = {}
