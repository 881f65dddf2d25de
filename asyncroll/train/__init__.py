"""The trainer's side: a batch of groups as padded torch tensors, the policy loss and its
off-policy corrections (`loss`), per-turn losses (`turns`), LoRA training without peft
(`lora`). Needs torch. Everything public is re-exported here:
`from asyncroll.train import to_batch, policy_loss`."""

from asyncroll.train.lora import (
    LoraLinear,
    adapter_of,
    lora_layers,
    trainable_parameters,
    wrap_lora,
)
from asyncroll.train.loss import (
    CORRECTIONS,
    BehaviourWeights,
    Correction,
    TrainBatch,
    behaviour_weights,
    group_advantages,
    mismatch_metrics,
    policy_loss,
    proximal_logprobs,
    to_batch,
    token_logprobs,
)
from asyncroll.train.turns import (
    TurnRewards,
    blind_problems,
    blind_tokens,
    capped_entropy,
    failed_problems,
    failed_tokens,
    mean_entropy,
    problem_tokens,
    token_entropy,
    turn_index,
    turn_loss,
    unlikelihood,
)

__all__ = [
    "CORRECTIONS",
    "BehaviourWeights",
    "Correction",
    "LoraLinear",
    "TrainBatch",
    "TurnRewards",
    "adapter_of",
    "behaviour_weights",
    "blind_problems",
    "blind_tokens",
    "capped_entropy",
    "failed_problems",
    "failed_tokens",
    "group_advantages",
    "lora_layers",
    "mean_entropy",
    "mismatch_metrics",
    "policy_loss",
    "problem_tokens",
    "proximal_logprobs",
    "to_batch",
    "token_entropy",
    "token_logprobs",
    "trainable_parameters",
    "turn_index",
    "turn_loss",
    "unlikelihood",
    "wrap_lora",
]
