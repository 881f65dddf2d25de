"""`weight_check.check`: how a worker's reload report is judged in the trainer's process (the
reports are fabricated here; tests/vllm/test_verify_weights.py has real workers)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from asyncroll.engines import weight_check  # noqa: E402
from asyncroll.engines.weight_check import WeightMismatchError  # noqa: E402

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
