"""Chaos soak of the `Producer`: everything that goes wrong in a long run, at once, for minutes.

Why: each failure mode has a unit test, but a run meets them together and in every order (an
engine error while a pause drains, a checkpoint while a reward hangs, a restart while groups
wait to resume). The soak drives one producer after another through such a run and checks the
guarantees of docs/design.md after every step, so that the first violation is reported, with what
was going on, instead of surfacing weeks later as a hung or silently skewed training run.

What runs (all draws seeded; `_chaos.py` holds the hostile parts):

- **engine**: `SimEngine` (a simulation: random tokens, timers) behind `ChaosEngine`, which per
  `generate` call raises RuntimeError / ValueError / its own TimeoutError / a `BaseException`
  subclass / a spontaneous `CancelledError`, hangs past `generate_timeout_s` ignoring abort,
  returns malformed outputs (wrong count, NaN logprobs, ids out of vocabulary, versions going
  backwards) or spikes its latency.
- **rewards**, drawn per group: floats, numpy scalars, a torch tensor (all valid), raise, NaN,
  the wrong count, hang. Sessions alternate a sync reward (run in the producer's threads; a
  hang holds its thread until the soak ends) and an async one.
- **prompts**: token lists, numpy token arrays, numpy metadata, long prompts, invalid ones.
- **controller**: a task that at random moments pauses and resumes, holds `pausing()`, updates
  the weights, checkpoints, restarts the producer from a fresh checkpoint, or kills the engine
  (the producer must stop with `ProducerError`; the soak then builds a new engine and producer,
  loads the last checkpoint and pushes the trainer's weights).
- **trainer**: takes batches, checks every group handed out, updates the weights per batch.

Checks: the ledger after every controller event, every batch and every 0.5 s; every prompt
ends exactly once (handed out, or dropped as failed or filtered; an expired prompt comes back,
which is no ending). A restart loads the last checkpoint, and the endings recorded after it are
discarded with the rest of what the checkpoint does not know. After the chaos phase the prompt
source is closed and the run drains, so `lost` (prompts with no ending) and `duplicated` (more
than one) are exact. Every await has a deadline: a hang becomes a failure row, never a stuck
process (a watchdog thread ends the process if even the event loop stops answering).

Prints Markdown tables (checks, summary, events by kind, injected faults) and writes
`soak.png` (RSS and groups over time, events marked), `soak.json`, `soak.md`. Exits 1 when a
check failed, 3 when the watchdog fired.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import math
import os
import random
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np
from _chaos import (
    TIMEOUT_MARKER,
    ChaosEngine,
    ChaosPrompts,
    Fault,
    HostileRewards,
)
from _common import DEFAULT_OUT, MIB, info_line, new_figure, print_section, rss_bytes, run_info
from _common import save_outputs as save_report

from asyncroll import (
    DropRecord,
    Producer,
    ProducerError,
    ProducerExhausted,
    PutOutcome,
    RolloutGroup,
    SamplingConfig,
    SimEngine,
    StalledError,
)
from asyncroll._core.state import loads
from asyncroll.outcomes import FailureReason

T = TypeVar("T")
VOCAB = 1000
LOGPROB_TOLERANCE = 1e-4

ENGINE_FAULTS = {
    Fault.RUNTIME: 0.01,
    Fault.VALUE: 0.01,
    Fault.TIMEOUT: 0.01,
    Fault.BASE: 0.0005,
    Fault.CANCEL: 0.005,
    Fault.HANG: 0.004,
    Fault.SPIKE: 0.02,
    Fault.WRONG_COUNT: 0.008,
    Fault.NAN_LOGPROBS: 0.008,
    Fault.OUT_OF_VOCAB: 0.008,
    Fault.VERSIONS: 0.008,
}
"""Per `generate` call; the rest answer normally. A BaseException ends the producer, so it is
rare enough to leave sessions of several seconds."""

REWARDS = {
    "float": 60.0,
    "numpy": 8.0,
    "torch": 8.0,
    "raise": 5.0,
    "nan": 5.0,
    "wrong_count": 5.0,
    "hang": 0.4,
}
"""Per group. A sync hang holds one of the producer's reward threads for good."""

CONTROL = {
    "pause": 3.0,
    "pausing": 2.0,
    "update_weights": 3.0,
    "save": 2.0,
    "restart": 0.5,
    "kill_engine": 0.5,
}
DRAIN_CONTROL = {k: CONTROL[k] for k in ("pause", "pausing", "update_weights", "save")}
"""While draining: no restarts or deaths, so that the run ends."""

FATAL = (Fault.BASE, "hang")
"""Faults that stop a producer (a BaseException; hung sync rewards holding every worker): left
out while draining, so that the run can end instead of restarting from its checkpoint."""

REWARD_DEADLINE_SLACK = 3
"""Reward deadlines per session beyond the hung rewards that are put down to a loaded machine
(a valid reward takes microseconds; starved threads cost hundreds)."""
ABNORMAL = ("escaped", "hang", "stalled")
PAUSE_LIKE = ("pause", "pausing", "update_weights", "save", "restart")

KINDS = [*ENGINE_FAULTS, *REWARDS, *ChaosPrompts.KINDS, *CONTROL]
"""Everything `--without` can leave out."""

CHECKS = {
    "ledger": "ledger identity after every event, batch and sample",
    "exactly_once": "every prompt ends exactly once (lost 0, duplicated 0)",
    "bounded": "every wait ends within its bound (no hang)",
    "contained": "no exception escapes into the trainer's task",
    "dead_engine": "a dead engine stops the producer with ProducerError",
    "unexpected_stop": "ProducerError only after an engine death or BaseException",
    "well_formed": "handed-out groups are well-formed (tokens, logprobs, versions, rewards)",
    "valid_rewards": "valid rewards (floats, numpy scalars, torch tensor) are accepted",
    "engine_timeout": "the engine's own TimeoutError is an engine error, not a deadline",
    "reward_threads": "reward deadlines only where a reward hung (no starved threads)",
    "api": "pause/resume/pausing/update_weights/save/load raise nothing",
    "stall": "no StalledError unless paused",
    "drain": "the run drains: source used up, nothing left in flight, ready or to resume",
    "progress": "restarts make progress (not stuck failing from one checkpoint)",
}
STUCK_SESSIONS = 5
"""Sessions in a row that end abnormally from one checkpoint before the soak gives up: the
same prompts and faults come back after each restart, so more tries only repeat the failure."""


class SoakConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The run's shape; timeouts are short so that faults cost seconds, not minutes."""

    duration_s: float
    drain_s: float
    seed: int
    without: tuple[str, ...] = ()  # fault, reward, prompt and event kinds left out
    group_size: int = 4
    batch_size: int = 8
    max_new_tokens: int = 32
    max_inflight: int = 16
    first_token_latency_s: float = 0.005
    per_token_latency_s: float = 0.002
    spike_s: float = 0.4
    generate_timeout_s: float = 1.0
    reward_timeout_s: float = 0.5
    abort_timeout_s: float = 0.5
    reward_workers: int = 2
    batch_wait_s: float = 5.0  # produce_batch(timeout=): TimeoutError is an event, not a failure
    op_bound_s: float = 10.0  # any other single call into the producer
    dead_bound_s: float = 10.0  # from an engine's death to ProducerError in the trainer
    event_every_s: float = 1.0  # mean time between controller events
    sample_every_s: float = 0.5


def _discard(path: str) -> None:
    """Remove a checkpoint file no session will load (a local unlink: not worth a thread)."""
    Path(path).unlink(missing_ok=True)


class Checkpoint(msgspec.Struct, frozen=True):
    """A saved producer state and the number of journal entries (prompt endings) it knows."""

    path: str
    journal_len: int


class Hang(Exception):
    """A bounded wait ran out (already recorded as a failure): the session ends."""


async def push_trained_weights(producer: Producer) -> None:
    """After a restart the trainer's weights must reach the new engine before it generates.
    This soak trains nothing (`None`: loaded out of band); today's API is one `update_weights`
    right after start. Kept in one place so it follows the resume API."""
    await producer.update_weights(None)


def describe(exc: BaseException) -> str:
    """`Type: message`, and the same for the leaves of an exception group."""
    if isinstance(exc, BaseExceptionGroup):
        leaves = "; ".join(describe(e) for e in exc.exceptions[:4])
        return f"{type(exc).__name__}[{leaves}]"
    return f"{type(exc).__name__}: {exc}"


def group_problem(group: RolloutGroup, version: int) -> str | None:
    """What is wrong with a group handed to the trainer, or None: what a trainer must be able
    to rely on without checking."""
    if group.metadata.get("kind") == "invalid":
        return "an invalid prompt was handed out"
    if group.status != "completed":
        return f"status {group.status}"
    for i, s in enumerate(group.samples):
        n = len(s.tokens)
        if len(s.logprobs) != n or len(s.versions) != n:
            return f"sample {i}: {n} tokens, {len(s.logprobs)} logprobs, {len(s.versions)} versions"
        if n and (int(s.tokens.min()) < 0 or int(s.tokens.max()) >= VOCAB):
            return f"sample {i}: token id outside the vocabulary"
        if n and not (np.isfinite(s.logprobs).all() and s.logprobs.max() <= LOGPROB_TOLERANCE):
            return f"sample {i}: logprob NaN, infinite or positive"
        if n and int(s.versions.max()) > version:
            return f"sample {i}: version {int(s.versions.max())} > producer version {version}"
        if n and np.any(np.diff(s.versions) < 0):
            k = int(np.argmax(np.diff(s.versions) < 0))
            return f"sample {i}: versions go back from {s.versions[k]} to {s.versions[k + 1]}"
        if s.reward is None or not math.isfinite(s.reward):
            return f"sample {i}: reward {s.reward}"
    return None


class Soak:
    """One soak run: sessions of producer + trainer + controller, one after the other, each
    resuming from the last checkpoint, and the record of everything that happened."""

    def __init__(self, cfg: SoakConfig, workdir: Path) -> None:
        self.cfg = cfg
        self.phase = "chaos"
        self.workdir = workdir
        self.saves = 0  # each save has a file of its own, see `save`
        self.prompts = ChaosPrompts(cfg.seed, VOCAB, self.kept(ChaosPrompts.KINDS))
        self.release = threading.Event()  # lets hung sync rewards return at the end
        self.t0 = time.monotonic()
        self.calm: Callable[[], None] = lambda: None  # the running session's, see `_calm`
        self.journal: list[tuple[str, str]] = []  # (prompt_id, ending) in order
        self.checkpoint: Checkpoint | None = None
        self.failures: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self.faults: list[Counter[str]] = []  # per session: the engine's injected faults
        self.reward_kinds: list[Counter[str]] = []  # per session: the rewards' kinds drawn
        self.sessions = 0
        self.stuck = 0  # abnormal session ends in a row from the same checkpoint
        self.alive = -1  # the session whose drops count; older ones' late callbacks do not
        self.producer: Producer | None = None  # the running one, for the sampler
        self.stop_request: str | None = None
        self.killed_at: float | None = None
        self.pausing_now = 0
        self.handed_out = 0
        self.ledger_checks = 0
        self.timeouts_reported = 0
        self.reward_deadlines: Counter[int] = Counter()
        self.drained = False
        self.rss_start = self.rss_peak = rss_bytes()

    def kept(self, weights: dict[T, float]) -> dict[T, float]:
        """`weights` without the kinds `--without` names (nor, while draining, the fatal ones)."""
        left_out = set(self.cfg.without) | (set(FATAL) if self.phase == "drain" else set())
        return {k: w for k, w in weights.items() if k not in left_out}

    # -- record ----------------------------------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self.t0

    def fail(self, check: str, detail: str) -> None:
        self.failures.append({"t_s": self.now(), "check": check, "detail": detail[:400]})

    def event(self, kind: str, latency_s: float | None = None, note: str = "") -> None:
        self.events.append({"t_s": self.now(), "kind": kind, "latency_s": latency_s, "note": note})

    def check_ledger(self, producer: Producer, where: str) -> None:
        self.ledger_checks += 1
        try:
            producer.check_ledger()
        except AssertionError as exc:  # LedgerError
            self.fail("ledger", f"after {where}: {exc}")

    async def bounded(self, what: str, call: Awaitable[T], limit: float) -> T:
        """`await call` within `limit` seconds; past it, record a hang and raise `Hang`. A
        `TimeoutError` the call raises itself passes through."""
        deadline = asyncio.timeout(limit)
        try:
            async with deadline:
                return await call
        except TimeoutError:
            if not deadline.expired():
                raise
            self.fail("bounded", f"{what} did not return within {limit:g} s")
            raise Hang(what) from None

    def on_drop(self, session: int, rewards: HostileRewards, record: DropRecord) -> None:
        """`on_drop`: FAILED and FILTERED are endings; EXPIRED prompts come back."""
        if record.outcome is PutOutcome.DROPPED_EXPIRED:
            return
        error = record.error or ""
        self.timeouts_reported += TIMEOUT_MARKER in error
        if "reward_timeout_s" in error:
            self.reward_deadlines[session] += 1
        elif (
            record.outcome is PutOutcome.DROPPED_FAILED
            and record.reason is not FailureReason.INTERRUPTED  # a stop while it was scored
            and record.uid in rewards.valid
        ):
            self.fail("valid_rewards", f"{record.prompt_id}: {error}")
        if session == self.alive:
            self.journal.append((record.prompt_id, record.outcome.value))

    # -- the run ---------------------------------------------------------------------------------

    async def run(self) -> None:
        sampler = asyncio.create_task(self.sample_loop())
        try:
            while not await self.run_session():
                pass
        finally:
            sampler.cancel()
            self.release.set()
        self.sample()

    def time_left(self) -> float:
        return self.cfg.duration_s + self.cfg.drain_s - self.now()

    async def run_session(self) -> bool:
        """Run one session from the last checkpoint; True when the soak is over."""
        n, ckpt = self.sessions, self.checkpoint
        self.sessions += 1
        self.alive = n
        del self.journal[ckpt.journal_len if ckpt else 0 :]  # the checkpoint is the truth
        self.stop_request = self.killed_at = None
        task = asyncio.create_task(self.session(n, ckpt), name=f"soak-trainer-{n}")
        done, _ = await asyncio.wait({task}, timeout=self.time_left() + 3 * self.cfg.op_bound_s)
        if not done:
            self.fail("bounded", f"session {n} did not end; abandoned")
            task.cancel()
            await asyncio.wait({task}, timeout=self.cfg.op_bound_s)
            return True
        if task.cancelled():
            self.fail("contained", f"session {n}: the producer cancelled the trainer's task")
            reason = "escaped"
        elif (exc := task.exception()) is not None:
            self.fail("contained", f"escaped into the trainer's task: {describe(exc)}")
            if not any(f["check"] == "contained" for f in self.failures[:-1]):
                traceback.print_exception(exc, file=sys.stderr)  # the first one, for the reader
            reason = "escaped"
        else:
            reason = task.result()
        self.event("session_end", note=reason)
        if reason == "exhausted":
            return True
        self.stuck = self.stuck + 1 if self.checkpoint is ckpt and reason in ABNORMAL else 0
        if self.stuck >= STUCK_SESSIONS:
            self.fail("progress", f"{self.stuck} sessions in a row from one checkpoint: {reason}")
            return True
        if self.time_left() <= 0:
            self.fail("drain", f"not drained within drain_s={self.cfg.drain_s:g}")
            return True
        return False

    async def session(self, n: int, ckpt: Checkpoint | None) -> str:
        """A new engine and producer (loaded from `ckpt`), trained until something ends it."""
        cfg = self.cfg
        sim = SimEngine(
            vocab_size=VOCAB,
            lengths="uniform",
            first_token_latency_s=cfg.first_token_latency_s,
            per_token_latency_s=cfg.per_token_latency_s,
            seed=cfg.seed * 1000 + n,
        )
        engine = ChaosEngine(
            sim,
            self.kept(ENGINE_FAULTS),
            spike_s=cfg.spike_s,
            hang_s=30 * cfg.generate_timeout_s,
            seed=cfg.seed * 1000 + n,
        )
        rewards = HostileRewards(f"{cfg.seed}/{n}", self.kept(REWARDS), self.release)
        self.calm = functools.partial(_calm, engine, rewards)
        self.faults.append(engine.injected)  # the counters only: an engine holds 8 MiB
        self.reward_kinds.append(rewards.drawn)
        producer = Producer(
            engine,
            self.prompts,
            rewards.sync if n % 2 == 0 else rewards.async_,
            filter="nonzero_std",
            on_drop=functools.partial(self.on_drop, n, rewards),
            group_size=cfg.group_size,
            batch_size=cfg.batch_size,
            max_staleness=1,
            sampling=SamplingConfig(max_new_tokens=cfg.max_new_tokens),
            max_inflight_groups=cfg.max_inflight,
            pause_mode="abort" if n % 4 < 2 else "keep",
            generate_timeout_s=cfg.generate_timeout_s,
            reward_timeout_s=cfg.reward_timeout_s,
            abort_timeout_s=cfg.abort_timeout_s,
            update_timeout_s=cfg.op_bound_s / 2,
            prompt_timeout_s=cfg.op_bound_s / 2,
            reward_workers=cfg.reward_workers,
        )
        if ckpt is not None:
            start = time.monotonic()
            producer.load(ckpt.path, weights=None)
            self.event("load", time.monotonic() - start)
        try:
            async with self.running(producer):
                if n:
                    await self.bounded("push_trained_weights", push_trained_weights(producer), 10)
                controller = asyncio.create_task(self.control(producer, engine, n))
                try:
                    return await self.train(producer)
                finally:
                    controller.cancel()
                    await asyncio.wait({controller}, timeout=self.cfg.op_bound_s)
        except ProducerError as exc:
            return self.producer_stopped(engine, exc)
        except Hang:
            return "hang"
        finally:
            await engine.close()

    @contextlib.asynccontextmanager
    async def running(self, producer: Producer) -> AsyncIterator[None]:
        """`async with producer`, with a deadline on its start and on its stop (a stop that
        hangs would otherwise only show as the whole session overrunning)."""
        limit = 3 * self.cfg.op_bound_s
        await self.bounded("producer start", producer.__aenter__(), limit)
        self.producer = producer
        try:
            yield
        except BaseException as exc:
            self.producer = None
            exit_call = producer.__aexit__(type(exc), exc, exc.__traceback__)
            await self.bounded("producer stop", exit_call, limit)
            raise
        self.producer = None
        await self.bounded("producer stop", producer.__aexit__(None, None, None), limit)

    def producer_stopped(self, engine: ChaosEngine, exc: ProducerError) -> str:
        """The producer stopped: expected after a death or a BaseException, a bug otherwise."""
        if self.killed_at is not None:
            self.event("death_surfaced", time.monotonic() - self.killed_at, str(exc)[:100])
            self.killed_at = None
        elif engine.injected[Fault.BASE]:
            self.event("base_exception_contained", note=str(exc)[:100])
        elif "every reward worker" in str(exc):  # hung sync rewards held every worker
            self.event("reward_workers_stuck", note=str(exc)[:100])
        else:
            self.fail("unexpected_stop", f"ProducerError: {exc}")
        return "producer_error"

    async def train(self, producer: Producer) -> str:
        """The trainer: batches until the prompts are used up or the session is told to end."""
        cfg = self.cfg
        while True:
            if self.stop_request is not None:
                return self.stop_request
            if self.killed_at is not None and time.monotonic() - self.killed_at > cfg.dead_bound_s:
                self.fail("dead_engine", f"no ProducerError {cfg.dead_bound_s:g} s after death")
                return "hang"
            if self.phase == "chaos" and self.now() >= cfg.duration_s:
                self.phase = "drain"
                self.prompts.close()
                self.calm()
                self.event("drain_start")
            if self.time_left() <= 0:
                return "out_of_time"
            try:
                batch = await self.bounded(
                    "produce_batch",
                    producer.produce_batch(timeout=cfg.batch_wait_s),
                    cfg.batch_wait_s + cfg.op_bound_s,
                )
            except TimeoutError:
                self.event("batch_wait_timeout")
                continue
            except StalledError as exc:
                if self.pausing_now:
                    self.event("stalled_while_paused")
                    await asyncio.sleep(0.05)
                    continue
                self.fail("stall", str(exc))
                return "stalled"
            except ProducerExhausted:
                self.finish(producer)
                return "exhausted"
            self.handed_out += len(batch.groups)
            for group in batch.groups:
                self.journal.append((group.prompt_id, "consumed"))
                problem = group_problem(group, batch.version)
                if problem is not None:
                    self.fail("well_formed", f"{group.prompt_id}: {problem}")
            del batch
            self.check_ledger(producer, "batch")
            await self.bounded("update_weights", producer.update_weights(None), cfg.op_bound_s)

    def finish(self, producer: Producer) -> None:
        """The prompts are used up: nothing may remain anywhere."""
        self.drained = True
        ledger = producer.check_ledger()
        left = {
            "in flight": ledger.in_flight_groups,
            "ready": ledger.ready_groups,
            "to resume": ledger.resume_groups,
        }
        if any(left.values()):
            self.fail("drain", f"exhausted with groups left: {left}")

    # -- the controller --------------------------------------------------------------------------

    async def control(self, producer: Producer, engine: ChaosEngine, n: int) -> None:
        """Random pauses, weight updates, checkpoints, restarts and deaths from another task."""
        rng = random.Random(f"{self.cfg.seed}/control/{n}")
        while True:
            await asyncio.sleep(rng.expovariate(1 / self.cfg.event_every_s))
            kinds = self.kept(CONTROL if self.phase == "chaos" else DRAIN_CONTROL)
            kind = rng.choices(list(kinds), list(kinds.values()))[0]
            try:
                latency = await self.control_event(kind, producer, engine, rng)
            except ProducerError as exc:
                self.event(kind, note=f"ProducerError: {exc}"[:100])
                return
            except Hang:
                self.stop_request = "hang"
                return
            except Exception as exc:
                self.fail("api", f"{kind} raised {type(exc).__name__}: {exc}")
                continue
            self.event(kind, latency)
            self.check_ledger(producer, kind)
            if kind in ("restart", "kill_engine"):
                return

    async def control_event(
        self, kind: str, producer: Producer, engine: ChaosEngine, rng: random.Random
    ) -> float:
        """Do one controller event; return how long the producer took to pause (or to do it)."""
        limit = self.cfg.op_bound_s
        start = time.monotonic()
        match kind:
            case "pause":
                self.pausing_now += 1
                try:
                    await self.bounded("pause", producer.pause(), limit)
                    latency = time.monotonic() - start
                    await asyncio.sleep(rng.uniform(0, 0.3))
                    await self.bounded("resume", producer.resume(), limit)
                finally:
                    self.pausing_now -= 1
                return latency
            case "pausing":
                return await self.bounded("pausing", self.hold_pause(producer, rng), 2 * limit)
            case "update_weights":
                await self.bounded("update_weights", producer.update_weights(None), limit)
            case "save" | "restart":
                await self.bounded("checkpoint", self.save(producer), 2 * limit)
                if kind == "restart":
                    self.stop_request = "restart"
            case "kill_engine":
                await engine.kill()
                self.killed_at = time.monotonic()
        return time.monotonic() - start

    async def hold_pause(self, producer: Producer, rng: random.Random) -> float:
        start = time.monotonic()
        self.pausing_now += 1
        try:
            async with producer.pausing():
                latency = time.monotonic() - start
                await asyncio.sleep(rng.uniform(0, 0.3))
        finally:
            self.pausing_now -= 1
        return latency

    async def save(self, producer: Producer) -> None:
        """Checkpoint the producer and note how much of the journal it covers. The trainer
        takes batches while the file is written (a pause does not stop hand-outs), so the
        journal's length after `save` may count batches the checkpoint still holds as ready;
        the checkpoint's own counters say how many endings it knows (every ending is one
        journal entry, in order).

        Each save writes a file of its own, which becomes the checkpoint only once noted: a
        save cancelled by its session's end may have written its file or not, and one
        written over the noted checkpoint's would be loaded with the journal cut to the
        older one's length (its endings since then lost)."""
        self.pausing_now += 1
        self.saves += 1
        path = str(self.workdir / f"producer-{self.saves}.ckpt")
        try:
            async with producer.pausing():
                await producer.save(path)
            c = loads(await asyncio.to_thread(Path(path).read_bytes)).counters
            covered = c.consumed_groups + c.failed_groups + c.filtered_groups
            assert covered <= len(self.journal), (covered, len(self.journal))
            previous, self.checkpoint = self.checkpoint, Checkpoint(path, covered)
            if previous is not None:
                _discard(previous.path)
        finally:
            self.pausing_now -= 1
            if self.checkpoint is None or self.checkpoint.path != path:  # not noted
                _discard(path)

    # -- sampling and results --------------------------------------------------------------------

    def sample(self) -> None:
        rss = rss_bytes()
        self.rss_peak = max(self.rss_peak, rss)
        self.samples.append(
            {
                "t_s": self.now(),
                "rss_mib": rss / MIB,
                "handed_out": self.handed_out,
                "ended": len(self.journal),
            }
        )

    async def sample_loop(self) -> None:
        while True:
            self.sample()
            if self.producer is not None:
                self.check_ledger(self.producer, "sample")
            await asyncio.sleep(self.cfg.sample_every_s)

    def final_checks(self) -> dict[str, Any]:
        """The checks that need the whole run; returns the run's summary numbers."""
        ends = Counter(prompt_id for prompt_id, _ in self.journal)
        ids = {ChaosPrompts.prompt_id(i) for i in range(self.prompts.drawn)}
        lost = sorted(ids - set(ends)) if self.drained else []
        duplicated = sorted(p for p, k in ends.items() if k > 1)
        unknown = sorted(set(ends) - ids)
        for name, bad in (("lost", lost), ("duplicated", duplicated), ("unknown", unknown)):
            if bad:
                self.fail("exactly_once", f"{len(bad)} prompts {name}: {bad[:5]}")
        injected = sum(faults[Fault.TIMEOUT] for faults in self.faults)
        if self.timeouts_reported < injected:
            self.fail(
                "engine_timeout",
                f"{injected - self.timeouts_reported} of {injected} TimeoutErrors raised by the "
                "engine were not reported with their message (taken for a generate deadline?)",
            )
        for n, deadlines in self.reward_deadlines.items():
            hangs = self.reward_kinds[n]["hang"]
            if deadlines > hangs + REWARD_DEADLINE_SLACK:
                self.fail(
                    "reward_threads",
                    f"session {n}: {deadlines} reward deadlines but {hangs} hung rewards: "
                    "rewards queued behind hung worker threads",
                )
        pauses = [e["latency_s"] for e in self.events if e["kind"] in PAUSE_LIKE]
        kinds = Counter(k for _, k in self.journal)
        return {
            "duration_s": self.now(),
            "sessions": self.sessions,
            "prompts": self.prompts.drawn,
            "drained": self.drained,
            "handed_out_final": kinds["consumed"],
            "failed_final": kinds[PutOutcome.DROPPED_FAILED.value],
            "filtered_final": kinds[PutOutcome.DROPPED_FILTERED.value],
            "handed_out_total": self.handed_out,
            "lost": len(lost) if self.drained else None,
            "duplicated": len(duplicated),
            "ledger_checks": self.ledger_checks,
            "max_pause_latency_s": max(pauses, default=float("nan")),
            "rss_start_mib": self.rss_start / MIB,
            "rss_peak_mib": self.rss_peak / MIB,
            "rss_end_mib": rss_bytes() / MIB,
            "failures": len(self.failures),
        }


def report(soak: Soak, summary: dict[str, Any], out: Path) -> None:
    info = run_info()
    text = f"## Producer chaos soak\n\n{info_line(info)}\n"
    by_check: dict[str, list[str]] = defaultdict(list)
    for f in soak.failures:
        by_check[f["check"]].append(f["detail"])
    rows: list[Sequence[Any]] = [
        (what, "FAIL" if fails else "ok", len(fails), (fails or [""])[0][:160])
        for key, what in CHECKS.items()
        for fails in [by_check[key]]
    ]
    text += print_section("Checks", ["check", "result", "failures", "first failure"], rows)
    rows = [(k, "n/a" if v is None else v) for k, v in summary.items()]
    text += print_section("Summary", ["metric", "value"], rows)
    latencies: dict[str, list[float]] = defaultdict(list)
    for e in soak.events:
        latencies[e["kind"]].append(e["latency_s"] if e["latency_s"] is not None else math.nan)
    rows = [
        (kind, len(v), float(np.nanmax(v)) if not np.isnan(v).all() else math.nan)
        for kind, v in sorted(latencies.items())
    ]
    text += print_section("Events by kind", ["event", "count", "max latency s"], rows)
    injected: Counter[str] = Counter()
    for faults in soak.faults:
        injected.update({f"engine: {k}": v for k, v in faults.items()})
    for kinds in soak.reward_kinds:
        injected.update({f"reward: {k}": v for k, v in kinds.items()})
    text += print_section("Injected", ["fault", "count"], sorted(injected.items()))
    payload = {
        "info": info,
        "config": msgspec.to_builtins(soak.cfg),
        "summary": summary,
        "failures": soak.failures,
        "events": soak.events,
        "samples": soak.samples,
        "injected": dict(injected),
    }
    save_report(out, "soak", figure(soak, summary, info), payload, text)


def figure(soak: Soak, summary: dict[str, Any], info: dict[str, Any]) -> Any:
    fig, (ax_rss, ax_groups) = new_figure(2, 1, width=10, height=3.4)
    t = [s["t_s"] for s in soak.samples]
    ax_rss.plot(t, [s["rss_mib"] for s in soak.samples], label="RSS")
    ax_groups.plot(t, [s["handed_out"] for s in soak.samples], label="groups handed out")
    ax_groups.plot(t, [s["ended"] for s in soak.samples], label="prompts ended (since ckpt)")
    marks = {
        "restart": "tab:blue",
        "kill_engine": "tab:red",
        "base_exception_contained": "tab:purple",
        "drain_start": "black",
    }
    for kind, color in marks.items():
        for i, x in enumerate(e["t_s"] for e in soak.events if e["kind"] == kind):
            ax_groups.axvline(x, color=color, alpha=0.5, lw=1, label=None if i else kind)
    fail_t = [f["t_s"] for f in soak.failures]
    if fail_t:
        top = max(s["rss_mib"] for s in soak.samples)
        ax_rss.plot(fail_t, [top] * len(fail_t), "rx", label="failed check")
    ax_rss.set(ylabel="MiB", title="Process memory")
    ax_groups.set(xlabel="seconds", ylabel="groups", title="Progress; events marked")
    for ax in (ax_rss, ax_groups):
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(alpha=0.3)
    verdict = f"{summary['failures']} failed checks" if summary["failures"] else "all checks ok"
    fig.suptitle(
        f"Producer chaos soak (SimEngine: a simulation): {verdict}\n"
        f"{summary['sessions']} sessions · {info['date']} · {info['commit']}",
        fontsize=9,
    )
    return fig


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="about 60 s (CI) instead of 10 min")
    p.add_argument("--duration-s", type=float, help="chaos phase (default 600; quick 45)")
    p.add_argument("--drain-s", type=float, help="time allowed to drain (default 60; quick 15)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--without",
        default="",
        help=f"comma-separated kinds to leave out, to see past a known defect: {', '.join(KINDS)}",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for PNG/JSON/MD")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = SoakConfig(
        duration_s=args.duration_s or (45.0 if args.quick else 600.0),
        drain_s=args.drain_s or (15.0 if args.quick else 60.0),
        seed=args.seed,
        without=tuple(k for k in args.without.split(",") if k),
    )
    unknown = sorted(set(cfg.without) - set(KINDS))
    if unknown:
        raise SystemExit(f"--without: unknown kinds {unknown}; known: {', '.join(KINDS)}")
    # The last line of defence: if the event loop itself stops answering, say so and exit.
    grace = cfg.duration_s + cfg.drain_s + 6 * cfg.op_bound_s + 30
    watchdog = threading.Timer(grace, _watchdog_fired, args=(grace,))
    watchdog.daemon = True
    watchdog.start()
    with tempfile.TemporaryDirectory(prefix="asyncroll-soak-") as tmp:
        soak = Soak(cfg, Path(tmp))
        asyncio.run(soak.run())
    summary = soak.final_checks()
    report(soak, summary, args.out)
    watchdog.cancel()
    return 1 if soak.failures else 0


def _watchdog_fired(grace: float) -> None:
    print(f"soak: still running after {grace:.0f} s: the event loop hangs; exiting", flush=True)
    os._exit(3)


def _calm(engine: ChaosEngine, rewards: HostileRewards) -> None:
    """Leave the fatal faults out of a running session, from the drain on."""
    for kind in FATAL:
        engine.rates.pop(kind, None)
        rewards.weights.pop(kind, None)
    engine.rates[Fault.NONE] = max(
        0.0, 1.0 - sum(w for k, w in engine.rates.items() if k != Fault.NONE)
    )


if __name__ == "__main__":
    sys.exit(main())
