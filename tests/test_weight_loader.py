"""`WeightLoader` (asyncroll.engines.vllm.loading), the one writer of whether the in-process
engine's weights can be vouched for, on a stand-in for vLLM's `collective_rpc` (the real
engine's paths run in tests/vllm/test_weights.py and test_verify_weights.py): a load that
passes serves, one that fails its check is MISMATCHED, one cut off or failed once the workers
had it is PARTIAL, and one that fails before anything was sent changes nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import pytest
import torch

from asyncroll.engines.vllm.loading import WeightLoader, WeightsState
from asyncroll.engines.vllm.weight_check import WeightMismatchError

NAMED = [("w", torch.ones(2, 3))]


class FakeLLM:
    """`collective_rpc` answers each worker's reload report (or raises, or never answers)."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.calls: list[str] = []
        self.called = asyncio.Event()

    async def collective_rpc(self, method: str, args: tuple[Any, ...]) -> Any:
        self.calls.append(method)
        self.called.set()
        if isinstance(self.answer, BaseException):
            raise self.answer
        if self.answer is None:
            await asyncio.Event().wait()  # a load that never answers: cut off by the caller
        return self.answer


async def passthrough(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


def loader(llm: FakeLLM, **options: Any) -> WeightLoader:
    options = {"transfer": "file", "verify_weights": False, "world_size": 1, **options}
    return WeightLoader(llm, passthrough, model="m", layout=None, **options)


async def test_a_clean_report_serves() -> None:
    weights = loader(FakeLLM([{"unloaded": [], "missing": []}]))
    await weights.load(NAMED)
    assert weights.state is WeightsState.SERVED
    weights.check_served()


@pytest.mark.parametrize(
    ("answer", "state", "error"),
    [
        ([{"missing": ["w2"]}], WeightsState.MISMATCHED, WeightMismatchError),
        (RuntimeError("worker died"), WeightsState.PARTIAL, RuntimeError),
    ],
)
async def test_a_failed_load_leaves_weights_that_cannot_be_vouched_for(
    answer: Any, state: WeightsState, error: type[BaseException]
) -> None:
    weights = loader(FakeLLM(answer))
    with pytest.raises(error):
        await weights.load(NAMED)
    assert weights.state is state
    with pytest.raises(WeightMismatchError, match="update the weights again"):
        weights.check_served()
    weights._llm = FakeLLM([{}])  # the next update that passes serves again
    await weights.load(NAMED)
    assert weights.state is WeightsState.SERVED


async def test_a_load_cut_off_once_sent_is_partial() -> None:
    llm = FakeLLM(None)
    weights = loader(llm)
    task = asyncio.ensure_future(weights.load(NAMED))
    await asyncio.wait_for(llm.called.wait(), 60)  # the workers have the update
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert weights.state is WeightsState.PARTIAL


async def test_a_load_that_fails_before_sending_changes_nothing() -> None:
    llm = FakeLLM([{}])
    weights = loader(llm, transfer="cuda_ipc")
    with pytest.raises(ValueError, match="cuda_ipc"):
        weights.fitting(NAMED)  # CPU tensors: refused before anything is sent
    assert weights.state is WeightsState.SERVED and not llm.calls


def test_an_adapter_lost_in_a_failed_update_is_partial_once() -> None:
    weights = loader(FakeLLM([{}]))
    weights.lost_adapter()
    assert weights.state is WeightsState.PARTIAL
    weights.state = WeightsState.MISMATCHED
    weights.lost_adapter()  # a worse state stays
    assert weights.state is WeightsState.MISMATCHED
