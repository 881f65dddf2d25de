"""`Evaluator`: score a held-out prompt set at the current policy version, on the training
producer's own engine, without touching the run.

A second `Producer` on the training engine is refused (it would relabel the engine), and a
second engine costs a second copy of the weights. The evaluator instead sends its requests
through `Producer.guest_generate`: they share the engine and its gate (they start only while no
pause, update or save holds it; a drain aborts them with the run's groups), and nothing of the
run hears of them: its counters, versions, buffer, ledger and staleness figures are the same as
in a run without evaluation (`tests/test_evaluation.py` proves it on the simulation).

Every result carries the policy version its samples were sampled at, exactly: each token comes
back stamped with the version of the weights that sampled it (`Engine`), so a prompt whose
samples an update cut (aborted by its drain, or tokens of two versions) is run again, and so is
one sampled before a newer version that other prompts of the same evaluation reached. After
`max_reruns` such rounds the result says the policy kept moving (`EvalResult.error`) instead.

Prompts and engine output pass the producer's own checks (`rollout`): what the training path
would fail (bad ids or metadata, token ids outside the vocabulary, versions the engine never
had) fails the prompt before any reward sees it.

Failures are the result's, never the run's: a bad prompt, an engine error or deadline, a reward
function that raises or hangs fail that prompt (counted, with the reason, and logged as one
WARNING per evaluation with the first reason); a deadline for the whole evaluation, a producer
that stopped, every reward worker hung, or every prompt failed (scores that would only read
NaN) end it with `error` set. Nothing raises except
misuse at the call (`RuntimeError`: the producer is not running) and a cancellation.

Run it between training steps (`await evaluator.run()`; the producer keeps generating
meanwhile, within its staleness bound) or alongside training (in a task of its own); merge
`result.metrics()` (`eval/...`) into the step's `batch.metrics()`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal

import anyio
import msgspec
import numpy as np

from asyncroll._core import rollout
from asyncroll._core.causes import described
from asyncroll._core.engine_call import EngineCallError
from asyncroll._core.rewards import RewardDeadline, RewardFailure, RewardFn, RewardRunner
from asyncroll.engines.base import SamplingConfig
from asyncroll.outcomes import NOT_ABSORBED, cancelling
from asyncroll.prompts import PromptLike, as_prompt
from asyncroll.types import Prompt, RolloutGroup, Status

if TYPE_CHECKING:
    from asyncroll.producer import Producer

__all__ = ["EvalResult", "Evaluator", "Scores", "pass_at_k"]

log = logging.getLogger(__name__)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from `n` samples of which `c` passed (Chen et al.
    2021): 1 - C(n - c, k) / C(n, k), the chance that k samples drawn without replacement from
    the n hold at least one pass; computed as a product, so large n neither overflows nor
    loses precision."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


class Scores(msgspec.Struct, frozen=True, kw_only=True):
    """Scores over a set of prompts: the mean of each prompt's mean reward, and of each
    prompt's pass@k (a sample passes with a reward >= the evaluator's `pass_threshold`)."""

    prompts: int
    reward_mean: float
    pass_at_k: dict[int, float]


class EvalResult(msgspec.Struct, frozen=True, kw_only=True):
    """One evaluation. `version` is the policy version every scored sample was sampled at
    (None when none was scored); `scores` cover the prompts scored at it, `by_task` and `by`
    (metadata key -> value -> scores) break them down. `failed` maps a prompt id to why it
    failed; `incomplete` counts prompts left unscored at `version` when the evaluation ended
    early (`error` says why: its deadline, a policy that kept moving, a stopped producer).
    `reruns` counts prompts run again because an update cut them or left them behind.
    `groups` are the scored groups (samples with tokens and rewards), to inspect or decode."""

    name: str
    version: int | None
    scores: Scores
    by_task: dict[str, Scores]
    by: dict[str, dict[str, Scores]]
    failed: dict[str, str]
    incomplete: int
    reruns: int
    wall_s: float
    error: str | None
    groups: tuple[RolloutGroup, ...]

    def metrics(self) -> dict[str, float]:
        """A flat `{name: number}` dict to merge into the step's `batch.metrics()`:
        `<name>/version` (NaN when nothing was scored), `<name>/reward_mean`, `<name>/pass@<k>`,
        their `_by_task/<task>` and `_by_<key>/<value>` breakdowns, `<name>/prompts`,
        `<name>/failed_prompts`, `<name>/incomplete_prompts`, `<name>/reruns`,
        `<name>/wall_s` and `<name>/error` (1 when the evaluation ended early)."""
        p = self.name
        out: dict[str, float] = {
            f"{p}/version": math.nan if self.version is None else float(self.version),
            f"{p}/prompts": self.scores.prompts,
            f"{p}/failed_prompts": len(self.failed),
            f"{p}/incomplete_prompts": self.incomplete,
            f"{p}/reruns": self.reruns,
            f"{p}/wall_s": self.wall_s,
            f"{p}/error": float(self.error is not None),
        }
        out |= _flat(f"{p}/", "", self.scores)
        for task, scores in self.by_task.items():
            out |= _flat(f"{p}/", f"_by_task/{task}", scores)
        for key, values in self.by.items():
            for value, scores in values.items():
                out |= _flat(f"{p}/", f"_by_{key}/{value}", scores)
        return out


def _flat(prefix: str, suffix: str, scores: Scores) -> dict[str, float]:
    out = {f"{prefix}reward_mean{suffix}": scores.reward_mean}
    out |= {f"{prefix}pass@{k}{suffix}": v for k, v in scores.pass_at_k.items()}
    return out


class _Scored(msgspec.Struct, frozen=True):
    group: RolloutGroup
    version: int


class _Failed(msgspec.Struct, frozen=True):
    reason: str


class _Cut(msgspec.Struct, frozen=True):
    """An update cut the request (aborted by its drain, or tokens of two versions)."""


_Outcome = _Scored | _Failed | _Cut


class Evaluator:
    """Evaluates `prompts` (a finite set of `Prompt`s, mappings or token lists, as a
    `Producer` takes them) with `reward_fn` (a `RewardFn`, as the producer's) on `producer`'s
    engine; see the module docstring.

    `samples` per prompt: 1 samples greedily by default; more sample at the producer's
    temperature (`sampling` overrides either), refused at temperature 0 (n identical samples).
    Prompt ids must be unique: results are keyed by them. `k`: the pass@k to report, each
    <= `samples`. A sample passes with a reward >= `pass_threshold`. `by`: metadata keys to
    break the scores down by (besides the task). At most `concurrency` prompts are in the
    engine at once, each request within the producer's `generate_timeout_s` and each reward
    within its `reward_timeout_s`; the whole evaluation within `timeout_s` (waiting for a
    pause included). `name` prefixes the metrics ("eval": `eval/pass@1`). `reward_executor`
    ("thread" or "process"; default: the producer's) says where a sync `reward_fn` runs: in
    worker processes, a hung or crashing verifier is killed at its deadline and costs its
    prompt alone; the processes end with each `run()`."""

    def __init__(
        self,
        producer: Producer,
        prompts: Iterable[PromptLike],
        reward_fn: RewardFn,
        *,
        samples: int = 1,
        k: Sequence[int] = (1,),
        sampling: SamplingConfig | None = None,
        pass_threshold: float = 1.0,
        by: Sequence[str] = (),
        concurrency: int = 16,
        timeout_s: float = 600.0,
        max_reruns: int = 3,
        name: str = "eval",
        reward_executor: Literal["thread", "process"] | None = None,
    ) -> None:
        self.prompts: list[Prompt] = [
            as_prompt(p, "default", i) for i, p in enumerate(prompts)
        ]  # a finite set, read once: an endless source would never finish here
        if not self.prompts:
            raise ValueError("Evaluator needs at least one prompt")
        _check_unique_ids(self.prompts)
        if not isinstance(samples, int) or samples < 1:
            raise ValueError(f"samples={samples!r}: must be an integer >= 1")
        bad_k = [x for x in k if not isinstance(x, int) or not 1 <= x <= samples]
        if not k or bad_k:
            raise ValueError(
                f"k={tuple(k)}: each pass@k needs 1 <= k <= samples={samples}; raise samples "
                "or drop the larger k"
            )
        cfg = producer.config
        given = sampling is not None
        if sampling is None:
            sampling = cfg.sampling
            if samples == 1:
                sampling = msgspec.structs.replace(sampling, temperature=0.0)
        if samples > 1 and sampling.temperature == 0:
            whose = "" if given else " (the producer's sampling)"
            raise ValueError(
                f"samples={samples} with temperature 0{whose}: greedy samples are all the same; "
                "pass sampling= with a temperature > 0, or evaluate with samples=1"
            )
        warning = rollout.budget_warning(sampling, producer.engine.max_model_len)
        if given and warning is not None:  # the producer's own sampling warned already
            log.warning("Evaluator: %s", warning)
        if not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency={concurrency!r}: must be an integer >= 1")
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"timeout_s={timeout_s}: must be a positive number of seconds")
        if not isinstance(max_reruns, int) or max_reruns < 0:
            raise ValueError(f"max_reruns={max_reruns!r}: must be an integer >= 0")
        if not name or "/" in name:
            raise ValueError(f"name={name!r}: must be a non-empty metrics prefix without '/'")
        if not math.isfinite(pass_threshold):
            raise ValueError(f"pass_threshold={pass_threshold}: must be a finite number")
        self.producer = producer
        self.samples = samples
        self.k = tuple(sorted(set(k)))
        self.sampling = sampling
        self.pass_threshold = pass_threshold
        self.by = tuple(by)
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.max_reruns = max_reruns
        self.name = name
        executor = cfg.reward_executor if reward_executor is None else reward_executor
        if executor not in ("thread", "process"):
            raise ValueError(f"reward_executor={executor!r}: use 'thread' or 'process'")
        self._rewards = RewardRunner(
            reward_fn,
            timeout_s=cfg.reward_timeout_s,
            workers=cfg.reward_workers,
            in_thread=cfg.reward_in_thread or executor == "process",
            executor=executor,
            max_calls=cfg.reward_worker_max_calls,
            max_rss_mib=cfg.reward_worker_max_mib,
        )
        self._runs = 0

    async def run(self) -> EvalResult:
        """Evaluate every prompt at the policy's current version (see the module docstring)."""
        if not self.producer.running:
            raise RuntimeError("evaluate inside `async with producer:` (it is not running)")
        start = time.monotonic()
        self._runs += 1
        run_id = f"{self.name}-{uuid.uuid4().hex[:8]}-{self._runs}"
        outcomes: dict[int, _Outcome] = {}
        todo = list(range(len(self.prompts)))
        reruns, rounds, error = 0, 0, None
        with anyio.move_on_after(self.timeout_s) as deadline:
            while todo:
                if rounds > self.max_reruns:
                    error = (
                        f"the policy changed during the evaluation {rounds} times (max_reruns="
                        f"{self.max_reruns}): evaluate between updates, or raise max_reruns"
                    )
                    break
                reruns += len(todo) if rounds else 0
                await self._round(todo, outcomes, f"{run_id}-r{rounds}")
                rounds += 1
                todo = self._left(outcomes)
                if self._stopped():
                    error = "the producer stopped during the evaluation"
                    break
                if (stuck := self._rewards.stuck_error()) is not None:
                    error = stuck
                    break
        if deadline.cancelled_caught:
            error = f"the evaluation did not finish within timeout_s={self.timeout_s}"
        failures = [o.reason for o in outcomes.values() if isinstance(o, _Failed)]
        if error is None and failures and len(failures) == len(self.prompts):
            n = len(failures)
            error = f"every prompt failed ({n} of {n}); the first: {failures[0]}"
        if failures:  # the scores alone would read as NaN, or as fewer prompts, without a word
            log.warning(
                "%s: %d of %d prompts failed; the first: %s (EvalResult.failed has each reason)",
                self.name, len(failures), len(self.prompts), failures[0][:300],
            )  # fmt: skip
        return self._result(outcomes, reruns, error, time.monotonic() - start)

    def _stopped(self) -> bool:
        return not self.producer.running

    @staticmethod
    def _left(outcomes: dict[int, _Outcome]) -> list[int]:
        """Prompts to run again: those an update cut, and those scored at an older version
        than the newest any prompt reached."""
        newest = max((o.version for o in outcomes.values() if isinstance(o, _Scored)), default=0)
        return sorted(
            i
            for i, o in outcomes.items()
            if isinstance(o, _Cut) or (isinstance(o, _Scored) and o.version < newest)
        )

    async def _round(self, todo: list[int], outcomes: dict[int, _Outcome], tag: str) -> None:
        limiter = anyio.CapacityLimiter(self.concurrency)

        async def one(i: int) -> None:
            async with limiter:
                if not self.producer.running:
                    return
                outcomes[i] = await self._one(i, f"{tag}-{i}")

        try:
            async with anyio.create_task_group() as tg:
                for i in todo:
                    tg.start_soon(one, i)
        finally:
            self._rewards.close()  # no reward worker process outlives a round

    async def _one(self, i: int, request_id: str) -> _Outcome:
        """Sample and score prompt `i` once."""
        producer, prompt = self.producer, self.prompts[i]
        engine = producer.engine
        try:  # the producer's checks of a prompt (`admission`): a bad one fails alone
            rollout.check_prompt_fields(prompt)
            tokens = rollout.prompt_array(prompt.tokens, engine.vocab_size, engine.max_model_len)
        except rollout.RolloutError as exc:
            return _Failed(f"bad_prompt: {exc}")
        before = producer.version
        group = RolloutGroup(
            uid=i,
            prompt_id=str(prompt.prompt_id),
            task=prompt.task,
            prompt_tokens=tokens,
            samples=rollout.fresh_samples(self.samples),
            metadata=prompt.metadata,
            start_version=before,
        )
        budget = rollout.token_budget(group, self.sampling, engine.max_model_len)
        request = rollout.build_request(group, request_id, self.sampling, budget)
        try:
            outputs = await producer.guest_generate(request)
        except EngineCallError as exc:
            return _Failed(f"{exc.reason.value}: {exc.message}")
        except RuntimeError:  # the producer stopped while it waited: `run` says so
            return _Cut()
        try:  # the training path's checks of engine output, against the version now
            states = rollout.merge_outputs(
                group, request, outputs, vocab_size=engine.vocab_size, version=producer.version
            )
        except (ValueError, TypeError) as exc:
            return _Failed(f"malformed_output: {exc}")
        del outputs
        if any(s.status is not Status.COMPLETED for s in states):
            return _Cut()  # an abort cut a sample
        versions = np.unique(np.concatenate([s.versions for s in states]))
        if len(versions) > 1:
            return _Cut()
        if len(versions):
            version = int(versions[0])
        elif before == producer.version:  # no token to tell: the label around the call
            version = before
        else:
            return _Cut()
        group = msgspec.structs.replace(
            group, samples=states, status=Status.COMPLETED, start_version=version
        )
        try:
            rewards = rollout.check_rewards(await self._rewards.score(group), self.samples)
        except RewardDeadline as exc:
            return _Failed(f"reward_deadline: reward function {self._rewards.name!r} {exc}")
        except RewardFailure as exc:  # raised in, or crashed, its worker; or every worker hung
            return _Failed(f"reward_error: reward function {self._rewards.name!r} {exc}")
        except asyncio.CancelledError:
            if cancelling():
                raise
            return _Failed("reward_error: the reward function raised CancelledError")
        except NOT_ABSORBED:
            raise
        except rollout.RolloutError as exc:
            return _Failed(f"reward_error: {exc}")
        except Exception as exc:
            return _Failed(
                f"reward_error: reward function {self._rewards.name!r} raised {described(exc)}"
            )
        scored = msgspec.structs.replace(group, samples=rollout.with_rewards(states, rewards))
        return _Scored(scored, version)

    def _result(
        self, outcomes: dict[int, _Outcome], reruns: int, error: str | None, wall_s: float
    ) -> EvalResult:
        failed = {
            str(self.prompts[i].prompt_id): o.reason
            for i, o in outcomes.items()
            if isinstance(o, _Failed)
        }
        scored = [o for o in outcomes.values() if isinstance(o, _Scored)]
        version = max((o.version for o in scored), default=None)
        groups = tuple(
            o.group for i, o in sorted(outcomes.items()) if isinstance(o, _Scored)
            if o.version == version
        )  # fmt: skip
        incomplete = len(self.prompts) - len(failed) - len(groups)
        by_task: dict[str, list[RolloutGroup]] = {}
        by: dict[str, dict[str, list[RolloutGroup]]] = {key: {} for key in self.by}
        for g in groups:
            by_task.setdefault(g.task, []).append(g)
            for key in self.by:
                if key in g.metadata:
                    by[key].setdefault(str(g.metadata[key]), []).append(g)
        return EvalResult(
            name=self.name,
            version=version,
            scores=self._scores(groups),
            by_task={t: self._scores(gs) for t, gs in sorted(by_task.items())},
            by={
                key: {v: self._scores(gs) for v, gs in sorted(values.items())}
                for key, values in by.items()
            },
            failed=failed,
            incomplete=incomplete,
            reruns=reruns,
            wall_s=wall_s,
            error=error,
            groups=groups,
        )

    def _scores(self, groups: Sequence[RolloutGroup]) -> Scores:
        if not groups:
            return Scores(
                prompts=0, reward_mean=math.nan, pass_at_k=dict.fromkeys(self.k, math.nan)
            )
        rewards = np.array([[s.reward for s in g.samples] for g in groups], dtype=np.float64)
        passes = (rewards >= self.pass_threshold).sum(axis=1)
        n = self.samples
        return Scores(
            prompts=len(groups),
            reward_mean=float(rewards.mean()),
            pass_at_k={
                k: float(np.mean([pass_at_k(n, int(c), k) for c in passes])) for k in self.k
            },
        )


def _check_unique_ids(prompts: Sequence[Prompt]) -> None:
    """`ValueError` naming the first prompt id given twice: results are keyed by id (`failed`,
    the reruns), so two prompts under one id would count as one."""
    first: dict[str | None, int] = {}
    for i, p in enumerate(prompts):
        j = first.setdefault(p.prompt_id, i)
        if j != i:
            raise ValueError(
                f"prompt id {p.prompt_id!r} (prompts {j} and {i}) is given twice: the results "
                "are keyed by prompt id; build each prompt set with a task= of its own (e.g. "
                "chat_prompts(rows, tokenizer, task='math')) or give each prompt a unique "
                "prompt_id"
            )
