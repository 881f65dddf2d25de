"""`VLLMServerEngine.update_weights` refuses tensors the served model cannot take before it
writes anything, as `VLLMEngine` does before it sends anything: a wrong shape
(`WeightLayoutError`), a tensor the model lacks or one it needs that the update lacks
(`WeightMismatchError`), each naming the tensor. The engine once wrote the folder, had every
replica load it and learnt only from their refusals (an extra tensor took every replica out
of the rotation). Scripted replicas (`tests/test_server_engine.py`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from asyncroll.engines.server import weights as server_weights
from asyncroll.engines.server.replicas import ReplicaState
from asyncroll.engines.vllm.weight_check import WeightLayoutError, WeightMismatchError
from tests.test_server_engine import _request, scripted

SERVED = {"model.embed.weight": (8, 4), "model.norm.weight": (4,), "lm_head.weight": (8, 4)}


def _model(path: Path) -> Path:
    """The model folder the replicas were started from (`/v1/models` names it)."""
    path.mkdir()
    tensors = [(name, torch.zeros(shape)) for name, shape in SERVED.items()]
    server_weights.write(tensors, path, digest=False)
    return path.resolve()


def _weights(**changes: tuple[int, ...] | None) -> list[tuple[str, torch.Tensor]]:
    """The served model's tensors, with `changes` (a name -> its shape; None: left out)."""
    shapes: dict[str, tuple[int, ...] | None] = {
        name.replace("__", "."): shape for name, shape in SERVED.items()
    }
    shapes.update({name.replace("__", "."): shape for name, shape in changes.items()})
    return [(name, torch.ones(shape)) for name, shape in shapes.items() if shape is not None]


@pytest.mark.parametrize(
    ("weights", "error", "named"),
    [
        pytest.param(
            _weights(model__norm__weight=(5,)), WeightLayoutError, "model.norm.weight", id="shape"
        ),
        pytest.param(
            _weights(model__norm__weight=None), WeightMismatchError, "model.norm.weight",
            id="missing",
        ),
        pytest.param(
            _weights(model__extra__weight=(2,)), WeightMismatchError, "model.extra.weight",
            id="extra",
        ),
        pytest.param(  # torch.compile's names: none would load; the prefix is named
            [("_orig_mod." + n, t) for n, t in _weights()], WeightLayoutError, "'_orig_mod.'",
            id="prefixed",
        ),
    ],
)  # fmt: skip
async def test_weights_the_model_cannot_take_are_refused_before_anything_is_written(
    tmp_path: Path, weights: list[tuple[str, torch.Tensor]], error: type[Exception], named: str
) -> None:
    model = _model(tmp_path / "model")
    weights_dir = tmp_path / "weights"
    weights_dir.mkdir()
    async with scripted(2, weights_dir=weights_dir) as (engine, stubs):
        for stub in stubs:
            stub.model = str(model)
        await engine.check_replicas()
        await engine.update_weights(_weights(), version=1)  # the served layout takes these
        served = sorted(weights_dir.iterdir())
        with pytest.raises(error, match=named.replace(".", r"\.")):
            await engine.update_weights(weights, version=2)
        assert sorted(weights_dir.iterdir()) == served  # nothing written
        assert [len(s.loaded) for s in stubs] == [1, 1]  # nothing loaded
        assert engine.version == 1
        assert [s.label for s in stubs] == ["1", "1"]
        assert [r.state for r in engine.replicas] == [ReplicaState.UP] * 2
        (sample,) = await asyncio.wait_for(engine.generate(_request("run-0-0")), 5.0)
        assert sample.tokens.tolist() == [7, 8]
