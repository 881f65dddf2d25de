"""LoRA adapters as the policy: the adapter type the trainer hands to `update_weights`.

An adapter is a `LoraConfig` (rank, alpha, target leaf modules) and the `lora_A`/`lora_B`
tensors of each adapted linear layer, named by the Hugging Face module path:
`"model.layers.0.self_attn.q_proj.lora_A.weight"` (shape `(rank, in_features)`) and
`"...q_proj.lora_B.weight"` (shape `(out_features, rank)`). The layer then computes
`W x + scale * B (A x)` with `scale = alpha / rank` (PEFT's default), or `alpha / sqrt(rank)`
with `use_rslora` (rsLoRA).

Everything is checked when the adapter is built (`LoraAdapter.__post_init__`), so a bad
adapter fails in the trainer with a message naming the tensor, not later inside a vLLM worker:
an engine only has to check what depends on its model (the modules it has, its maximum rank).

`from_peft_state` accepts the names PEFT gives (a `base_model.model.` prefix, an adapter name
such as `.default`); `merged_weights` folds an adapter into full weights (the parity tests'
reference); `write_peft` writes the folder layout vLLM's adapter loader reads.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import torch

_A, _B = ".lora_A.weight", ".lora_B.weight"
_PEFT_PREFIX = "base_model.model."
# PEFT's names: "<module>.lora_A.weight" (get_peft_model_state_dict) or
# "<module>.lora_A.<adapter>.weight" (model.state_dict()).
_PEFT_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")
# PEFT tensors that change what the adapter computes but have no place in a plain LoRA.
_UNSUPPORTED = ("lora_embedding_", "lora_magnitude_vector", "lora_B.bias", "modules_to_save")
_LEAF = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Base weights of a wrapped layer, found only in the wrapped model's whole `state_dict()`.
_BASE_LAYER = ".base_layer.weight"


class LoraError(ValueError):
    """An adapter that cannot be served as given; the message says what to change."""


class LoraConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What shapes an adapter: its rank, its `alpha` (scale = alpha / rank, or alpha /
    sqrt(rank) with `use_rslora`, PEFT's rsLoRA) and the leaf names of the linear modules it
    adapts (e.g. `("q_proj", "v_proj")`)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    def __post_init__(self) -> None:
        # Nothing checks a struct's field types: bool is an int, NaN passes comparisons.
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise LoraError(f"LoraConfig rank={self.rank!r}: must be an integer >= 1")
        if (
            isinstance(self.alpha, bool)
            or not isinstance(self.alpha, int | float)
            or not 0 < self.alpha < math.inf
        ):
            raise LoraError(f"LoraConfig alpha={self.alpha!r}: must be a finite number > 0")
        if not isinstance(self.target_modules, tuple) or not self.target_modules:
            raise LoraError(
                f"LoraConfig target_modules={self.target_modules!r}: give a non-empty tuple "
                'of leaf module names, e.g. ("q_proj", "v_proj")'
            )
        for name in self.target_modules:
            if not isinstance(name, str) or not _LEAF.match(name):
                raise LoraError(
                    f"LoraConfig target_modules has {name!r}: each must be a module's leaf "
                    'name (like "q_proj"), not a path or pattern'
                )
        if len(set(self.target_modules)) != len(self.target_modules):
            raise LoraError(f"LoraConfig target_modules={self.target_modules!r} repeats a name")
        if not isinstance(self.use_rslora, bool):
            raise LoraError(f"LoraConfig use_rslora={self.use_rslora!r}: must be True or False")

    @property
    def scale(self) -> float:
        """What `B @ A` is multiplied by: alpha / rank (PEFT's default scaling), or alpha /
        sqrt(rank) with `use_rslora` (as PEFT and vLLM compute it)."""
        if self.use_rslora:
            return float(self.alpha) / math.sqrt(self.rank)
        return float(self.alpha) / self.rank


VLLM_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts as `max_lora_rank`."""


class LoraSlots(msgspec.Struct, frozen=True, kw_only=True):
    """How an engine serves adapters (the engines' `lora=` argument; None: no LoRA).

    `max_rank` is vLLM's `max_lora_rank` (an adapter may have any rank up to it; vLLM sizes its
    buffers for it, so a larger one costs memory and time); `slots` is vLLM's `max_loras`, the
    adapters registered at once. An update registers the new version's adapter beside the ones
    that running requests still use, so `slots` bounds how many versions can be in flight."""

    max_rank: int = 16
    slots: int = 2

    def __post_init__(self) -> None:
        if self.max_rank not in VLLM_MAX_RANKS or isinstance(self.max_rank, bool):
            raise LoraError(
                f"LoraSlots max_rank={self.max_rank!r}: vLLM takes one of {VLLM_MAX_RANKS}"
            )
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise LoraError(f"LoraSlots slots={self.slots!r}: must be an integer >= 1")


def check_servable(slots: LoraSlots | None, adapter: object, engine: str) -> LoraAdapter:
    """Return `adapter` if an engine started with `slots` can serve it, else raise `LoraError`
    naming what to change (the engine checks what depends on the model's modules itself)."""
    if not isinstance(adapter, LoraAdapter):
        raise LoraError(f"{engine}: expected a LoraAdapter, got {type(adapter).__name__}")
    if slots is None:
        raise LoraError(
            f"{engine} was started without LoRA: start it with lora=LoraSlots(max_rank=..., "
            "slots=...) to serve adapters"
        )
    if adapter.config.rank > slots.max_rank:
        raise LoraError(
            f"{engine}: the adapter's rank {adapter.config.rank} is above the engine's "
            f"max_rank {slots.max_rank}; start it with a LoraSlots max_rank >= "
            f"{adapter.config.rank}, or train a smaller rank"
        )
    return adapter


def adapter_name(version: int, serial: int) -> str:
    """vLLM's name for the adapter of `version`, registered as the engine's `serial`-th (>= 1,
    also its `lora_int_id`). vLLM keys its prefix cache by the name and its adapter cache by
    the id, so both must be new for every registration: a version number can come again (a
    restored checkpoint), and the same name would then serve the KV cache of other weights."""
    return f"asyncroll-v{version}-{serial}"


@dataclass(frozen=True)
class LoraAdapter:
    """A checked LoRA adapter (see the module docstring for the tensor names and shapes).

    `tensors` is copied into a read-only mapping: an adapter does not change after its checks.
    The tensors themselves are not copied; the caller must not change them in place while an
    engine may still be loading them.
    """

    config: LoraConfig
    tensors: Mapping[str, torch.Tensor]

    def __post_init__(self) -> None:
        if not isinstance(self.config, LoraConfig):
            raise LoraError(f"LoraAdapter config is {type(self.config).__name__}, not LoraConfig")
        tensors = dict(self.tensors)
        object.__setattr__(self, "tensors", MappingProxyType(tensors))
        if not tensors:
            raise LoraError("LoraAdapter has no tensors: give lora_A and lora_B per module")
        for module in self.modules:
            self._check_module(tensors, module)

    @property
    def modules(self) -> tuple[str, ...]:
        """The adapted modules' paths (e.g. "model.layers.0.self_attn.q_proj"), sorted."""
        modules = set()
        for key in self.tensors:
            if key.endswith(_A):
                modules.add(key.removesuffix(_A))
            elif key.endswith(_B):
                modules.add(key.removesuffix(_B))
            else:
                raise LoraError(
                    f"LoraAdapter tensor {key!r}: names must end with {_A!r} or {_B!r} (use "
                    "from_peft_state for PEFT's names)"
                )
        return tuple(sorted(modules))

    def _check_module(self, tensors: dict[str, torch.Tensor], module: str) -> None:
        import torch

        rank = self.config.rank
        leaf = module.rsplit(".", 1)[-1]
        if leaf not in self.config.target_modules:
            raise LoraError(
                f"LoraAdapter module {module!r}: its leaf {leaf!r} is not in target_modules "
                f"{self.config.target_modules}; add it there or drop its tensors"
            )
        a, b = tensors.get(module + _A), tensors.get(module + _B)
        if a is None or b is None:
            missing = module + (_A if a is None else _B)
            raise LoraError(f"LoraAdapter lacks {missing!r}: every module needs lora_A and lora_B")
        for key, t in ((module + _A, a), (module + _B, b)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 2:
                raise LoraError(f"LoraAdapter {key!r}: must be a 2-D floating-point torch.Tensor")
            # float8 has no arithmetic in torch (isfinite included) and vLLM casts adapters
            if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
                raise LoraError(
                    f"LoraAdapter {key!r} is {t.dtype}: give float16, bfloat16, float32 or "
                    "float64 (the engine casts it to the model's LoRA dtype)"
                )
            if not bool(torch.isfinite(t).all()):
                raise LoraError(f"LoraAdapter {key!r} has NaN or infinite values")
        if a.shape[0] != rank or b.shape[1] != rank:
            raise LoraError(
                f"LoraAdapter {module!r}: lora_A is {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}, but rank {rank} needs lora_A (rank, in_features) and "
                "lora_B (out_features, rank)"
            )

    def nbytes(self) -> int:
        """Bytes of every tensor: what an update moves."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def from_peft_state(state: Mapping[str, torch.Tensor], config: LoraConfig) -> LoraAdapter:
    """The adapter in a PEFT state dict: `get_peft_model_state_dict(model)` (names like
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight") or the wrapped model's
    `state_dict()` (which adds the adapter name, "...lora_A.default.weight", and holds the base
    weights too, which are skipped). Only `lora_A`/`lora_B` weights of one adapter are taken;
    PEFT tensors a plain LoRA cannot express (embedding LoRA, DoRA magnitudes, LoRA biases,
    modules_to_save) are refused rather than silently dropped.

    A state without base weights (no "base_layer.weight": `get_peft_model_state_dict`) holds
    only what PEFT trained, so any other tensor there, such as the biases `bias="all"` or
    `"lora_only"` trains, is refused too. In a whole `state_dict()` trained biases cannot be
    told from the frozen base's: pass `get_peft_model_state_dict(model)` to have them checked."""
    whole = any(_BASE_LAYER in key for key in state)
    found: list[tuple[str, str, torch.Tensor]] = []  # (adapter name, our name, tensor)
    for key, tensor in state.items():
        if any(part in key for part in _UNSUPPORTED):
            raise LoraError(
                f"PEFT state has {key!r}: only plain lora_A/lora_B weights are supported "
                "(no embedding LoRA, DoRA, LoRA bias or modules_to_save)"
            )
        match = _PEFT_KEY.match(key)
        if match is None:
            if ".lora_" in key:
                raise LoraError(f"PEFT state has {key!r}: not a lora_A/lora_B weight name")
            if not whole:
                raise LoraError(
                    f"PEFT state has {key!r}, a trained tensor that is no lora_A/lora_B weight "
                    "(a bias trained with bias='all' or 'lora_only'?): train with bias='none' "
                    "(a plain LoRA has no bias)"
                )
            continue  # a base model weight of model.state_dict()
        module = match["module"].removeprefix(_PEFT_PREFIX)
        found.append((match["adapter"] or "", f"{module}.lora_{match['ab']}.weight", tensor))
    adapters = {adapter for adapter, _, _ in found}
    if len(adapters) > 1:
        raise LoraError(
            f"PEFT state holds several adapters {sorted(adapters)}: pass one adapter's tensors"
        )
    tensors: dict[str, torch.Tensor] = {}
    for _, name, tensor in found:
        if name in tensors:
            raise LoraError(f"PEFT state names {name!r} twice (with and without a prefix?)")
        tensors[name] = tensor
    if not tensors:
        raise LoraError("PEFT state has no lora_A/lora_B weights")
    return LoraAdapter(config, tensors)


def merged_weights(
    base: Mapping[str, torch.Tensor], adapter: LoraAdapter
) -> dict[str, torch.Tensor]:
    """`base` with each adapted linear's weight replaced by W + scale * (B @ A), computed in
    float32 and cast back to W's dtype; every other tensor unchanged (the same objects). A
    module `base` lacks, or whose weight's shape the adapter does not fit, is a `LoraError`."""
    import torch

    merged = dict(base)
    scale = adapter.config.scale
    for module in adapter.modules:
        name = module + ".weight"
        weight = base.get(name)
        if weight is None:
            raise LoraError(f"the adapter targets {module!r}, but the base weights lack {name!r}")
        a, b = adapter.tensors[module + _A], adapter.tensors[module + _B]
        if tuple(weight.shape) != (b.shape[0], a.shape[1]):
            raise LoraError(
                f"the adapter's {module!r} maps {a.shape[1]} -> {b.shape[0]} features, but "
                f"{name!r} has shape {tuple(weight.shape)}"
            )
        delta = b.detach().to(torch.float32) @ a.detach().to(torch.float32)
        merged[name] = (weight.detach().to(torch.float32) + scale * delta).to(weight.dtype)
    return merged


def peft_config(config: LoraConfig) -> dict[str, object]:
    """The adapter_config.json PEFT writes for `config` (what vLLM's `PEFTHelper` reads)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": config.rank,
        "lora_alpha": config.alpha,
        "target_modules": list(config.target_modules),
        "bias": "none",
        "use_rslora": config.use_rslora,
        "use_dora": False,
        "modules_to_save": None,
        "fan_in_fan_out": False,
    }


def peft_tensors(adapter: LoraAdapter) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's saved names ("base_model.model." + name),
    contiguous: what adapter_model.safetensors holds and vLLM's loader parses."""
    return {_PEFT_PREFIX + k: t.detach().contiguous() for k, t in adapter.tensors.items()}


def write_peft(adapter: LoraAdapter, folder: Path) -> Path:
    """Write `adapter` as PEFT saves one: `folder/adapter_config.json` and
    `folder/adapter_model.safetensors`. Returns `folder` (created if needed)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: t.cpu() for k, t in peft_tensors(adapter).items()}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(peft_config(adapter.config), indent=1))
    return folder
