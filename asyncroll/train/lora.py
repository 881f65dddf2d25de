"""Train a LoRA adapter of a Hugging Face torch model without peft, and hand it to the engines.

`wrap_lora(model, config)` replaces each targeted `nn.Linear` (by leaf name: "q_proj", ...) with
a `LoraLinear`: the original layer, frozen, plus two trainable matrices A (rank x in) and B
(out x rank), so that the layer computes W x + b + scale * B A x with scale = alpha / rank. Every
parameter of the model outside A and B is frozen, so an optimizer over
`trainable_parameters(model)` holds a few megabytes of state instead of the whole model's.
A starts as PEFT does (Kaiming-uniform, like an `nn.Linear`'s weight) and B at zero: the
wrapped model starts out as the base model exactly, and the first steps move B. As PEFT does by
default, A and B of a 16-bit model are float32 (a bfloat16 B would round most of a small
optimizer step away): the layer computes the update in float32 and returns the model's dtype.
The output head is refused: the engines serve adapters on the model's inner linear layers only.

The wrapped layer's children are named as PEFT names them (`base_layer`, `lora_A`, `lora_B`),
so `model.named_parameters()` already carries the adapter's keys
("model.layers.0.self_attn.q_proj.lora_A.weight"), and `adapter_of(model)` is a detached copy of
them as the `LoraAdapter` that `update_weights` takes. A model wrapped by peft itself needs none
of this: `asyncroll.lora.from_peft_state(peft_model.state_dict(), config)` reads its tensors.

Nothing in `asyncroll.train.loss` knows about LoRA: the wrapped model's forward returns the same
logits as the base model with `merged_weights(base, adapter)` loaded, and gradients flow through
them to A and B only.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn

from asyncroll.lora import LoraAdapter, LoraConfig, LoraError


class LoraLinear(nn.Module):
    """A frozen `nn.Linear` (`base_layer`) plus scale * B A, with A = `lora_A.weight` and
    B = `lora_B.weight` the only trainable tensors (float32 unless the layer is float64)."""

    def __init__(self, base_layer: nn.Linear, config: LoraConfig) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.config = config
        ref = base_layer.weight
        dtype = torch.promote_types(ref.dtype, torch.float32)
        self.lora_A = nn.Linear(
            base_layer.in_features, config.rank, bias=False, device=ref.device, dtype=dtype
        )
        self.lora_B = nn.Linear(
            config.rank, base_layer.out_features, bias=False, device=ref.device, dtype=dtype
        )
        # PEFT's default init: A as an nn.Linear weight (Kaiming-uniform, a = sqrt(5)), B zero,
        # so that B A = 0 and training starts from the base model itself.
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.base_layer.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base_layer(x)
        update: torch.Tensor = self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype)))
        return (out + update * self.config.scale).to(out.dtype)


def wrap_lora(model: nn.Module, config: LoraConfig) -> nn.Module:
    """Wrap, in place, every `nn.Linear` of `model` whose leaf name is in
    `config.target_modules`, freeze every other parameter, and return `model`.

    Every target must match at least one layer (a misspelt name would otherwise train an
    adapter without it and leave the engine to find out); a model already wrapped is refused
    (wrapping twice would nest adapters that `adapter_of` cannot name)."""
    if any(isinstance(m, LoraLinear) for m in model.modules()):
        raise LoraError("the model is already LoRA-wrapped: wrap a fresh model once")
    found: dict[str, list[tuple[nn.Module, str, nn.Linear]]] = {
        name: [] for name in config.target_modules
    }
    for path, module in model.named_modules():
        leaf = path.rpartition(".")[2]
        if leaf in found and isinstance(module, nn.Linear):
            parent = model.get_submodule(path.rpartition(".")[0])
            found[leaf].append((parent, leaf, module))
    head = _output_head(model)
    for layers in found.values():
        for _, leaf, linear in layers:
            if linear is head:
                raise LoraError(
                    f"target_modules has {leaf!r}: {leaf} is the model's output head, and the "
                    "engines serve adapters on the model's inner linear layers only (vLLM "
                    "would need its own lm_head LoRA format); drop it from target_modules"
                )
    missing = [name for name, layers in found.items() if not layers]
    if missing:
        raise LoraError(
            f"target_modules {missing} match no nn.Linear of {type(model).__name__}; use leaf "
            f"names of its linear layers, e.g. {sorted(_linear_leaves(model))}"
        )
    model.requires_grad_(False)
    for layers in found.values():
        for parent, leaf, linear in layers:
            setattr(parent, leaf, LoraLinear(linear, config))
    return model


def lora_layers(model: nn.Module) -> Iterator[tuple[str, LoraLinear]]:
    """(module path, layer) of every `LoraLinear` of `model`, in module order."""
    for path, module in model.named_modules():
        if isinstance(module, LoraLinear):
            yield path, module


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer of the wrapped model should hold: every A and B."""
    return [p for p in model.parameters() if p.requires_grad]


def adapter_of(model: nn.Module) -> LoraAdapter:
    """The model's current adapter, detached copies of every A and B (so that the next
    optimizer step cannot change what an engine is loading), keyed as `LoraAdapter` wants."""
    layers = list(lora_layers(model))
    if not layers:
        raise LoraError("the model has no LoRA layers: wrap it with wrap_lora(model, config)")
    config = layers[0][1].config
    tensors: dict[str, torch.Tensor] = {}
    for path, layer in layers:
        if layer.config != config:  # only wrap_lora builds layers, with one config
            raise LoraError(f"{path} has LoRA config {layer.config}, the others {config}")
        tensors[f"{path}.lora_A.weight"] = layer.lora_A.weight.detach().clone()
        tensors[f"{path}.lora_B.weight"] = layer.lora_B.weight.detach().clone()
    return LoraAdapter(config=config, tensors=tensors)


def _output_head(model: nn.Module) -> nn.Module | None:
    """The model's output layer (Hugging Face's `get_output_embeddings`, else `lm_head`)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, nn.Module) else getattr(model, "lm_head", None)


def _linear_leaves(model: nn.Module) -> set[str]:
    return {p.rpartition(".")[2] for p, m in model.named_modules() if isinstance(m, nn.Linear)}
