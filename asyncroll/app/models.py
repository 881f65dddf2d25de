"""A tiny Llama-architecture model with its own byte-level BPE tokenizer, built locally.

Tests, CI and toy RL runs need a real model that vLLM (GPU or CPU) can serve, but nothing may be
downloaded. `build_tiny_model` trains a tokenizer with `tokenizers` on a small corpus written
here, initialises a Llama with seeded random weights and saves both with transformers. The
result is cached under a folder named for a hash of everything that determines it, so a second
call (or another process) reuses it; it is written to a temporary folder and renamed into place,
so concurrent builders never see or leave half a model.

The tokenizer is friendly to toy tasks: every digit is its own token (so arithmetic and copying
tasks see one token per digit) and the corpus mixes short words, letters and arithmetic, so
common words become single tokens while any byte string still encodes.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import msgspec

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
"""Special tokens, with ids 0, 1 and 2 in that order."""

_FORMAT = 1  # bump when the build changes in a way the config hash cannot see
_SEEDED = threading.Lock()  # weights come from torch's global RNG: one seeded init at a time

_WORDS = (
    "the a an is are was be to of and in on at it this that with for as by from not no yes "
    "one two three four five six seven eight nine ten zero add sum plus minus times equals "
    "answer question what which how many count letter word number digit reverse copy sort "
    "first last next before after up down left right true false red green blue cat dog sun"
)


class TinyModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What determines a tiny model; its hash names the cache folder.

    The defaults give 361k parameters: head_dim = hidden_size / num_heads = 32, the smallest
    head size vLLM's CPU attention supports (16 is rejected).
    """

    name: str = "tiny-llama"
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 1024
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # q/k/v/o biases (vLLM packs q/k/v's like their weights)
    mlp_bias: bool = False  # gate/up/down biases
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
            "max_position_embeddings",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:  # 0 layers built a model with none
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads < 32:
            raise ValueError(
                f"hidden_size={self.hidden_size} / num_heads={self.num_heads} must be a whole "
                "head_dim >= 32 (vLLM's CPU attention needs it)"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads")
        if self.vocab_size < 300:
            raise ValueError(
                f"vocab_size={self.vocab_size}: needs >= 300 (256 bytes, 3 specials, merges)"
            )

    def digest(self) -> str:
        """The hash naming the cache folder. Fields added later are left out while they hold
        their defaults, so models built before they existed keep their folders."""
        fields = msgspec.to_builtins(self)
        for name, default in _LATER_FIELDS.items():
            if fields[name] == default:
                del fields[name]
        payload = msgspec.json.encode({"format": _FORMAT, "config": fields})
        return hashlib.sha256(payload).hexdigest()[:12]


_LATER_FIELDS = {"attention_bias": False, "mlp_bias": False}


def default_cache_dir() -> Path:
    """`$ASYNCROLL_CACHE/models`, else `~/.cache/asyncroll/models`."""
    root = os.environ.get("ASYNCROLL_CACHE")
    return Path(root).expanduser() / "models" if root else Path.home() / ".cache/asyncroll/models"


def build_tiny_model(
    config: TinyModelConfig | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    **overrides: Any,
) -> Path:
    """Path of the model folder for `config` (with keyword overrides), building it if needed.

    The folder holds config.json, generation_config.json, model.safetensors, tokenizer.json and
    tokenizer_config.json: what `vllm` and `transformers.AutoModelForCausalLM` load.
    """
    cfg = msgspec.structs.replace(config or TinyModelConfig(), **overrides)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"{cfg.name}-{cfg.digest()}"
    if (target / "model.safetensors").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        _build(cfg, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
        try:
            tmp.rename(target)  # atomic; fails if another builder got there first
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def corpus(seed: int, lines: int = 4000) -> list[str]:
    """Deterministic training text for the tokenizer: words, spelled letters, arithmetic."""
    rng = random.Random(seed)
    words = _WORDS.split()
    out = []
    for _ in range(lines):
        kind = rng.randrange(4)
        if kind == 0:
            out.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))))
        elif kind == 1:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice("+-*")
            value = a + b if op == "+" else a - b if op == "-" else a * b
            out.append(f"{a} {op} {b} = {value}")
        elif kind == 2:
            word = rng.choice(words)
            out.append(f"spell {word}: {' '.join(word)}")
        else:
            digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(2, 10)))
            out.append(f"reverse {digits} -> {digits[::-1]}")
    return out


def _build(cfg: TinyModelConfig, out: Path) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf: Any = transformers  # its classes are partly untyped

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(cfg.seed), trainer=trainer)
    hf.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD
    ).save_pretrained(out)

    hf_config = hf.AutoConfig.for_model(
        "llama",
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=cfg.initializer_range,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=cfg.attention_bias,
        mlp_bias=cfg.mlp_bias,
        torch_dtype="float32",
    )
    with _SEEDED, torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(cfg.seed)
        model = hf.AutoModelForCausalLM.from_config(hf_config)
    model.save_pretrained(out, safe_serialization=True)
    (out / "asyncroll.json").write_text(json.dumps(msgspec.to_builtins(cfg), indent=1))
