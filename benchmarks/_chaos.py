"""The hostile parts of the soak (`soak.py`): an engine that misbehaves, rewards that misbehave,
prompts that are awkward or invalid.

Every misbehaviour is one a real run meets sooner or later: a vLLM worker that raises or dies,
a driver that hangs, a reward that calls a sandbox that never answers, a reward written with
torch, a dataset row with numpy metadata. Each draw is seeded, so a failing soak can be rerun
with the same seed; draws keyed on a string (a prompt index, a group uid) do not depend on the
order in which concurrent tasks or threads ask for them.
"""

from __future__ import annotations

import asyncio
import enum
import random
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import msgspec
import numpy as np

from asyncroll import Prompt, RolloutGroup, SimEngine
from asyncroll.engines import EngineDeadError, GenerateRequest, SampleOutput
from asyncroll.engines.base import Weights


def _import_torch() -> Any:
    """torch, or None (the soak then leaves out torch rewards). Imported here, not in a reward
    thread: a first import there takes seconds, which the reward deadline would count."""
    try:
        import torch
    except ImportError:
        return None
    return torch


TORCH = _import_torch()
TIMEOUT_MARKER = "chaos engine TimeoutError"
"""In the message of the engine's own `TimeoutError`, so the soak can find it in drop errors."""


def draw(key: str) -> float:
    """A uniform draw that depends only on `key` (thread-safe, order-independent)."""
    return random.Random(key).random()


def pick(key: str, weights: dict[str, float]) -> str:
    """A name drawn with the given weights, depending only on `key`."""
    u, total = draw(key) * sum(weights.values()), 0.0
    for name, weight in weights.items():
        total += weight
        if u < total:
            return name
    return name


class ChaosBaseError(BaseException):
    """A `BaseException` that is not an `Exception`, as buggy native code or a library's
    control-flow exception can raise: a bug class the producer must contain, never let loose in
    the trainer's task."""


class Fault(enum.StrEnum):
    """What the engine does to one `generate` call."""

    NONE = "none"
    RUNTIME = "runtime_error"
    VALUE = "value_error"
    TIMEOUT = "own_timeout_error"  # the engine's own TimeoutError: an engine error, no deadline
    BASE = "base_exception"
    CANCEL = "spontaneous_cancel"  # CancelledError although nobody cancelled the caller
    HANG = "engine_hang"  # past generate_timeout_s, ignoring abort
    SPIKE = "latency_spike"
    WRONG_COUNT = "malformed_count"
    NAN_LOGPROBS = "malformed_nan_logprobs"
    OUT_OF_VOCAB = "malformed_out_of_vocab"
    VERSIONS = "malformed_versions"  # versions go backwards along a sample


class ChaosEngine:
    """`SimEngine` behind a layer that injects one seeded `Fault` per `generate` call.

    `kill()` makes it a dead engine (every call raises `EngineDeadError`), as when the vLLM
    process dies: the producer must stop with `ProducerError` and the run restart on a new
    engine. `injected` counts what was done, so the soak can compare it with what the producer
    reported.
    """

    def __init__(
        self, sim: SimEngine, rates: dict[Fault, float], *, spike_s: float, hang_s: float, seed: int
    ) -> None:
        self.sim = sim
        self.rates = {str(k): v for k, v in rates.items()}
        self.rates[Fault.NONE] = max(0.0, 1.0 - sum(rates.values()))
        self.spike_s = spike_s
        self.hang_s = hang_s
        self.seed = seed
        self.calls = 0
        self.dead = False
        self.injected: Counter[str] = Counter()

    @property
    def vocab_size(self) -> int:
        return self.sim.vocab_size

    @property
    def max_model_len(self) -> int | None:
        return self.sim.max_model_len

    @property
    def supports_keep_pause(self) -> bool:
        return self.sim.supports_keep_pause

    @property
    def version(self) -> int:
        return self.sim.version

    @property
    def adapter_slots(self) -> int | None:
        return self.sim.adapter_slots

    @property
    def pause_bound_s(self) -> float | None:
        return self.sim.pause_bound_s

    def payload_bytes(self, max_new_tokens: int) -> int:
        return self.sim.payload_bytes(max_new_tokens)

    async def kill(self) -> None:
        """Die: requests in flight end with `EngineDeadError`, and so does every later call."""
        self.dead = True
        await self.sim.close()

    def _check_alive(self) -> None:
        if self.dead:
            raise EngineDeadError("chaos engine is dead")

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        self._check_alive()
        self.calls += 1
        fault = Fault(pick(f"{self.seed}/generate/{self.calls}", self.rates))
        self.injected[fault] += 1
        match fault:
            case Fault.RUNTIME:
                raise RuntimeError(f"chaos engine RuntimeError on {request.request_id}")
            case Fault.VALUE:
                raise ValueError(f"chaos engine ValueError on {request.request_id}")
            case Fault.TIMEOUT:
                raise TimeoutError(f"{TIMEOUT_MARKER} on {request.request_id}")
            case Fault.BASE:
                raise ChaosBaseError(f"chaos engine BaseException on {request.request_id}")
            case Fault.CANCEL:
                raise asyncio.CancelledError(f"chaos engine cancelled {request.request_id}")
            case Fault.HANG:
                await asyncio.sleep(self.hang_s)  # abort() does not reach it: only a cancel
            case Fault.SPIKE:
                await asyncio.sleep(self.spike_s)
        outputs = list(await self.sim.generate(request))
        self._check_alive()
        return malformed(outputs, fault, self.sim.version, self.vocab_size)

    async def abort(self, request_id: str) -> None:
        self._check_alive()
        await self.sim.abort(request_id)

    async def pause_generation(self) -> None:
        self._check_alive()
        await self.sim.pause_generation()

    async def resume_generation(self) -> None:
        self._check_alive()
        await self.sim.resume_generation()

    async def update_weights(self, weights: Weights | None, *, version: int) -> None:
        self._check_alive()
        await self.sim.update_weights(weights, version=version)

    async def close(self) -> None:
        await self.sim.close()


def malformed(
    outputs: list[SampleOutput], fault: Fault, version: int, vocab_size: int
) -> list[SampleOutput]:
    """`outputs` broken the way `fault` says (unchanged for other faults); each break is one
    the producer must refuse rather than hand to the trainer."""
    if fault is Fault.WRONG_COUNT:
        return outputs[:-1] if len(outputs) > 1 else outputs + outputs
    if not outputs or fault not in (Fault.NAN_LOGPROBS, Fault.OUT_OF_VOCAB, Fault.VERSIONS):
        return outputs
    first, n = outputs[0], max(len(outputs[0].tokens), 2)
    if fault is Fault.NAN_LOGPROBS:
        broken = msgspec.structs.replace(
            first,
            tokens=np.full(n, 2, np.int32),
            logprobs=np.full(n, np.nan, np.float32),
            versions=np.full(n, version, np.int32),
        )
    elif fault is Fault.OUT_OF_VOCAB:
        broken = msgspec.structs.replace(
            first,
            tokens=np.full(n, vocab_size + 3, np.int32),
            logprobs=np.full(n, -1.0, np.float32),
            versions=np.full(n, version, np.int32),
        )
    else:  # a later token stamped with an older version (or a future one, at version 0)
        versions = np.full(n, version, np.int32)
        if version > 0:
            versions[n // 2 :] = version - 1
        else:
            versions[: n // 2] = 1
        broken = msgspec.structs.replace(
            first,
            tokens=np.full(n, 2, np.int32),
            logprobs=np.full(n, -1.0, np.float32),
            versions=versions,
        )
    return [broken, *outputs[1:]]


# -- rewards ---------------------------------------------------------------------------------

VALID_REWARDS = ("float", "numpy", "torch")
"""Reward kinds whose values are correct and must be accepted."""


class HostileRewards:
    """Reward functions that, per group (a seeded draw on the run, the session and the uid),
    return floats, numpy scalars or a torch tensor (all valid), raise, return NaN, return the
    wrong count, or hang: the sync one on `release` (set at the end of the soak so the worker
    threads it holds can exit), the async one until cancelled.

    `valid` holds the uids whose reward returned valid values: a FAILED drop of one of them
    means the producer refused a correct reward. Counters are updated from worker threads,
    hence the lock.
    """

    def __init__(self, key: str, weights: dict[str, float], release: threading.Event) -> None:
        self.key = key
        self.weights = {k: w for k, w in weights.items() if k != "torch" or TORCH is not None}
        self.release = release
        self.drawn: Counter[str] = Counter()
        self.valid: set[int] = set()
        self._lock = threading.Lock()

    def _kind(self, group: RolloutGroup) -> str:
        kind = pick(f"{self.key}/reward/{group.uid}", self.weights)
        with self._lock:
            self.drawn[kind] += 1
        return kind

    def _values(self, kind: str, group: RolloutGroup) -> Any:
        """The reward values for a kind that returns (everything but the hangs)."""
        values = [float(len(s.tokens) % 3) for s in group.samples]  # equal ones get filtered
        match kind:
            case "raise":
                raise ArithmeticError(f"chaos reward raised on group {group.uid}")
            case "nan":
                return [*values[:-1], float("nan")]
            case "wrong_count":
                return values[:-1]
            case "numpy":
                result: Any = [np.float32(values[0]), *(np.int64(v) for v in values[1:])]
            case "torch":
                result = TORCH.tensor(values, dtype=TORCH.float32)
            case _:
                result = values
        with self._lock:
            self.valid.add(group.uid)
        return result

    def sync(self, group: RolloutGroup) -> Any:
        """The synchronous reward (the producer runs it in its worker threads)."""
        kind = self._kind(group)
        if kind == "hang":
            self.release.wait()
            return [0.0] * group.num_samples
        return self._values(kind, group)

    async def async_(self, group: RolloutGroup) -> Any:
        """The asynchronous reward (awaited on the producer's event loop)."""
        kind = self._kind(group)
        if kind == "hang":
            await asyncio.Event().wait()  # never set: only the producer's deadline ends it
        return self._values(kind, group)


# -- prompts ---------------------------------------------------------------------------------


class ChaosPrompts:
    """Re-iterable prompt source: prompt i is the same on every iteration (a checkpoint's
    cursor skips forward by count), with a unique `prompt_id`.

    Most prompts are short token lists; some carry numpy metadata (`np.int64`, a small array),
    some are numpy token arrays, some are long (hundreds of tokens), and some are invalid
    (out-of-vocabulary or negative ids, empty). The source is endless until `close()`: then it
    ends after the highest prompt ever drawn, so the soak can drain and count every prompt.
    """

    KINDS: ClassVar[dict[str, float]] = {
        "plain": 70.0, "numpy_meta": 10.0, "numpy_tokens": 5.0, "long": 8.0, "invalid": 7.0,
    }  # fmt: skip

    def __init__(self, seed: int, vocab_size: int, kinds: dict[str, float]) -> None:
        self.seed = seed
        self.vocab_size = vocab_size
        self.kinds = kinds
        self.limit: int | None = None
        self.drawn = 0  # prompts ever drawn: the highest index + 1

    def close(self) -> None:
        self.limit = self.drawn

    def __iter__(self) -> Iterator[Prompt]:
        i = 0
        while self.limit is None or i < self.limit:
            self.drawn = max(self.drawn, i + 1)
            yield self.prompt(i)
            i += 1

    @staticmethod
    def prompt_id(i: int) -> str:
        return f"p{i:07d}"

    def prompt(self, i: int) -> Prompt:
        key = f"{self.seed}/prompt/{i}"
        kind = pick(key, self.kinds)
        rng = np.random.default_rng(int(draw(key) * 2**32))
        length = int(rng.integers(200, 700)) if kind == "long" else int(rng.integers(4, 24))
        tokens: Any = rng.integers(2, self.vocab_size, length).tolist()
        metadata: dict[str, Any] = {"kind": kind}
        if kind == "numpy_meta":
            metadata |= {"index": np.int64(i), "features": np.arange(3, dtype=np.float32) + i}
        elif kind == "numpy_tokens":
            tokens = np.asarray(tokens, dtype=np.int64)
        elif kind == "invalid":
            tokens = [[], [self.vocab_size + 5, 3], [-1, 4, 5]][i % 3]
        return Prompt(tokens=tokens, prompt_id=self.prompt_id(i), metadata=metadata)
