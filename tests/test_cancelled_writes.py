"""A weight update cancelled while its thread writes the file the workers read leaves no file
behind. The thread cannot be stopped: a caller let go at once removed the file (or folder)
first, and the thread wrote it after, for nobody to delete: a model's size in /dev/shm at each
cut update. Each engine's write is held in its thread, the update cancelled, then let go
(no vLLM: the write comes before anything reaches a worker; `test_state` covers the
producer's checkpoint), and the helper they write with, `thread_to_end`, under an anyio scope."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncroll._core.tasks import thread_to_end
from asyncroll.engines.server import lora as server_lora
from asyncroll.engines.vllm import loading, weights_file
from asyncroll.engines.vllm.lora import AdapterSet
from asyncroll.lora import LoraAdapter, LoraConfig, LoraSlots

torch = pytest.importorskip("torch")

GUARD_S = 60
Case = tuple["HeldWrite", Coroutine[Any, Any, Any]]  # the held write, the update to cancel


class HeldWrite:
    """Wraps a write function: the thread waits at `go` before writing, and says when it
    entered and when it ended (whether it wrote or failed)."""

    def __init__(self, write: Callable[..., Any]) -> None:
        self.write = write
        self.entered, self.go, self.ended = threading.Event(), threading.Event(), threading.Event()

    def __call__(self, *args: Any) -> Any:
        self.entered.set()
        try:
            self.go.wait(GUARD_S)
            return self.write(*args)
        finally:
            self.ended.set()


async def ended_at_once(task: asyncio.Future[Any]) -> bool:
    """Whether `task`, just cancelled, ends within 50 turns of the loop (each a chance for it
    to end) while the thread it waits for is held: a count of turns, not a wait for time."""
    for _ in range(50):
        await asyncio.sleep(0)
    return task.done()


def adapter() -> LoraAdapter:
    q = "model.layers.0.self_attn.q_proj"
    config = LoraConfig(rank=1, alpha=1.0, target_modules=("q_proj",))
    return LoraAdapter(config, {f"{q}.lora_A.weight": torch.ones(1, 4),
                                f"{q}.lora_B.weight": torch.ones(4, 1)})  # fmt: skip


def vllm_full_weights(tmp: Path, mp: pytest.MonkeyPatch) -> Case:
    held = HeldWrite(weights_file.write_safetensors)
    mp.setattr(weights_file, "write_safetensors", held)
    mp.setattr(loading, "WEIGHTS_DIR", tmp)
    loader = loading.WeightLoader(
        None, lambda call: call, model="m", transfer="auto", verify_weights=False,
        world_size=1, layout=None,
    )  # fmt: skip
    return held, loader.load([("w", torch.ones(4))])


def vllm_adapter(tmp: Path, mp: pytest.MonkeyPatch) -> Case:
    held = HeldWrite(weights_file.write_safetensors)
    mp.setattr(weights_file, "write_safetensors", held)
    adapters = AdapterSet(None, lambda call: call, "test engine", tmp)
    return held, adapters.register(adapter(), version=1, current=0)


def server_adapter(tmp: Path, mp: pytest.MonkeyPatch) -> Case:
    held = HeldWrite(server_lora.write_peft)
    mp.setattr(server_lora, "write_peft", held)
    adapters = server_lora.ServerAdapters(LoraSlots(), None, lambda replica, error: None)  # type: ignore[arg-type]
    return held, adapters.write(adapter(), tmp, version=1)


@pytest.mark.parametrize("case", [vllm_full_weights, vllm_adapter, server_adapter])
async def test_an_update_cancelled_during_its_write_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: Callable[..., Any]
) -> None:
    held, update = case(tmp_path, monkeypatch)
    task = asyncio.ensure_future(update)
    assert await asyncio.to_thread(held.entered.wait, GUARD_S)
    task.cancel()
    ended_before_its_write = await ended_at_once(task)
    held.go.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await asyncio.to_thread(held.ended.wait, GUARD_S)
    assert os.listdir(tmp_path) == []  # nothing left for nobody
    assert not ended_before_its_write  # it waited for its thread, then cleaned up


async def test_an_anyio_scope_cancelled_during_the_write_ends_the_caller_after_it() -> None:
    """`thread_to_end` under an anyio scope cancelled while the thread runs: the thread ends,
    the call returns its result, and the scope's cancellation lands at the caller's next
    await (deferred, shielded: not absorbed and raised, and not re-delivered at every turn
    of the loop while the thread runs)."""
    held = HeldWrite(lambda: 7)
    reached: list[object] = []

    async def caller(scope: anyio.CancelScope) -> None:
        with scope:
            reached.append(await thread_to_end(held))
            await asyncio.sleep(0)  # the scope's cancellation lands here
            reached.append("past the cancelled scope's next await")

    scope = anyio.CancelScope()
    task = asyncio.ensure_future(caller(scope))
    assert await asyncio.to_thread(held.entered.wait, GUARD_S)
    scope.cancel()
    ended_before_its_thread = await ended_at_once(task)
    held.go.set()
    await task
    assert not ended_before_its_thread
    assert reached == [7] and scope.cancelled_caught
