"""From a Hugging Face model, a dataset of chat messages and a verifier to a running async GRPO
loop on the in-process vLLM engine, with evaluation on held-out questions.

    python examples/chat_grpo.py --model Qwen/Qwen3-0.6B --steps 200
    python examples/chat_grpo.py --steps 5     # the tiny local model stands in (CPU, seconds)

docs/getting-started.md walks through it; tests/vllm/test_getting_started.py runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
from typing import Any

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


# 4. The loop: the producer keeps the engine generating while the trainer trains; the
#    evaluator runs the held-out questions greedily on the same engine every `eval_every` steps.
async def train(
    engine: Engine,
    model: Any,
    tokenizer: Any,
    *,
    steps: int,
    eval_every: int,
    chat_template: str | None = None,
) -> list[dict[str, float]]:
    reward = text_reward(correct, tokenizer)
    producer = Producer(
        engine,
        chat_prompts(dataset(1000, seed=0), tokenizer, chat_template=chat_template),
        reward,
        group_size=8,
        batch_size=8,
        max_staleness=1,
        sampling=SamplingConfig(max_new_tokens=8, temperature=1.0),
    )
    held_out = chat_prompts(dataset(32, seed=1), tokenizer, chat_template=chat_template)
    evaluator = Evaluator(producer, held_out, reward)  # greedy; pass@1 = accuracy
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
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
    chat_template = None
    if model_name is None:  # the tiny local model stands in, with a small chat template
        from asyncroll.app.models import build_tiny_model
        from asyncroll.chat import TINY_CHAT_TEMPLATE

        model_name, chat_template = str(build_tiny_model()), TINY_CHAT_TEMPLATE
    tokenizer = AutoTokenizer.from_pretrained(model_name)
    model = AutoModelForCausalLM.from_pretrained(model_name, torch_dtype=torch.float32)
    async with VLLMEngine(model_name, max_model_len=1024) as engine:
        return await train(
            engine, model, tokenizer, steps=steps, eval_every=eval_every,
            chat_template=chat_template,
        )  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Hugging Face model (default: tiny)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.model, args.steps, args.eval_every))
