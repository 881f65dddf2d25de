"""`asyncroll demo`: GRPO on the tiny local model, on CPU, with real vLLM rollouts.

The task ("echo") is one a 361k-parameter random-init model can learn in a few minutes on two
cores: the prompt is a letter and a colon ("q:"), the reward is the fraction of response tokens
that are that letter. A random policy scores ~1/500; echoing the prompt's letter scores 1. The
reward can only rise if every piece works: rollouts from vLLM, rewards, GRPO advantages, the
trainer's update, and the weight sync back into vLLM (a broken sync keeps sampling the initial
random policy, so the reward stays flat). That makes the short version an end-to-end test.

Generation overlaps training: the trainer's step runs in a worker thread while the event loop
keeps vLLM busy, within `max_staleness` policy versions. Tokens sampled by older weights are
corrected for with `--correction` (a preset of `asyncroll.train.loss.CORRECTIONS`), and every step
logs how far the behaviour policy was from the trainer's (`offpolicy/...` in metrics.jsonl).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TextIO

import msgspec
import numpy as np
import psutil

from asyncroll import ProduceBatchResult
from asyncroll.engines.base import SamplingConfig, Weights
from asyncroll.lora import VLLM_MAX_RANKS, LoraAdapter, LoraConfig, LoraSlots
from asyncroll.train.turns import TurnRewards, failed_tokens, token_entropy, turn_loss
from asyncroll.types import Prompt, RolloutGroup

if TYPE_CHECKING:
    from asyncroll.engines import VLLMEngine

LETTERS = "abcdefgh"
TASKS = ("echo", "tool_echo", "chat", "openai_echo")
CREDITS = ("turn", "episode")
ENTROPY_ON = ("all", "failed")  # --entropy-on: the tokens the entropy bonus is the mean over
FILTERS = ("nonzero_std", "none")  # --filter: an `asyncroll.filters` name, or keep every group
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The --lora demo's base model: the tiny model with weights drawn 5x larger. An adapter cannot
# change the frozen embedding that the tied head scores with, nor the final norm: at the
# default init (std 0.02) no logit can exceed ~128 x 0.02 = 2.6 (an adapter trained to echo by
# cross-entropy plateaued at p = 2.4%; a pretrained head has no such cap). At std 0.1: ~13.
LORA_BASE_INIT = 0.1
LORA_DEFAULTS: Final = {"filter": "none", "entropy": 0.03, "steps": 150}
"""--lora's defaults where they differ from `DemoConfig`'s; the command line and `demo_config`
apply them (a flag given wins). Once the policy answers a letter with one wrong letter in every
sample, each of that letter's groups scores 0: the `nonzero_std` filter would drop them, that
letter would get no gradient again (seed 2 stalled at 0.25) and steps slow to 10-18 s. Kept
("none"), those groups carry the entropy bonus's gradient, which spreads the stuck letter's
answers until a sample hits it; the entropy bonus alone (with the filter) still stalled seed 1
at 0.4. Keeping every group makes a step ~0.5 s, so 150 steps fit in under two minutes;
benchmarks/results/demo-runs.md has every run."""


class DemoConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Flags of `asyncroll demo`; defaults fit 2 cores and finish in a few minutes."""

    steps: int = 80
    group_size: int = 8
    batch_groups: int = 16
    max_new_tokens: int = 8
    max_staleness: int = 1
    lr: float = 3e-3
    seed: int = 0
    out: str = "runs/demo"
    checkpoint_every: int = 0  # steps between checkpoints (0: none)
    resume: bool = False
    solved_reward: float = 0.98  # stop once the last 3 steps average this (0: never)
    batch_timeout_s: float = 120.0  # a batch that cannot fill (everything filtered) ends the run
    correction: str = "tis"  # off-policy correction, a key of asyncroll.train.loss.CORRECTIONS
    # "echo" (single turn), "tool_echo" (multi-turn, asyncroll.app.demo_tool), "chat"
    # (asyncroll.app.demo_chat) or "openai_echo" (tool_echo by an OpenAI-client agent,
    # asyncroll.app.demo_openai)
    task: str = "echo"
    # tool_echo, openai_echo: GRPO advantages per policy turn ("turn") or one per episode
    credit: str = "turn"
    # weight of the policy's mean entropy at the trained tokens, added to the objective (0: none)
    entropy: float = 0.0
    # where the bonus applies: "all" trained tokens, or only those of the problems (group, or
    # group and turn with per-turn credit) whose samples all failed (asyncroll.train.failed_tokens)
    entropy_on: str = "all"
    # "nonzero_std": drop groups whose samples all scored the same (zero GRPO advantage);
    # "none": train on them too (their only gradient is then the entropy bonus's)
    filter: str = "nonzero_std"
    # Train a LoRA adapter of the attention and MLP projections instead of every weight, and
    # move only the adapter into vLLM each step (asyncroll.train.lora; docs/lora-training.md).
    lora: bool = False
    lora_rank: int = 8
    lora_alpha: float = 16.0
    # chat: evaluate greedily on the held-out questions every this many steps, and before the
    # first (0: never); stop once an evaluation's accuracy reaches `solved_accuracy` (0: never)
    eval_every: int = 0
    solved_accuracy: float = 0.9

    def __post_init__(self) -> None:
        for name in ("steps", "group_size", "batch_groups", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.group_size < 2:
            raise ValueError("--group-size must be >= 2: GRPO compares samples within a group")
        if self.max_staleness < 0 or not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError("--max-staleness must be >= 0 and --lr a positive number")
        if self.eval_every < 0:
            raise ValueError("--eval-every must be >= 0 (0: no evaluation)")
        if self.eval_every and self.task != "chat":
            raise ValueError("--eval-every needs a held-out set: only --task chat has one")
        if not (self.entropy >= 0 and math.isfinite(self.entropy)):
            raise ValueError("--entropy must be a finite number >= 0")
        from asyncroll.train import CORRECTIONS

        if self.correction not in CORRECTIONS:
            raise ValueError(f"--correction must be one of {', '.join(CORRECTIONS)}")
        if self.task not in TASKS:
            raise ValueError(f"--task must be one of {', '.join(TASKS)}")
        if self.entropy_on not in ENTROPY_ON:
            raise ValueError(f"--entropy-on must be one of {', '.join(ENTROPY_ON)}")
        if self.credit not in CREDITS:
            raise ValueError(f"--credit must be one of {', '.join(CREDITS)}")
        if self.filter not in FILTERS:
            raise ValueError(f"--filter must be one of {', '.join(FILTERS)}")
        if not 1 <= self.lora_rank <= max(VLLM_MAX_RANKS):
            raise ValueError(f"--lora-rank must be in 1..{max(VLLM_MAX_RANKS)} (vLLM's largest)")
        if not (self.lora_alpha > 0 and math.isfinite(self.lora_alpha)):
            raise ValueError("--lora-alpha must be a positive number")

    def lora_config(self) -> LoraConfig | None:
        """The adapter trained with --lora (None: full fine-tuning)."""
        if not self.lora:
            return None
        return LoraConfig(rank=self.lora_rank, alpha=self.lora_alpha, target_modules=LORA_TARGETS)


def demo_config(**options: Any) -> DemoConfig:
    """The config of `asyncroll demo`: `options` over the task's own defaults (tool_echo's are
    `asyncroll.app.demo_tool.DEFAULTS`) and --lora's (`LORA_DEFAULTS`) over `DemoConfig`'s.
    `DemoConfig(...)` alone keeps the echo task's full fine-tuning defaults whatever it is told."""
    from asyncroll.app import demo_chat, demo_openai, demo_tool

    task_defaults: dict[str, Mapping[str, Any]] = {
        "tool_echo": demo_tool.DEFAULTS,
        "chat": demo_chat.DEFAULTS,
        "openai_echo": demo_openai.DEFAULTS,
    }
    defaults: dict[str, Any] = dict(task_defaults.get(options.get("task", "echo"), {}))
    if options.get("lora"):
        defaults.update(LORA_DEFAULTS)
    return DemoConfig(**{**defaults, **options})


class StepRecord(msgspec.Struct, kw_only=True):
    """What the demo logs per training step (also written to metrics.jsonl)."""

    step: int
    version: int
    reward: float
    train_s: float
    wait_s: float
    wall_s: float
    tokens_per_s: float
    failed_groups: int
    filtered_groups: int
    expired_groups: int
    rss_mib: float
    loss: float
    staleness_mean: float
    idle_s: float  # time with no group in flight since the previous step
    offpolicy: dict[str, float]  # asyncroll.train.loss.mismatch_metrics of the step's batch
    tokens: int = 0  # response tokens of the batch (what the step trained on)
    # the task's own view of the batch (tool_echo: `asyncroll.app.demo_tool.step_metrics`) and the
    # policy's mean entropy at the trained tokens ("entropy")
    task_metrics: dict[str, float] = msgspec.field(default_factory=dict)


class EvalRecord(msgspec.Struct, kw_only=True):
    """One evaluation on the held-out set (also written to eval.jsonl): after `step` training
    steps, at policy `version`; `accuracy` is its pass@1 (greedy), `train_wall_s` the training
    loop's wall time so far (evaluations included)."""

    step: int
    version: int | None
    accuracy: float
    reward: float
    eval_s: float
    train_wall_s: float
    metrics: dict[str, float]


def echo_prompts(tokenizer: Any, seed: int) -> Iterator[Prompt]:
    """Endless seeded stream of "x:" prompts with the letter's token id as the label."""
    rng = random.Random(seed)
    bos = tokenizer.token_to_id("<|bos|>")
    for index in range(1 << 62):
        letter = rng.choice(LETTERS)
        ids = [bos, *tokenizer.encode(f"{letter}:").ids]
        yield Prompt(
            tokens=ids,
            task="echo",
            prompt_id=f"echo/{index}",
            metadata={"target": tokenizer.token_to_id(letter)},
        )


def echo_reward(group: RolloutGroup) -> list[float]:
    """Fraction of response tokens equal to the prompt's letter token."""
    target = group.metadata["target"]
    return [float(np.mean(s.tokens == target)) if len(s.tokens) else 0.0 for s in group.samples]


def tree_rss_mib() -> float:
    """RSS of this process and its children (vLLM runs its engine core and worker there)."""
    me = psutil.Process()
    total: int = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            continue
    return total / 2**20


class Trainer:
    """A plain torch GRPO trainer of the HF model, in this process.

    With `turn_rewards` (multi-turn credit), each policy turn is its own GRPO problem: its
    tokens get the advantage of that turn's reward within the group, not the episode's. One
    reward for the whole episode credits every turn with the other turns' luck: in tool_echo
    (three turns, each echoing its own letter) the per-turn hit rates stalled together near the
    1/8 of a policy that says letters at random, with masks, turn boundaries and logprobs right
    (KL at staleness 0 ~1e-13)."""

    def __init__(
        self,
        model_dir: Path,
        lr: float,
        seed: int,
        sampling: SamplingConfig,
        correction: str,
        turn_rewards: TurnRewards | None = None,
        entropy: float = 0.0,
        lora: LoraConfig | None = None,
        entropy_on: str = "all",
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from asyncroll.train import CORRECTIONS, trainable_parameters, wrap_lora

        torch.manual_seed(seed)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        self.lora = lora
        if lora is not None:  # the base weights freeze; AdamW holds only A and B
            wrap_lora(self.model, lora)
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            trainable_parameters(self.model), lr=lr, weight_decay=0.0
        )
        self.sampling = sampling
        self.correction = CORRECTIONS[correction]
        self.turn_rewards = turn_rewards
        self.entropy = entropy
        self.entropy_on = entropy_on
        # the last step's mean entropy at the trained tokens, and at those of failed problems
        self.last_entropy = math.nan
        self.last_failed_entropy = math.nan

    def step(self, groups: list[RolloutGroup], version: int) -> tuple[float, dict[str, float]]:
        """One optimizer step on the batch; `version` is the policy version of the current
        weights. Returns the loss and the batch's mismatch metrics."""
        from asyncroll.train import mismatch_metrics, policy_loss, to_batch, token_logprobs

        batch = to_batch(groups, advantage="grpo", pad_id=2)
        logits = self.model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()
        ).logits
        s = self.sampling  # the trainer's policy must be the distribution vLLM sampled from
        logprobs = token_logprobs(
            logits, batch.input_ids, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k
        )
        # One optimizer step per batch: the weights before it (the proximal policy) are the
        # current ones, so their logprobs are these, detached; no second forward pass.
        proximal = logprobs.detach()
        anchor = proximal if self.correction is not None else None
        if self.turn_rewards is None:
            loss, _ = policy_loss(
                logprobs, batch, correction=self.correction, proximal_logprobs=anchor
            )
        else:
            loss = turn_loss(logprobs, batch, groups, self.turn_rewards, self.correction, anchor)
        per_token = token_entropy(logits, s.temperature)
        failed = failed_tokens(batch, groups, self.turn_rewards)
        entropy, failed_entropy = (
            (per_token * m).sum() / m.sum().clamp(min=1) for m in (batch.loss_mask, failed)
        )
        if self.entropy:
            loss = loss - self.entropy * (entropy if self.entropy_on == "all" else failed_entropy)
        metrics = mismatch_metrics(proximal, batch, version=version, correction=self.correction)
        self.last_entropy = float(entropy.detach())
        self.last_failed_entropy = float(failed_entropy.detach()) if failed.any() else math.nan
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        self.torch.nn.utils.clip_grad_norm_(self.optimizer.param_groups[0]["params"], 1.0)
        self.optimizer.step()
        return float(loss.detach()), metrics

    def weights(self) -> Weights | LoraAdapter:
        """What the engine needs to serve the trainer's policy: with LoRA the adapter alone
        (the base weights never change), else every parameter."""
        if self.lora is not None:
            from asyncroll.train import adapter_of

            return adapter_of(self.model)
        return [(n, p.detach()) for n, p in self.model.named_parameters()]

    def save(self, path: Path, step: int) -> None:
        self.torch.save(
            {"model": self.model.state_dict(), "optim": self.optimizer.state_dict(), "step": step},
            path,
        )

    def load(self, path: Path) -> int:
        state = self.torch.load(path, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        return int(state["step"])


def demo_model(cfg: DemoConfig) -> Path:
    """The folder of the tiny model `cfg` trains (built on first use): its seed's, with a
    larger initialisation under --lora."""
    from asyncroll.app.models import TinyModelConfig, build_tiny_model

    base = TinyModelConfig(seed=cfg.seed)
    if cfg.lora:
        base = msgspec.structs.replace(base, initializer_range=LORA_BASE_INIT)
    return build_tiny_model(base)


async def run_demo(
    cfg: DemoConfig,
    *,
    progress: bool = True,
    console: TextIO | None = None,
    engine: VLLMEngine | None = None,
) -> list[StepRecord]:
    """Train for `cfg.steps` steps; write metrics.jsonl, summary and a PNG to `cfg.out`.
    The progress bar and the summary go to `console` (default: stdout).

    `engine`: run on this engine, left open (it must serve `demo_model(cfg)`'s weights at
    version 0, with LoRA slots under --lora), instead of starting one (11-20 s on 2 CPU
    cores): the tests share one."""
    console = console or sys.stdout
    import torch
    from tokenizers import Tokenizer
    from tqdm import tqdm

    from asyncroll.engines import VLLMEngine
    from asyncroll.evaluation import Evaluator
    from asyncroll.producer import Producer

    torch.set_num_threads(1)  # vLLM's worker holds the other core
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, before anything runs
    model_dir = demo_model(cfg)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens)
    step = 0
    turn_rewards: TurnRewards | None = None
    chat: Any = None
    serving: contextlib.AbstractAsyncContextManager[Any] = contextlib.nullcontext()
    task_metrics: Callable[[list[RolloutGroup]], dict[str, float]] = _no_task_metrics
    if cfg.task == "tool_echo":
        from asyncroll.app import demo_tool

        turn_rewards = demo_tool.turn_rewards if cfg.credit == "turn" else None

        prompts: Iterator[Prompt] = demo_tool.tool_echo_prompts(tokenizer, cfg.seed)
        reward: Any = demo_tool.tool_echo_reward
        episodes: dict[str, Any] = {
            "rollout_fn": demo_tool.tool_echo_agent,
            "max_turns": demo_tool.TURNS,
            "max_episode_tokens": demo_tool.episode_tokens(cfg.max_new_tokens),
        }
        task_metrics = demo_tool.step_metrics
    elif cfg.task == "openai_echo":
        from asyncroll.app import demo_openai

        agents = demo_openai.OpenAIEchoTask(model_dir, tokenizer, cfg.seed, sampling)
        turn_rewards = agents.turn_rewards if cfg.credit == "turn" else None
        prompts, reward, episodes = agents.prompts(), agents.reward, agents.episodes()
        serving = agents.serving()  # the endpoint the agents call, around the producer's run
        task_metrics = demo_openai.step_metrics
    elif cfg.task == "chat":
        from asyncroll.app.demo_chat import ChatTask

        chat = ChatTask(model_dir, cfg.seed)
        prompts, reward, episodes = chat.prompts(), chat.reward, {}
    else:
        prompts, reward, episodes = echo_prompts(tokenizer, cfg.seed), echo_reward, {}
    lora = cfg.lora_config()
    trainer = Trainer(
        model_dir, cfg.lr, cfg.seed, sampling, cfg.correction, turn_rewards, cfg.entropy, lora,
        cfg.entropy_on,
    )  # fmt: skip
    if engine is None:
        slots = _lora_engine_args(lora, cfg.max_staleness)
        context: contextlib.AbstractAsyncContextManager[VLLMEngine] = VLLMEngine(
            model_dir, seed=cfg.seed, **slots
        )
    elif engine.version != 0:
        raise ValueError(f"the engine given serves version {engine.version}: give it at 0")
    else:
        context = contextlib.nullcontext(engine)  # the caller's: left open
    async with context as engine, serving:
        producer = Producer(
            engine,
            prompts,
            reward,
            **episodes,
            group_size=cfg.group_size,
            batch_size=cfg.batch_groups,
            max_staleness=cfg.max_staleness,
            sampling=sampling,
            filter=None if cfg.filter == "none" else cfg.filter,
            reward_in_thread=False,  # a few numpy ops: cheaper inline than a thread hop
        )
        if cfg.resume:  # the engine gets the trainer's weights at the checkpoint's version
            step = trainer.load(out / "trainer.pt")
            producer.load(out / "producer.ckpt", weights=trainer.weights())
        records: list[StepRecord] = []
        staleness: Counter[int] = Counter()
        bar = tqdm(
            total=cfg.steps, initial=step, disable=not progress, desc=f"GRPO {cfg.task}",
            file=console,
        )  # fmt: skip
        evaluator = (
            Evaluator(producer, chat.held_out, chat.reward) if chat and cfg.eval_every else None
        )
        evals: list[EvalRecord] = []
        loop_start = time.perf_counter()

        async def evaluate() -> None:
            assert evaluator is not None
            result = await evaluator.run()
            evals.append(_eval_record(step, result, time.perf_counter() - loop_start))
            _log(out, evals[-1], "eval.jsonl")
            bar.write(_eval_line(evals[-1], result.error), file=console)

        async with producer:
            if evaluator is not None and step % cfg.eval_every == 0:
                await evaluate()
            while (
                step < cfg.steps
                and not _solved(records, cfg.solved_reward)
                and not _accurate(evals, cfg.solved_accuracy)
            ):
                start = time.perf_counter()
                try:
                    batch = await producer.produce_batch(timeout=cfg.batch_timeout_s)
                except TimeoutError:
                    print(
                        f"no batch within {cfg.batch_timeout_s} s (the filter drops every "
                        "group: the task is solved or the policy collapsed); stopping",
                        file=console,
                    )
                    break
                waited = time.perf_counter() - start
                staleness.update(batch.staleness_tokens())
                train_start = time.perf_counter()
                loss, offpolicy = await asyncio.to_thread(trainer.step, batch.groups, batch.version)
                train_s = time.perf_counter() - train_start
                await producer.update_weights(trainer.weights())
                step += 1
                records.append(_record(step, batch, loss, offpolicy, train_s, waited, start))
                records[-1].task_metrics = {
                    "entropy": trainer.last_entropy,
                    "entropy_failed": trainer.last_failed_entropy,
                    **task_metrics(batch.groups),
                }
                _log(out, records[-1])
                bar.update(1)
                bar.set_postfix(_postfix(records[-1]))
                if evaluator is not None and step % cfg.eval_every == 0:
                    await evaluate()
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    async with producer.pausing():
                        trainer.save(out / "trainer.pt", step)
                        await producer.save(out / "producer.ckpt")
            if evaluator is not None and (not evals or evals[-1].step != step):
                await evaluate()  # the last evaluation is of the final policy
        bar.close()
        producer.check_ledger()
    _summarise(out, records, producer.progress.counters.copy(), staleness, cfg.task, console, evals)
    return records


def _no_task_metrics(groups: list[RolloutGroup]) -> dict[str, float]:
    return {}


def _lora_engine_args(lora: LoraConfig | None, max_staleness: int) -> dict[str, Any]:
    """VLLMEngine's arguments to serve `lora` adapters (none without LoRA): vLLM's smallest
    maximum rank that fits, and a slot per version that may be in flight."""
    if lora is None:
        return {}
    max_rank = min(r for r in VLLM_MAX_RANKS if r >= lora.rank)
    return {"lora": LoraSlots(max_rank=max_rank, slots=max(2, max_staleness + 1))}


def _accurate(evals: list[EvalRecord], threshold: float) -> bool:
    return threshold > 0 and bool(evals) and evals[-1].accuracy >= threshold


def _eval_record(step: int, result: Any, train_wall_s: float) -> EvalRecord:
    metrics = result.metrics()
    return EvalRecord(
        step=step,
        version=result.version,
        accuracy=metrics["eval/pass@1"],
        reward=metrics["eval/reward_mean"],
        eval_s=result.wall_s,
        train_wall_s=train_wall_s,
        metrics=metrics,
    )


def _eval_line(e: EvalRecord, error: str | None) -> str:
    line = (
        f"eval after step {e.step} (version {e.version}): accuracy {e.accuracy:.3f}, "
        f"reward {e.reward:.3f} ({e.eval_s:.1f} s)"
    )
    return line if error is None else f"{line}; ended early: {error}"


def _solved(records: list[StepRecord], threshold: float) -> bool:
    recent = [r.reward for r in records[-3:]]
    return threshold > 0 and len(recent) == 3 and float(np.mean(recent)) >= threshold


def _record(
    step: int,
    batch: ProduceBatchResult,
    loss: float,
    offpolicy: dict[str, float],
    train_s: float,
    waited: float,
    start: float,
) -> StepRecord:
    m = batch.metrics()
    return StepRecord(
        step=step,
        version=batch.version,
        reward=_population_reward(batch),
        train_s=train_s,
        wait_s=waited,
        wall_s=time.perf_counter() - start,
        tokens_per_s=m["rollout/tokens_per_s"],
        failed_groups=int(batch.totals.failed_groups),
        filtered_groups=int(batch.totals.filtered_groups),
        expired_groups=int(batch.totals.expired_groups),
        rss_mib=tree_rss_mib(),
        loss=loss,
        staleness_mean=m["rollout/staleness_mean"],
        idle_s=batch.delta.idle_s,
        offpolicy=offpolicy,
        tokens=sum(s.num_tokens for g in batch.groups for s in g.samples),
    )


def _population_reward(batch: ProduceBatchResult) -> float:
    """Mean reward of every sample scored since the previous batch, before the filter drops
    zero-variance groups (the kept groups alone would overstate it); the batch's own mean if
    nothing new was scored."""
    d = batch.delta
    if d.reward_count:
        return d.reward_sum / d.reward_count
    return float(np.mean([s.reward for g in batch.groups for s in g.samples]))


def _postfix(r: StepRecord) -> dict[str, Any]:
    return {
        "reward": f"{r.reward:.3f}",
        "tok/s": f"{r.tokens_per_s:.0f}",
        "filtered": r.filtered_groups,
        "failed": r.failed_groups,
        "expired": r.expired_groups,
        "rss": f"{r.rss_mib / 1024:.2f}G",
        "kl": f"{r.offpolicy.get('offpolicy/kl', 0.0):.2g}",
    }


def _log(out: Path, record: StepRecord | EvalRecord, name: str = "metrics.jsonl") -> None:
    with (out / name).open("ab") as f:
        f.write(msgspec.json.encode(record) + b"\n")


def _summarise(
    out: Path,
    records: list[StepRecord],
    counters: Any,
    staleness: Counter[int],
    task: str,
    console: TextIO,
    evals: list[EvalRecord],
) -> None:
    if not records:
        return
    k = max(1, len(records) // 5)
    first = float(np.mean([r.reward for r in records[:k]]))
    last = float(np.mean([r.reward for r in records[-k:]]))
    rows = [
        ("steps", len(records)),
        (f"reward, first {k} steps", f"{first:.3f}"),
        (f"reward, last {k} steps", f"{last:.3f}"),
        ("groups consumed / filtered / failed / expired",
         f"{counters.consumed_groups} / {counters.filtered_groups} / "
         f"{counters.failed_groups} / {counters.expired_groups}"),
        ("wall s per step (median)", f"{np.median([r.wall_s for r in records]):.2f}"),
        ("train s per step (median)", f"{np.median([r.train_s for r in records]):.2f}"),
        ("trainer waiting for rollouts",
         f"{sum(r.wait_s for r in records) / sum(r.wall_s for r in records):.0%}"),
        ("peak RSS of process tree", f"{max(r.rss_mib for r in records) / 1024:.2f} GiB"),
        ("trained tokens by staleness", _shares(staleness)),
        ("KL(behaviour || trainer) by staleness", _mean_kl(records)),
    ]  # fmt: skip
    if counters.episodes:
        rows.append((
            "policy / environment tokens, turns per episode",
            f"{counters.policy_tokens} / {counters.environment_tokens}, "
            f"{(counters.policy_turns + counters.environment_turns) / counters.episodes:.1f}",
        ))  # fmt: skip
    if evals:
        rows += [
            ("held-out accuracy, first / last evaluation",
             f"{evals[0].accuracy:.3f} (step {evals[0].step}) / {evals[-1].accuracy:.3f} "
             f"(step {evals[-1].step})"),
            ("evaluations, s each (median)",
             f"{len(evals)}, {np.median([e.eval_s for e in evals]):.2f}"),
            ("training loop wall s (evaluations included)", f"{evals[-1].train_wall_s:.0f}"),
        ]  # fmt: skip
    width = max(len(str(r[0])) for r in rows)
    text = "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
    print(text, file=console)
    (out / "summary.txt").write_text(text + "\n")
    _plot(out / "demo.png", records, task, evals)


def _shares(counts: Counter[int]) -> str:
    total = sum(counts.values()) or 1
    return ", ".join(f"{k}: {v / total:.0%}" for k, v in sorted(counts.items()))


def _mean_kl(records: list[StepRecord]) -> str:
    """Mean over steps of each staleness' KL estimate: how far the tokens' sampler was from the
    trainer's policy, which the correction has to make up for."""
    per: dict[int, list[float]] = {}
    for r in records:
        for key, value in r.offpolicy.items():
            name, _, stat = key.removeprefix("offpolicy/staleness_").partition("/")
            if stat == "kl" and name.isdigit():
                per.setdefault(int(name), []).append(value)
    return ", ".join(f"{k}: {np.mean(v):.2g}" for k, v in sorted(per.items()))


def _plot(path: Path, records: list[StepRecord], task: str, evals: list[EvalRecord]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    axes[0].plot(steps, [r.reward for r in records], label="training reward")
    if evals:
        axes[0].plot(
            [e.step for e in evals], [e.accuracy for e in evals], "o-", label="held-out accuracy"
        )
        axes[0].legend()
    axes[0].set(title=f"reward ({task} task)", xlabel="step", ylim=(0, 1))
    for name in ("filtered_groups", "failed_groups", "expired_groups"):
        axes[1].plot(steps, [getattr(r, name) for r in records], label=name)
    axes[1].set(title="dropped groups (cumulative)", xlabel="step")
    axes[1].legend()
    axes[2].plot(steps, [r.rss_mib / 1024 for r in records])
    axes[2].set(title="RSS of process tree (GiB)", xlabel="step", ylim=(0, None))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
