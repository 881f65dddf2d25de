"""From a Hugging Face model, a dataset of chat messages and a verifier to a running async GRPO
loop on the in-process vLLM engine, with evaluation on held-out questions.

    python examples/chat_grpo.py --model Qwen/Qwen3-0.6B --steps 200
    python examples/chat_grpo.py --steps 60    # the tiny local model stands in (CPU, minutes)

The training rows cycle, epoch after epoch, for as many steps as asked. The tiny model (random
weights) cannot learn arithmetic; it stands in on the chat demo's task, which it learns in a
few dozen steps (`asyncroll demo --task chat`), with settings that fit it (`tiny_setup`).

docs/getting-started.md walks through it; tests/vllm/test_getting_started.py runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import random
import re
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncroll import ProduceBatchResult, Producer, SamplingConfig
from asyncroll.chat import chat_prompts, text_reward
from asyncroll.engines import Engine, VLLMEngine
from asyncroll.evaluation import Evaluator
from asyncroll.train import CORRECTIONS, LossConfig, split_batch, to_batch, train_step


# 1. A dataset of chat messages with reference answers: any iterable of rows (a list of dicts,
#    or a Hugging Face `datasets.Dataset`). Every field but "messages" rides along as metadata
#    and reaches the verifier under its own name.
def dataset(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        messages = [
            {"role": "system", "content": "Answer with the number only."},
            {"role": "user", "content": f"What is {a} + {b}?"},
        ]
        rows.append({"messages": messages, "answer": str(a + b)})
    return rows


# 2. A verifier on the decoded reply, written as TRL's reward functions are: one reward per
#    completion; `completions` are chat messages, `answer` is the dataset's column.
def correct(completions: list[list[dict[str, str]]], answer: list[str], **_: Any) -> list[float]:
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        numbers = re.findall(r"-?\d+", completion[0]["content"])
        rewards.append(1.0 if numbers and numbers[-1] == expected else 0.0)
    return rewards


# 3. One GRPO step of the Hugging Face model: the batch in micro-batches, their gradients
#    accumulated into one optimizer step (run in a worker thread).
LOSS = LossConfig(correction=CORRECTIONS["tis"], temperature=1.0)  # as sampled


def learn(model: Any, optimizer: Any, batch: ProduceBatchResult, pad_id: int) -> float:
    data = to_batch(batch.groups, advantage="grpo", pad_id=pad_id)
    [shard] = split_batch(data, ranks=1, max_tokens=4096)  # micro-batches of <= 4,096 tokens
    return train_step(model, optimizer, shard, LOSS)["train/loss"]


# 4. The settings that fit the model: the data, the verifier, the reply's length, the
#    learning rate. Qwen3 thinks before it answers unless its template is told not to
#    (`enable_thinking`, a variable other templates ignore); with thinking on, a short reply
#    would be cut inside <think>.
@dataclasses.dataclass(frozen=True)
class Setup:
    rows: list[dict[str, Any]]
    held_out: list[dict[str, Any]]
    verifier: Callable[..., list[float]]
    lr: float
    max_new_tokens: int
    chat_template: str | None = None
    template_kwargs: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"enable_thinking": False}
    )
    # Where the verifier runs: a worker thread, or "process" for verifiers that can hang or
    # crash (math checkers, code): each call is killed at its deadline and fails only its
    # group (docs/rewards.md).
    reward_executor: Literal["thread", "process"] = "thread"


def hf_setup() -> Setup:
    """A Hugging Face chat model (Qwen3-0.6B and the like): addition, answered in a few tokens."""
    return Setup(dataset(1000, seed=0), dataset(32, seed=1), correct, lr=1e-5, max_new_tokens=16)


def tiny_setup() -> Setup:
    """The tiny model: the chat demo's task ("red cat: say the letter c c c"; the reward is the
    share of the reply's words that are the letter) and its settings (asyncroll.app.demo_chat)."""
    from asyncroll.app.demo_chat import letter_reward, rows
    from asyncroll.chat import TINY_CHAT_TEMPLATE

    train_rows, held_out = rows(seed=0)
    return Setup(
        train_rows, held_out, letter_reward, lr=3e-3, max_new_tokens=4,
        chat_template=TINY_CHAT_TEMPLATE,
    )  # fmt: skip


def prompts(setup: Setup, rows: Iterable[dict[str, Any]], tokenizer: Any, max_len: int) -> Any:
    """The rows as prompts, through the setup's chat template and its variables."""
    return chat_prompts(
        rows, tokenizer, chat_template=setup.chat_template,
        template_kwargs=setup.template_kwargs, max_model_len=max_len,
    )  # fmt: skip


def training_prompts(setup: Setup, tokenizer: Any, max_len: int) -> Any:
    """The training rows epoch after epoch, without end: the steps end the run."""
    return prompts(setup, itertools.cycle(setup.rows), tokenizer, max_len)


# 5. The loop: the producer keeps the engine generating while the trainer trains; the
#    evaluator runs the held-out questions greedily on the same engine every `eval_every` steps.
async def train(
    engine: Engine, model: Any, tokenizer: Any, setup: Setup, *, steps: int, eval_every: int
) -> list[dict[str, float]]:
    reward = text_reward(setup.verifier, tokenizer)
    producer = Producer(
        engine,
        training_prompts(setup, tokenizer, engine.max_model_len),
        reward,
        group_size=8,
        batch_size=16,
        max_staleness=1,
        filter="nonzero_std",  # a group whose samples all scored the same teaches nothing
        sampling=SamplingConfig(max_new_tokens=setup.max_new_tokens, temperature=1.0),
        reward_executor=setup.reward_executor,
    )
    held_out = prompts(setup, setup.held_out, tokenizer, engine.max_model_len)
    evaluator = Evaluator(producer, held_out, reward)  # greedy; pass@1 = accuracy
    optimizer = torch.optim.AdamW(model.parameters(), lr=setup.lr)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    log: list[dict[str, float]] = []
    async with producer:
        for step in range(1, steps + 1):
            batch = await producer.produce_batch()
            loss = await asyncio.to_thread(learn, model, optimizer, batch, pad_id)
            await producer.update_weights(model.named_parameters())
            metrics = batch.metrics() | {"train/loss": loss}
            if step % eval_every == 0 or step == steps:
                metrics |= (await evaluator.run()).metrics()  # eval/pass@1, eval/version...
                print(f"step {step}: held-out accuracy {metrics['eval/pass@1']:.2f}")
            log.append(metrics)
    return log


async def main(model_name: str | None, steps: int, eval_every: int) -> list[dict[str, float]]:
    setup = hf_setup()
    if model_name is None:  # the tiny local model stands in, with a small chat template
        from asyncroll.app.models import build_tiny_model

        model_name, setup = str(build_tiny_model()), tiny_setup()
    tokenizer = AutoTokenizer.from_pretrained(model_name)
    model = AutoModelForCausalLM.from_pretrained(model_name, dtype=torch.float32)
    async with VLLMEngine(model_name, max_model_len=1024) as engine:
        return await train(engine, model, tokenizer, setup, steps=steps, eval_every=eval_every)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Hugging Face model (default: tiny)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=10)
    args = parser.parse_args()
    asyncio.run(main(args.model, args.steps, args.eval_every))
