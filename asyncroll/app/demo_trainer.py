"""The demo's trainer: plain torch GRPO of the HF model in the demo's process, with per-turn
credit, an entropy bonus and LoRA as `asyncroll demo`'s flags ask (`asyncroll.app.demo`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from asyncroll.engines.base import SamplingConfig, Weights
from asyncroll.lora import LoraAdapter, LoraConfig
from asyncroll.train.turns import (
    TurnRewards,
    blind_tokens,
    capped_entropy,
    failed_tokens,
    token_entropy,
    turn_loss,
    unlikelihood,
)
from asyncroll.types import RolloutGroup

BLIND_SOLVED = 1.0  # the demo's tasks score a right answer 1 (rewards in [0, 1])


class Trainer:
    """A plain torch GRPO trainer of the HF model, in this process.

    With `turn_rewards` (multi-turn credit), each policy turn is its own GRPO problem: its
    tokens get the advantage of that turn's reward within the group, not the episode's. One
    reward for the whole episode credits every turn with the other turns' luck: in tool_echo
    (three turns, each echoing its own letter) the per-turn hit rates stalled together near the
    1/8 of a policy that says letters at random, with masks, turn boundaries and logprobs right
    (KL at staleness 0 ~1e-13).

    `entropy`: the weight of an entropy bonus on the trained tokens (`entropy_on="all"`) or on
    those of the failed problems (`"failed"`). `blind_entropy`: the weight of a second bonus,
    on the tokens of the problems GRPO is blind to (`asyncroll.train.blind_problems`: every
    sample scored the same, below `BLIND_SOLVED`), capped per token at `blind_target` nats
    (`asyncroll.train.capped_entropy`): a problem stuck on one wrong answer gets the whole
    bonus and is spread over a few answers until a sample differs and GRPO sees it.
    `blind_push`: the weight of `asyncroll.train.unlikelihood` on the tokens of the failed
    problems (`push_on="failed"`: every sample scored 0) or of every blind one (`"blind"`)
    whose context's entropy is below `blind_target`: the sampled answers of a problem GRPO is
    blind to are made less likely, with a gradient that does not vanish at certainty as the
    entropy's does. On a blind problem whose samples all scored the same partial reward the
    sampled tokens hold right answers too, and the push lowers those as well."""

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
        blind_entropy: float = 0.0,
        blind_target: float = math.inf,
        blind_push: float = 0.0,
        push_on: str = "failed",
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
        self.blind_entropy = blind_entropy
        self.blind_target = blind_target
        self.blind_push = blind_push
        self.push_on = push_on
        # the last step's mean entropy at the trained tokens, and at those of the failed and
        # the blind problems (nan: none)
        self.last_entropy = math.nan
        self.last_failed_entropy = math.nan
        self.last_blind_entropy = math.nan
        # the last step's logprobs of every token ([rows, L], to_batch's layout) and the
        # advantages it trained with ([rows]; None with per-turn credit, whose are per turn):
        # what the demo attaches to the run record
        self.last_logprobs: Any = None
        self.last_advantages: Any = None

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
        self.last_logprobs = proximal
        self.last_advantages = batch.advantages if self.turn_rewards is None else None
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
            capped_entropy(per_token, m, math.inf) for m in (batch.loss_mask, failed)
        )
        if self.entropy:
            loss = loss - self.entropy * (entropy if self.entropy_on == "all" else failed_entropy)
        blind = blind_tokens(batch, groups, self.turn_rewards, BLIND_SOLVED)
        if self.blind_entropy:
            loss = loss - self.blind_entropy * capped_entropy(per_token, blind, self.blind_target)
        if self.blind_push:
            pushed = blind if self.push_on == "blind" else failed
            below = pushed & (per_token.detach() < self.blind_target)
            total = batch.loss_mask.sum()
            loss = loss + self.blind_push * unlikelihood(logprobs, below, total)
        metrics = mismatch_metrics(proximal, batch, version=version, correction=self.correction)
        self.last_entropy = float(entropy.detach())
        self.last_failed_entropy = float(failed_entropy.detach()) if failed.any() else math.nan
        self.last_blind_entropy = (
            float(capped_entropy(per_token.detach(), blind, math.inf)) if blind.any() else math.nan
        )
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
