"""`asyncroll.app.models`: the tiny model is built locally, deterministically, atomically."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from asyncroll.app.models import TinyModelConfig, build_tiny_model

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def test_concurrent_builders_share_one_model_and_rebuilds_are_identical(tmp_path: Path) -> None:
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda _: build_tiny_model(cache_dir=tmp_path / "a"), range(2))
    assert first == second
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [first.name]  # no temp left
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(cache_dir=tmp_path / "a") == first  # reused, not rebuilt
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    again = build_tiny_model(cache_dir=tmp_path / "b")
    for name in FILES:
        assert (first / name).read_bytes() == (again / name).read_bytes(), name


def test_config_names_the_folder(tmp_path: Path) -> None:
    other = build_tiny_model(cache_dir=tmp_path, seed=1, num_layers=1)
    config = json.loads((other / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    assert config["hidden_size"] // config["num_attention_heads"] >= 32
    assert other.name == f"tiny-llama-{TinyModelConfig(seed=1, num_layers=1).digest()}"
    assert other.name != f"tiny-llama-{TinyModelConfig().digest()}"


def test_bias_options_add_biases_and_keep_older_folders_named_as_before(tmp_path: Path) -> None:
    """`attention_bias`/`mlp_bias` came later: at their defaults the digest is the one models
    built before had (ab5a9c7438cc for the default config), so their caches stay valid."""
    from safetensors import safe_open

    assert TinyModelConfig().digest() == "ab5a9c7438cc"
    biased = build_tiny_model(
        cache_dir=tmp_path, num_layers=1, attention_bias=True, mlp_bias=True,
        tie_word_embeddings=False,
    )  # fmt: skip
    with safe_open(str(biased / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    projections = ("q", "k", "v", "o", "gate", "up", "down")
    assert {n for n in names if n.endswith(".bias")} == {
        f"model.layers.0.{'self_attn' if p in 'qkvo' else 'mlp'}.{p}_proj.bias" for p in projections
    }
    assert "lm_head.weight" in names


def test_tokenizer_splits_digits_and_round_trips(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(build_tiny_model(cache_dir=tmp_path, num_layers=1))
    assert len(tok) == 512
    assert [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id] == [0, 1, 2]
    ids = tok.encode("reverse 9081 -> 1809")
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[0] == "reverse"  # a word of the corpus is one token
    assert [p for p in pieces if p.isdigit()] == list("90811809")  # one token per digit
    for text in ("12 + 345 = 357", "the cat is red", "Ünïcödé bytes ✓"):
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_size", 64),
        ("num_kv_heads", 3),
        ("vocab_size", 100),
        ("num_heads", 0),  # ZeroDivisionError before
        ("num_kv_heads", 0),  # ZeroDivisionError before
        ("num_layers", 0),  # accepted: a model with no layer at all
        ("num_layers", -1),
        ("intermediate_size", 0),
        ("max_position_embeddings", 0),
    ],
)
def test_bad_configs_are_refused(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        TinyModelConfig(**{field: value})
