"""The `Engine` protocol: what the producer needs from a generation backend, and nothing more.

One call generates the samples of one group. A sample either starts fresh (empty `prefix`) or
continues a partial response (the prefix is re-prefilled after the prompt), so resuming an
aborted group is the same call as starting one. The engine stamps every token it returns with
the policy version it was sampled under; the producer tells it the version in `update_weights`.
"""

from __future__ import annotations

import inspect
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec
import numpy as np
import numpy.typing as npt

from asyncroll.lora import LoraAdapter
from asyncroll.types import Float32Array, Int32Array

_min = np.minimum.reduce  # the ufuncs themselves: ndarray.min/max add a Python-level call
_max = np.maximum.reduce

Weights = Iterable[tuple[str, Any]]
"""Named tensors (`model.named_parameters()`, a state dict's `.items()`)."""


class EngineDeadError(RuntimeError):
    """The engine cannot serve any more requests (its process died, it was closed)."""


class SamplingConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Sampling parameters shared by every request of a producer."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None  # reproducible sampling; each sample's stream derives from it

    def __post_init__(self) -> None:
        # Nothing checks a struct's field types: NaN passes every `<` check, and a fractional
        # or NaN budget would be accepted here only to fail every group at run time.
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be an integer >= 1")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(
                f"temperature={self.temperature}: must be a finite number >= 0 (0 is greedy)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k={self.top_k}: use None to disable or an integer >= 1")


class SampleRequest(msgspec.Struct, frozen=True):
    """One sample to generate: continue `prefix` (empty for a fresh sample) by up to
    `max_new_tokens` tokens."""

    prefix: Int32Array
    max_new_tokens: int


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    """The samples of one group that still need tokens. `request_id` is unique per attempt and
    is what `abort` takes.

    `session` names the episode a request belongs to (None: a single-turn group). Every turn
    of one multi-turn episode carries the same key, so an engine with several replicas can keep
    the episode on one replica and reuse its prefix cache; an engine may ignore it."""

    request_id: str
    prompt_tokens: Int32Array
    samples: tuple[SampleRequest, ...]
    sampling: SamplingConfig
    session: str | None = None


class SampleOutput(msgspec.Struct, frozen=True, kw_only=True):
    """The new tokens of one sample (not including its prefix), in request order.

    `finish_reason` is "stop", "length" or "abort" (the request was aborted; the tokens so far
    are kept and the sample can be continued).
    """

    tokens: Int32Array
    logprobs: Float32Array
    versions: Int32Array
    finish_reason: str
    routed_experts: npt.NDArray[Any] | None = None


def check_token_ids(tokens: npt.ArrayLike, vocab_size: int, what: str) -> None:
    """Raise `ValueError` for a token id outside `[0, vocab_size)`. Engines check before
    generating: an out-of-vocabulary id would fail late, or (vLLM without a tokenizer) kill
    its worker."""
    arr = np.asarray(tokens)
    if not arr.size:
        return
    low, high = int(_min(arr, axis=None)), int(_max(arr, axis=None))  # one pass each
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"{what} has token id {bad} outside the vocabulary [0, {vocab_size})")


class RecentIds:
    """The request ids an engine saw end, and those aborted before their `generate` started.

    The abort contract (see `Engine`) tells three states of an id apart: running (the engine
    knows it), not started yet (the abort must wait for its `generate`), ended (the abort must
    do nothing). Only the last two need memory; the newest `limit` ids are kept, so memory stays
    bounded however many ids pass (callers give every attempt a fresh id, so a forgotten early
    abort of an old id never matters)."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._ids: OrderedDict[str, bool] = OrderedDict()  # id -> aborted before it started

    def ended(self, request_id: str) -> None:
        """`request_id` returned (or was answered as aborted): a later abort leaves it alone."""
        self._note(request_id, aborted_early=False)

    def abort_unknown(self, request_id: str) -> None:
        """An abort of an id that is not running: remembered for its coming `generate`, unless
        it has already ended."""
        if request_id not in self._ids:
            self._note(request_id, aborted_early=True)

    def take_early_abort(self, request_id: str) -> bool:
        """Whether `request_id` was aborted before it started (and forget that it was)."""
        return self._ids.pop(request_id, False)

    def _note(self, request_id: str, *, aborted_early: bool) -> None:
        self._ids[request_id] = aborted_early
        self._ids.move_to_end(request_id)
        if len(self._ids) > self.limit:
            self._ids.popitem(last=False)


@runtime_checkable
class Engine(Protocol):
    """A generation backend driven from the producer's event loop.

    The members below are required: they are those the protocol had before LoRA support,
    and `REQUIRED_MEMBERS` names them. Members added since are optional, with the defaults of
    `EngineDefaults` (inherit it, or leave them out: the producer applies the same defaults,
    `engine_options`); `OPTIONAL_MEMBERS` names them. A required member missing is named when
    the producer is built (`TypeError`). docs/engine-protocol.md is the user's page.

    The contract every engine keeps (`tests/test_engine_conformance.py` checks it):

    * **Request ids name one request for the engine's lifetime.** `generate` with an id that
      is running raises `ValueError`. The caller gives every attempt a fresh id: an abort
      cannot tell two uses of one id apart.
    * **An abort reaches a request in every state, promptly.** Aborted *before* its `generate`
      started, the later `generate` with that id returns at once, every sample finished
      "abort" with no new tokens (the producer may abort a request whose task has not run
      yet). Aborted *while running*, `generate` returns the tokens so far, every unfinished
      sample with finish reason "abort" (it can be continued later). Aborted *after* it
      returned, nothing happens, to it or to any other request. Telling "not yet started"
      from "already ended" takes memory: engines remember a bounded number of recent ids,
      so an early abort older than that bound may be forgotten (never a problem with fresh
      ids, which is why ids must be fresh).
    * **`generate` returns one `SampleOutput` per requested sample, in request order**, with
      1-D int32 tokens, float32 logprobs and int32 versions of equal length, only the *new*
      tokens (never the prefix), never more than the sample's `max_new_tokens`, and finish
      reason "stop", "length" or "abort".
    * **Bad input fails only its request:** a token id outside `[0, vocab_size)` in the prompt
      or a prefix raises `ValueError` before anything is generated, and the engine keeps
      serving. Any other exception from `generate` fails only that request as well, except
      `EngineDeadError`: the engine can no longer serve.
    * **Cancelling `generate` (a caller's deadline) ends the request in the engine**: the
      call raises `CancelledError` promptly and nothing of it stays running there, so a
      deadline never leaks work that a later pause or close would wait on.
    * **Versions:** every returned token carries the version of the weights that sampled it;
      tokens sampled after `update_weights(..., version=k)` returned carry `k`.
    * **`version` is what the engine committed:** the label every new token is stamped with,
      that of the weights it is sampled with. An update moves it only once the new weights
      serve (load first, then label), in one step that no cancellation cuts in two, and never
      after its call ended. So however `update_weights` ends (returned, raised, or cancelled
      by its caller's deadline at any await), `version` is the old label (not committed) or
      the new one (committed: only what came after, a resume say, was cut off), never one put
      on other weights. The producer reads it after a cut update to know which happened, and
      never relabels: setting the old label back on committed weights would mislabel every
      later token. A load cut part way is what a label cannot undo: the old label would stay
      on weights that may be partly new, so those must serve nothing until an update succeeds
      (`VLLMEngine` refuses to generate; `VLLMServerEngine` takes such replicas out of its
      rotation until re-synced with what it serves).
    * **Closed is dead:** after `close` (or the engine's death) `generate`,
      `pause_generation`, `resume_generation` and `update_weights` raise `EngineDeadError`,
      and so does a `generate` that was running when the engine closed. `abort` and `close`
      stay harmless no-ops, so cleanup paths need no special case.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_model_len(self) -> int | None:
        """Longest prompt + response the engine accepts (None: no limit)."""
        ...

    def payload_bytes(self, max_new_tokens: int) -> int:
        """Upper bound of the extra payload (routed experts...) one sample of up to
        `max_new_tokens` tokens carries; the producer sizes buffer reservations with it."""
        ...

    @property
    def supports_keep_pause(self) -> bool:
        """Whether `pause_generation` can freeze requests in place (instead of aborting them)."""
        ...

    @property
    def version(self) -> int:
        """The version label of the weights the engine committed (see the class docstring):
        0 until the first `update_weights`."""
        ...

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        """Generate the samples of `request` (see the class docstring for the contract)."""
        ...

    async def abort(self, request_id: str) -> None:
        """Abort `request_id` in whatever state it is: not started, running, or ended."""
        ...

    async def pause_generation(self) -> None:
        """Freeze all requests in place (only if `supports_keep_pause`): running and newly
        started requests make no progress, keep what they have, and can still be aborted,
        until `resume_generation`, after which they run to completion as if never paused."""
        ...

    async def resume_generation(self) -> None:
        """Undo `pause_generation` (a no-op when not paused)."""
        ...

    async def update_weights(self, weights: Weights | LoraAdapter | None, *, version: int) -> None:
        """Load `weights` (None: they were loaded out of band), then stamp later tokens
        `version` (and report it as `self.version`). Returns once the new weights serve every
        new token. Across a keep-in-place pause, tokens sampled before the pause keep the old
        version, tokens after it the new one. A `LoraAdapter` (engines started with LoRA)
        becomes the policy of every request started after this returns; requests already
        running finish under the adapter they started with, labelled with its version (an
        adapter is bound to a request for its life)."""
        ...

    async def close(self) -> None:
        """Stop serving for good (see "Closed is dead"); calling it again does nothing."""
        ...


REQUIRED_MEMBERS: tuple[str, ...] = (
    "vocab_size", "max_model_len", "payload_bytes", "supports_keep_pause", "version",
    "generate", "abort", "pause_generation", "resume_generation", "update_weights", "close",
)  # fmt: skip
"""The `Engine` members with no default: an engine without one cannot be driven."""


class EngineDefaults:
    """The optional `Engine` members with their defaults: inherit it to have them, and
    override those your engine does differently. An engine that neither inherits nor defines
    one gets the same default from the producer (`engine_options`), so a member added to the
    protocol never breaks an engine written before it."""

    @property
    def adapter_slots(self) -> int | None:
        """How many LoRA adapters the engine keeps registered at once; None (the default): it
        serves none (an adapter given to `update_weights` raises `LoraError`, or is the
        engine's own business), and the producer pauses for an adapter update as for any.

        An engine that serves adapters binds one to each request for the request's whole
        life, which is what lets an adapter update skip the pause: requests already running
        finish under the adapter they started with (each token labelled with its version),
        new ones take the new adapter. So tokens sampled after `update_weights(adapter, k)`
        returned may still carry older labels, always naming the weights that sampled them.
        The producer relies on this: it does not pause for an adapter update, and refuses at
        construction a `max_staleness` whose window needs more adapters than `adapter_slots`."""
        return None

    @property
    def pause_bound_s(self) -> float | None:
        """The longest `pause_generation` or `resume_generation` may take, where the engine
        bounds it itself (`VLLMServerEngine`: its per-replica deadlines); None (the default):
        no bound of its own. The producer's wait for a pause must outlast it, or a pause still
        under way would stop the run as a timeout; it refuses an `abort_timeout_s` that does
        not."""
        return None


OPTIONAL_MEMBERS: tuple[str, ...] = ("adapter_slots", "pause_bound_s")
"""The `Engine` members added since LoRA support, each with `EngineDefaults`' default."""


class EngineOptions(msgspec.Struct, frozen=True, kw_only=True):
    """The optional members of one engine, as it states them or by default."""

    adapter_slots: int | None = None
    pause_bound_s: float | None = None


_MISSING = object()


def _has(engine: object, member: str) -> bool:
    # Looked up without running it: a property that raises AttributeError inside would
    # otherwise read as a missing member. A wrapper that delegates through `__getattr__` has
    # its members only when asked, so for one of those, asking is the lookup.
    if inspect.getattr_static(engine, member, _MISSING) is not _MISSING:
        return True
    if inspect.getattr_static(type(engine), "__getattr__", _MISSING) is _MISSING:
        return False
    try:
        getattr(engine, member)
    except AttributeError:
        return False
    return True


def engine_options(engine: object) -> EngineOptions:
    """Check that `engine` has every required `Engine` member and read its optional ones,
    with `EngineDefaults`' default for any it lacks; `TypeError` names a missing member or an
    optional one of the wrong kind. The producer calls it once, at construction."""
    name = type(engine).__name__
    missing = [m for m in REQUIRED_MEMBERS if not _has(engine, m)]
    if missing:
        raise TypeError(
            f"{name} lacks the Engine member(s) {missing}, which have no default: every engine "
            f"needs {list(REQUIRED_MEMBERS)} (docs/engine-protocol.md); optional members "
            f"{list(OPTIONAL_MEMBERS)} may be left out, or inherited from EngineDefaults"
        )
    stated = {m: getattr(engine, m) for m in OPTIONAL_MEMBERS if _has(engine, m)}
    slots = stated.get("adapter_slots")
    if slots is not None and (not isinstance(slots, int) or isinstance(slots, bool) or slots < 1):
        raise TypeError(
            f"{name}.adapter_slots={slots!r}: must be an int >= 1, or None (the default: the "
            "engine serves no LoRA adapters)"
        )
    bound = stated.get("pause_bound_s")
    if bound is not None and (
        not isinstance(bound, int | float) or isinstance(bound, bool) or not 0 <= bound < math.inf
    ):
        raise TypeError(
            f"{name}.pause_bound_s={bound!r}: must be a number of seconds >= 0, or None (the "
            "default: no bound of its own)"
        )
    return EngineOptions(**stated)
