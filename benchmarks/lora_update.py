"""What a LoRA policy update costs next to a full-weight one: `update_weights` latency, bytes
moved and the process tree's peak extra memory, per engine path, on the tiny model and on a
~100M-parameter random Llama, for adapters of rank 8 and 64 on every attention and MLP
projection.

Each model runs on engines one after the other (one vLLM at a time): an engine started without
LoRA takes full-weight updates (every tensor, perturbed so every update really changes the
weights), one started with LoRA (`max_lora_rank` = the largest rank measured) takes adapter
updates (random A and B, perturbed the same way, a new vLLM adapter per version). Each setting
is updated `--reps` times after one warm-up update. Memory is the process tree's RSS (this
process and vLLM's engine and worker processes), sampled every few milliseconds during each
update: its peak above the RSS just before the update. An update's tensors are built before
its timer and its memory baseline start; what they hold is in "MiB moved".

    python benchmarks/lora_update.py --out benchmarks/results
    python benchmarks/lora_update.py --quick          # the tiny model, in-process only
    python benchmarks/lora_update.py --model llama-98M --path in-process   # one setting

Prints a table and writes `lora_update.{md,json,png}` to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

from _common import DEFAULT_OUT, MIB, info_line, new_figure, print_section, run_info, save_outputs

from asyncroll.app.demo_report import tree_rss_mib
from asyncroll.app.models import TinyModelConfig, build_tiny_model
from asyncroll.engines.base import Engine
from asyncroll.lora import LoraAdapter, LoraConfig, LoraSlots

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODELS = {
    "tiny": TinyModelConfig(),
    # 98M parameters (392 MiB in float32): 8 layers of 11.8M plus a 4M-parameter embedding.
    "llama-98M": TinyModelConfig(
        name="bench-llama", vocab_size=4096, hidden_size=1024, intermediate_size=2816,
        num_layers=8, num_heads=8, num_kv_heads=4,
    ),
}  # fmt: skip
RANKS = (8, 64)
PATHS = ("in-process", "http")
SAMPLE_S = 0.002


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="timed updates per setting")
    parser.add_argument("--quick", action="store_true", help="the tiny model, in-process only")
    parser.add_argument("--model", choices=list(MODELS), help="only this model")
    parser.add_argument("--path", choices=PATHS, help="only this engine path")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    names = ["tiny"] if args.quick else [args.model] if args.model else list(MODELS)
    paths = PATHS[:1] if args.quick else [args.path] if args.path else PATHS
    results: list[dict[str, Any]] = []
    for name in names:
        model = build_tiny_model(MODELS[name])
        weights = _weights(model)
        params = sum(t.numel() for _, t in weights)
        for path in paths:
            for kind, rows in asyncio.run(_measure(path, model, weights, args.reps)).items():
                results.append({"model": name, "params": params, "path": path, "kind": kind,
                                **rows})  # fmt: skip
                print(f"{name} {path} {kind}: {statistics.median(rows['s']) * 1e3:.1f} ms, "
                      f"{rows['bytes'] / MIB:.2f} MiB", flush=True)  # fmt: skip
    _report(results, args)
    return 0


def _weights(model: Path) -> list[tuple[str, Any]]:
    from safetensors.torch import load_file

    return list(load_file(model / "model.safetensors").items())


def random_adapter(weights: list[tuple[str, Any]], rank: int, seed: int = 0) -> LoraAdapter:
    """An adapter of `rank` on every targeted linear of `weights` (HF names), random A and B."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, Any] = {}
    for name, w in weights:
        module = name.removesuffix(".weight")
        if w.dim() == 2 and module.rpartition(".")[2] in TARGETS:
            tensors[f"{module}.lora_A.weight"] = torch.randn(rank, w.shape[1], generator=g) * 0.01
            tensors[f"{module}.lora_B.weight"] = torch.randn(w.shape[0], rank, generator=g) * 0.01
    return LoraAdapter(LoraConfig(rank=rank, alpha=2.0 * rank, target_modules=TARGETS), tensors)


async def _measure(
    path: str, model: Path, weights: list[tuple[str, Any]], reps: int
) -> dict[str, dict[str, Any]]:
    """{"full": ..., "rank 8": ..., ...}: seconds, peak extra MiB and bytes per update."""
    out: dict[str, dict[str, Any]] = {}
    async with _engine(path, model, lora_rank=None) as engine:
        out["full"] = await _updates(engine, lambda v: _perturbed_full(weights, v), reps)
    async with _engine(path, model, lora_rank=max(RANKS)) as engine:
        version = 0
        for rank in RANKS:
            adapter = random_adapter(weights, rank)
            out[f"rank {rank}"] = await _updates(
                engine, lambda v, a=adapter: _perturbed_adapter(a, v), reps, after=version
            )
            version += reps + 1
    return out


def _perturbed_full(weights: list[tuple[str, Any]], version: int) -> list[tuple[str, Any]]:
    scale = 1.0 + 1e-3 * version  # every update changes every tensor
    return [(n, t * scale) for n, t in weights]


def _perturbed_adapter(adapter: LoraAdapter, version: int) -> LoraAdapter:
    scale = 1.0 + 1e-3 * version
    return LoraAdapter(adapter.config, {k: t * scale for k, t in adapter.tensors.items()})


@asynccontextmanager
async def _engine(path: str, model: Path, *, lora_rank: int | None) -> AsyncIterator[Engine]:
    """An in-process `VLLMEngine`, or a `VLLMServerEngine` on one `vllm serve` (the shared-
    folder path), with LoRA slots for `lora_rank` or without LoRA."""
    from asyncroll.engines import VLLMEngine, VLLMServerEngine
    from asyncroll.engines.server.launch import ServerProcess

    lora = None if lora_rank is None else LoraSlots(max_rank=lora_rank, slots=2)
    if path == "in-process":
        async with VLLMEngine(model, max_model_len=256, seed=0, lora=lora) as engine:
            yield engine
        return
    server = ServerProcess.start(model, max_model_len=256, lora=lora)
    try:
        with tempfile.TemporaryDirectory(prefix="lora-update-") as folder:
            async with VLLMServerEngine(
                server.url, vocab_size=_vocab(model), weights_dir=folder, control_timeout_s=600.0,
                lora=lora,
            ) as http:  # fmt: skip
                yield http
    finally:
        server.stop()


def _vocab(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


async def _updates(
    engine: Engine, make: Callable[[int], Any], reps: int, *, after: int = 0
) -> dict[str, Any]:
    """`reps` + 1 updates to versions `after` + 1, ... with `make(version)` (the first warms
    up); the others' seconds and peaks, and the bytes one update moves. Each update's tensors
    are made before its timer and memory baseline start, and dropped after it."""
    seconds: list[float] = []
    peaks: list[float] = []
    nbytes = 0
    for i in range(reps + 1):
        version = after + i + 1
        weights = make(version)
        nbytes = (
            weights.nbytes()
            if isinstance(weights, LoraAdapter)
            else sum(t.numel() * t.element_size() for _, t in weights)
        )
        with _peak_rss() as peak:
            start = time.perf_counter()
            async with asyncio.timeout(600):
                await engine.update_weights(weights, version=version)
            elapsed = time.perf_counter() - start
        del weights
        if i:
            seconds.append(elapsed)
            peaks.append(peak())
    return {"s": seconds, "peak_mib": peaks, "bytes": nbytes}


@contextmanager
def _peak_rss() -> Iterator[Callable[[], float]]:
    """Sample the process tree's RSS in a thread while the block runs; yields a function giving
    the peak above the RSS at entry, in MiB (valid after the block)."""
    baseline = tree_rss_mib()
    peak = baseline
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(SAMPLE_S):
            peak = max(peak, tree_rss_mib())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield lambda: peak - baseline
    finally:
        done.set()
        thread.join()
        peak = max(peak, tree_rss_mib())


def _report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    info = run_info()
    rows = []
    for r in results:
        full = next(
            f for f in results if f["model"] == r["model"] and f["path"] == r["path"]
            and f["kind"] == "full"
        )  # fmt: skip
        ms, full_ms = statistics.median(r["s"]) * 1e3, statistics.median(full["s"]) * 1e3
        r["median_ms"], r["median_peak_mib"] = ms, statistics.median(r["peak_mib"])
        rows.append([
            r["model"], f"{r['params'] / 1e6:.2f}M", r["path"], r["kind"], r["bytes"] / MIB,
            full["bytes"] / r["bytes"], ms, full_ms / ms, r["median_peak_mib"],
        ])  # fmt: skip
    text = "## LoRA update: adapter vs full weights\n\n" + info_line(info) + "\n\n"
    text += f"{args.reps} timed updates per setting after one warm-up, medians; "
    text += "peak: process tree RSS above its value before the update\n"
    text += print_section(
        "update_weights",
        ["model", "params", "engine", "update", "MiB moved", "bytes ÷", "ms", "speed-up",
         "peak MiB"],
        rows,
    )  # fmt: skip
    save_outputs(args.out, "lora_update", _plot(results), {"info": info, "results": results}, text)


def _plot(results: list[dict[str, Any]]) -> Any:
    models = list(dict.fromkeys(r["model"] for r in results))
    fig, axes = new_figure(1, 2 * len(models), width=4.2, height=3.6)
    for m, model in enumerate(models):
        rows = [r for r in results if r["model"] == model]
        labels = [f"{r['path']}\n{r['kind']}" for r in rows]
        ax_ms, ax_mib = axes[2 * m], axes[2 * m + 1]
        for i, r in enumerate(rows):
            color = "#fd8d3c" if r["kind"] == "full" else "#6baed6"
            ax_ms.bar(i, r["median_ms"], color=color)
            ax_ms.plot([i] * len(r["s"]), [s * 1e3 for s in r["s"]], "k_", markersize=8)
            ax_mib.bar(i, r["bytes"] / MIB, color=color)
        for ax, unit in ((ax_ms, "update_weights ms"), (ax_mib, "MiB moved")):
            ax.set_xticks(range(len(rows)), labels, fontsize=7)
            ax.set_yscale("log")
            ax.set_ylabel(unit)
            ax.set_title(f"{model} ({rows[0]['params'] / 1e6:.1f}M params)")
    fig.suptitle("Adapter vs full-weight updates (blue: LoRA adapter, orange: full weights)")
    return fig


if __name__ == "__main__":
    raise SystemExit(main())
