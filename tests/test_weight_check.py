"""`weight_check.check`: how a worker's reload report is judged in the trainer's process (the
reports are fabricated here; tests/vllm/test_verify_weights.py has real workers)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from asyncroll.engines.vllm import weight_check  # noqa: E402
from asyncroll.engines.vllm.weight_check import WeightMismatchError  # noqa: E402

SENT = [("a.weight", torch.arange(6.0).reshape(2, 3)), ("b.bias", torch.ones(3))]


def report(**changes: Any) -> dict[str, Any]:
    good = {
        "expected": ["RotaryEmbedding"],
        "unloaded": [],
        "missing": [],
        "received": weight_check.digests(SENT),
        "mismatched": [],
        "unchecked": [],
    }
    return {**good, **changes}


def test_a_report_of_what_was_sent_passes() -> None:
    weight_check.check([report(), report()], weight_check.digests(SENT), "replica X")


def test_a_digest_is_of_the_bytes() -> None:
    same, other = weight_check.digest(torch.ones(3)), weight_check.digest(torch.ones(3) * 1.0001)
    assert same == weight_check.digest(torch.ones(3)) != other
    assert weight_check.digest(torch.ones(3)) != weight_check.digest(torch.ones(3).double())


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        (
            {"received": {"a.weight": weight_check.digests(SENT)["a.weight"]}},
            "not received: b.bias",
        ),
        ({"received": {**weight_check.digests(SENT), "b.bias": "0" * 64}}, "other bytes: b.bias"),
        ({"missing": ["c.weight"]}, "missing from the update: c.weight"),
        ({"unloaded": ["RowParallelLinear"]}, "no tensor reached layer(s): RowParallelLinear"),
        ({"mismatched": ["a.weight (output off by 1e-01)"]}, "not served as sent: a.weight"),
    ],
)
def test_each_problem_names_the_replica_and_the_tensor(changes: dict[str, Any], named: str) -> None:
    """A stub worker that misses a tensor, reports another checksum, or serves other values."""
    with pytest.raises(WeightMismatchError, match="replica X: ") as caught:
        weight_check.check([report(**changes)], weight_check.digests(SENT), "replica X")
    assert named in str(caught.value)


def test_reports_without_digests_or_not_reports_fail() -> None:
    bare = {k: v for k, v in report().items() if k != "received"}
    with pytest.raises(WeightMismatchError, match="no digests"):
        weight_check.check([bare], weight_check.digests(SENT), "e")
    with pytest.raises(WeightMismatchError, match="not a reload report"):
        weight_check.check(["oops"], None, "e")
    with pytest.raises(WeightMismatchError, match="no worker reported"):
        weight_check.check([], None, "e")
    weight_check.check([bare], None, "e")  # not verifying: coverage only


def test_long_lists_are_cut() -> None:
    names = [f"t{i}" for i in range(20)]
    with pytest.raises(WeightMismatchError, match="and 12 more"):
        weight_check.check([report(missing=names)], None, "e")


def served_layout(tmp_path: Any) -> dict[str, weight_check.Layout]:
    from safetensors.torch import save_file

    save_file(
        {"q.weight": torch.zeros(4, 3), "norm.weight": torch.zeros(3, dtype=torch.bfloat16)},
        str(tmp_path / "model.safetensors"),
    )
    layout = weight_check.checkpoint_layout(str(tmp_path))
    assert layout == {"q.weight": ((4, 3), "F32"), "norm.weight": ((3,), "BF16")}
    return layout


def test_an_update_of_the_served_shapes_and_float_dtypes_passes(tmp_path: Any) -> None:
    """Any 16-64-bit float goes (vLLM casts it to the served dtype); names the checkpoint
    lacks are not its business (a tied head a state_dict lists, say)."""
    named = [
        ("q.weight", torch.zeros(4, 3, dtype=torch.float64)),
        ("norm.weight", torch.zeros(3)),
        ("lm_head.weight", torch.zeros(9, 3)),
    ]
    weight_check.check_layout(named, served_layout(tmp_path), "engine X")
    weight_check.check_layout(named, None, "engine X")  # a hub id: nothing to check against


@pytest.mark.parametrize(
    ("tensor", "words"),
    [
        (torch.zeros(3, 4), r"q.weight has shape \(3, 4\); the served checkpoint's is \(4, 3\)"),
        (torch.zeros(4), r"q.weight has shape \(4,\)"),
        (torch.zeros(4, 3, dtype=torch.int64), "q.weight is torch.int64; the served .* F32"),
        (torch.zeros(4, 3).to(torch.float8_e4m3fn), "q.weight is torch.float8_e4m3fn"),
    ],
)
def test_an_update_the_model_cannot_take_is_refused_naming_the_tensor(
    tmp_path: Any, tensor: Any, words: str
) -> None:
    """A wrong shape reaching vLLM's reload resizes the parameter and fails every later
    update too: refused before anything is sent, every bad tensor named."""
    named = [("norm.weight", torch.zeros(5)), ("q.weight", tensor)]
    with pytest.raises(weight_check.WeightLayoutError, match=words) as refused:
        weight_check.check_layout(named, served_layout(tmp_path), "engine X")
    assert str(refused.value).startswith("engine X: ")
    assert r"norm.weight has shape (5,)" in str(refused.value)
    assert "nothing was loaded" in str(refused.value)


def test_the_reload_report_catches_unloaded_layers_whatever_vllms_log_level() -> None:
    """Importing trl sets VLLM_LOGGING_LEVEL=ERROR, and the workers vLLM spawns afterwards drop
    the "<Layer>: Failed to load weights" warnings before any filter sees them: an update that
    left a layer without weights passed the coverage check in the full suite (and the DEBUG
    report of expected layers was empty). Caught now at any level, the level set back after."""
    import logging

    from asyncroll.engines.vllm import in_worker

    logger = logging.getLogger(in_worker._LAYERWISE_LOGGER)
    saved = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with in_worker._unloaded_layers() as caught:
            logger.warning("%s: Failed to load weights", "RowParallelLinear")
            logger.warning("unrelated")
        assert caught.layers == ["RowParallelLinear"]
        assert logger.level == logging.ERROR and not logger.filters
    finally:
        logger.setLevel(saved)
