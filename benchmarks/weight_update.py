"""What `verify_weights` costs per weight update: `update_weights` latency with and without it,
for `VLLMEngine` (in this process) and `VLLMServerEngine` (one `vllm serve` on loopback, the
shared-folder path), on the tiny model and a bigger random Llama.

Each update sends every tensor, perturbed (so every update really changes the weights), under
a new version; the engines run one after the other (one vLLM at a time), each updated
`--reps` times per setting after one warm-up update. An update with verification also hashes
every tensor in this process (sha256) and in the worker, and runs each linear layer's kernel on
a probe input (see `asyncroll.engines.vllm.weight_check`).

    python benchmarks/weight_update.py --out benchmarks/results
    python benchmarks/weight_update.py --quick          # the tiny model only

Prints a table and writes `weight_update.{md,json,png}` to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from _common import DEFAULT_OUT, info_line, new_figure, print_section, run_info, save_outputs

from asyncroll.app.models import TinyModelConfig, build_tiny_model
from asyncroll.engines import VLLMEngine, VLLMServerEngine
from asyncroll.engines.base import Engine
from asyncroll.engines.server.launch import ServerProcess

MODELS = {
    "tiny": TinyModelConfig(),
    "llama-54M": TinyModelConfig(
        name="bench-llama", vocab_size=4096, hidden_size=1024, intermediate_size=2816,
        num_layers=4, num_heads=8, num_kv_heads=4,
    ),
}  # fmt: skip
PATHS = ("in-process", "http")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="timed updates per setting")
    parser.add_argument("--quick", action="store_true", help="the tiny model only")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    names = ["tiny"] if args.quick else list(MODELS)
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        model = build_tiny_model(MODELS[name])
        weights = _weights(model)
        mib = sum(t.numel() * t.element_size() for _, t in weights) / 2**20
        for path in PATHS:
            times = asyncio.run(_measure(path, model, weights, args.reps))
            results[f"{name}/{path}"] = {"model": name, "mib": mib, "path": path, **times}
            print(f"{name} {path}: {times}", flush=True)
    _report(results, args)
    return 0


def _weights(model: Path) -> list[tuple[str, Any]]:
    from safetensors.torch import load_file

    return list(load_file(model / "model.safetensors").items())


async def _measure(
    path: str, model: Path, weights: list[tuple[str, Any]], reps: int
) -> dict[str, list[float]]:
    """Seconds per `update_weights`, for verify off and on."""
    if path == "in-process":
        async with VLLMEngine(model, max_model_len=256, seed=0) as engine:
            return await _updates(
                engine, lambda on: setattr(engine, "verify_weights", on), weights, reps
            )
    server = ServerProcess.start(model, max_model_len=256)
    try:
        with tempfile.TemporaryDirectory(prefix="weight-update-") as folder:
            async with VLLMServerEngine(
                server.url, vocab_size=_vocab(model), weights_dir=folder, control_timeout_s=600.0
            ) as http:
                return await _updates(
                    http, lambda on: setattr(http, "verify_weights", on), weights, reps
                )
    finally:
        server.stop()


async def _updates(
    engine: Engine, verify: Callable[[bool], None], weights: list[tuple[str, Any]], reps: int
) -> dict[str, list[float]]:
    version = 0
    out: dict[str, list[float]] = {}
    for on in (False, True, False, True):  # interleaved: drift on a shared machine hits both
        verify(on)
        key = "verify" if on else "plain"
        for rep in range(reps + 1):
            version += 1
            scale = 1.0 + 1e-3 * version  # every update changes every tensor
            sent = [(n, t * scale) for n, t in weights]
            start = time.perf_counter()
            await _timed(engine.update_weights(sent, version=version))
            if rep:  # the first of each round warms up
                out.setdefault(key, []).append(time.perf_counter() - start)
    return out


async def _timed(update: Awaitable[None]) -> None:
    async with asyncio.timeout(600):
        await update


def _vocab(model: Path) -> int:
    import json

    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def _report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    info = run_info()
    rows = []
    for r in results.values():
        plain, verify = statistics.median(r["plain"]), statistics.median(r["verify"])
        rows.append([r["model"], r["mib"], r["path"], plain * 1e3, verify * 1e3,
                     (verify - plain) * 1e3, verify / plain])  # fmt: skip
        r["median_ms"] = {"plain": plain * 1e3, "verify": verify * 1e3}
    text = "## Weight update: cost of verify_weights\n\n" + info_line(info) + "\n\n"
    text += f"{args.reps} timed updates per setting (2 rounds, interleaved), medians\n"
    text += print_section(
        "update_weights latency",
        ["model", "weights MiB", "engine", "plain ms", "verified ms", "cost ms", "ratio"],
        rows,
    )
    save_outputs(
        args.out, "weight_update", _plot(results), {"info": info, "results": results}, text
    )


def _plot(results: dict[str, dict[str, Any]]) -> Any:
    models = list(dict.fromkeys(r["model"] for r in results.values()))
    fig, axes = new_figure(1, len(models), width=5.5, height=3.6)
    for ax, model in zip(axes, models, strict=True):
        rows = [r for r in results.values() if r["model"] == model]
        for i, r in enumerate(rows):
            for j, key in enumerate(("plain", "verify")):
                values = [v * 1e3 for v in r[key]]
                ax.bar(i * 3 + j, statistics.median(values), color=("#6baed6", "#fd8d3c")[j],
                       label=("verify off", "verify on")[j] if i == 0 else None)  # fmt: skip
                ax.plot([i * 3 + j] * len(values), values, "k_", markersize=8)
        ax.set_xticks([i * 3 + 0.5 for i in range(len(rows))], [r["path"] for r in rows])
        ax.set_ylabel("update_weights ms")
        ax.set_title(f"{model} ({rows[0]['mib']:.0f} MiB)")
        ax.legend()
    fig.suptitle("Weight update latency with and without verify_weights")
    return fig


if __name__ == "__main__":
    raise SystemExit(main())
