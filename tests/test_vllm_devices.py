"""`VLLMEngine(devices=...)`: the GPUs vLLM's processes use, chosen explicitly beside a trainer
on the others (asyncroll.engines.vllm.startup). GPU-free: the checks and the environment vLLM's
processes get are the logic; the GPU tier (gpu_check.sh) starts the engine on them."""

from __future__ import annotations

import os

import pytest

from asyncroll.engines.vllm import startup


def test_devices_become_vllms_cuda_visible_devices_only_while_it_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # torchrun's trainer GPUs
    monkeypatch.setattr(startup, "own_device", lambda: "0")
    visible = startup.visible_devices([4, 5], {"tensor_parallel_size": 2}, on_cpu=False)
    assert visible == "4,5"
    with startup.child_environment(on_cpu=False, devices=visible):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    with startup.child_environment(on_cpu=False):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # None: what this process sees


@pytest.mark.parametrize(
    ("devices", "args", "on_cpu", "words"),
    [
        ([0], {}, True, "runs on the CPU"),
        ("4,5", {}, False, "a list of GPU ids"),
        ([4, 4], {}, False, "distinct GPU indices"),
        (["cuda:4"], {}, False, "distinct GPU indices"),
        ([], {}, False, "distinct GPU indices"),
        ([4, 5], {"tensor_parallel_size": 4}, False, "give 4"),
        ([1, 2], {"tensor_parallel_size": 2}, False, "GPU 2 is the one this process's torch"),
    ],
)
def test_devices_that_cannot_be_meant_are_refused_saying_what_to_give(
    monkeypatch: pytest.MonkeyPatch,
    devices: object,
    args: dict[str, int],
    on_cpu: bool,
    words: str,
) -> None:
    monkeypatch.setattr(startup, "own_device", lambda: "2")
    with pytest.raises(ValueError, match=words):
        startup.visible_devices(devices, args, on_cpu=on_cpu)  # type: ignore[arg-type]


def test_the_trainers_own_gpu_is_read_through_its_visible_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert startup.own_device() == "6"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert startup.own_device() == "1"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert startup.own_device() is None  # no CUDA started: nothing to compete with


def test_the_engine_refuses_devices_before_it_starts_vllm(tmp_path: object) -> None:
    """Through `VLLMEngine` itself, on this CPU build: refused at construction, before any
    vLLM process exists (the model folder is never read)."""
    pytest.importorskip("vllm")
    from asyncroll.engines import VLLMEngine

    with pytest.raises(ValueError, match="runs on the CPU"):
        VLLMEngine(str(tmp_path), devices=[1])
