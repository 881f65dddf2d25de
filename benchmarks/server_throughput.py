"""Tokens/s of `Producer` + `VLLMServerEngine` (a `vllm serve` replica over HTTP) next to
`Producer` + in-process `VLLMEngine` and vLLM's offline `LLM.generate`, on the same work; the
latency of `update_weights` over HTTP; and the HTTP client it uses, chosen by measurement.

All three generation paths run the same prompts, samples per prompt (n, sent as one request
with n=k on every path), lengths (eos ignored) and sampling settings, one vLLM after the other
(never two at once), each warmed up, `--reps` timed runs. The client comparison streams short
server-sent-event replies from a stub server (aiohttp.web, its own process) to `--clients`
concurrent requests, with aiohttp and with httpx.

    python benchmarks/server_throughput.py --quick --out bench-out     # CPU, tiny model, ~3 min

Prints tables and writes `server_throughput.{md,json,png}` to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import DEFAULT_OUT, info_line, new_figure, print_section, run_info, save_outputs
from vllm_throughput import bench_llm, run_producer, time_updates

from asyncroll.app.models import build_tiny_model
from asyncroll.engines.server.launch import ServerProcess, free_port

PATHS = (
    ("llm_generate", "vLLM LLM.generate (offline)"),
    ("producer_inprocess", "Producer + VLLMEngine (in process)"),
    ("producer_server", "Producer + VLLMServerEngine (HTTP)"),
)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")  # as VLLMEngine and ServerProcess do
    model = build_tiny_model()
    max_len = args.prompt_len + args.max_new_tokens + 8
    engine_args = {"max_model_len": max_len, "dtype": "float32", "seed": 0}
    engine_args["kv_cache_memory_bytes"] = 128 << 20
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, args.prompt_len).tolist() for _ in range(args.prompts)]
    tokens = args.prompts * args.n * args.max_new_tokens
    print(f"{args.prompts} prompts x n={args.n} x {args.max_new_tokens} tokens = {tokens} per run")
    timings: dict[str, list[float]] = {}
    timings |= asyncio.run(bench_server(model, prompts, args, max_len))
    timings |= asyncio.run(bench_inprocess(model, prompts, args, engine_args))
    timings |= bench_llm(model, prompts, args, engine_args)
    port = free_port()
    stub = subprocess.Popen([sys.executable, "-c", _STUB, str(port)])
    try:
        url = f"http://127.0.0.1:{port}"
        clients = asyncio.run(bench_clients(url, args.clients, args.client_requests))
    finally:
        stub.terminate()
        stub.wait(timeout=10)
    report(timings, clients, tokens, vars(args), Path(args.out))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small run (about 3 minutes on CPU)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--update-reps", type=int, default=5)
    p.add_argument("--clients", type=int, default=512, help="concurrent HTTP requests")
    p.add_argument("--client-requests", type=int, default=4096)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.n, args.max_new_tokens, args.reps = 32, 4, 128, 3
        args.client_requests = 2048
    return args


async def bench_server(
    model: Path, prompts: list[list[int]], args: argparse.Namespace, max_len: int
) -> dict[str, list[float]]:
    from asyncroll.engines import VLLMServerEngine

    start = time.perf_counter()
    server = await asyncio.to_thread(ServerProcess.start, model, max_model_len=max_len)
    out: dict[str, list[float]] = {"server_start": [time.perf_counter() - start]}
    try:
        with tempfile.TemporaryDirectory(prefix="asyncroll-weights-") as shared:
            engine = VLLMServerEngine(server.url, vocab_size=512, weights_dir=shared)
            async with engine:
                await run_producer(engine, prompts, args.n, 8)  # warm up (and sync the replica)
                out["producer_server"] = [
                    await run_producer(engine, prompts, args.n, args.max_new_tokens)
                    for _ in range(args.reps)
                ]
                out["server_update_weights"] = await time_updates(engine, model, args.update_reps)
                label = []
                for version in range(100, 100 + args.update_reps):
                    t = time.perf_counter()
                    await engine.update_weights(None, version=version)
                    label.append(time.perf_counter() - t)
                out["server_update_label"] = label
    finally:
        await asyncio.to_thread(server.stop)
    return out


async def bench_inprocess(
    model: Path, prompts: list[list[int]], args: argparse.Namespace, engine_args: dict[str, Any]
) -> dict[str, list[float]]:
    from asyncroll.engines import VLLMEngine

    engine = VLLMEngine(model, parallel_sampling=True, **engine_args)
    out: dict[str, list[float]] = {}
    async with engine:
        await run_producer(engine, prompts, args.n, 8)
        out["producer_inprocess"] = [
            await run_producer(engine, prompts, args.n, args.max_new_tokens)
            for _ in range(args.reps)
        ]
        out["inprocess_update_weights"] = await time_updates(engine, model, args.update_reps)
    return out


_STUB = textwrap.dedent(
    """
    import sys
    from aiohttp import web

    async def generate(request):
        await request.read()
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        for i in range(4):
            await reply.write(b'data: {"choices":[{"index":0,"token_ids":[%d]}]}\\n\\n' % i)
        await reply.write(b"data: [DONE]\\n\\n")
        return reply

    app = web.Application()
    app.router.add_post("/inference/v1/generate", generate)
    app.router.add_get("/health", lambda r: web.Response(text="ok"))
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, backlog=4096)
    """
)


async def bench_clients(url: str, concurrency: int, requests: int) -> dict[str, float]:
    """Requests/s of streamed replies at `concurrency` requests in flight, per client library."""
    import aiohttp
    import httpx

    body = {"token_ids": [0, 1, 2], "stream": True}
    async with asyncio.timeout(60):
        while True:  # readiness probe of the stub process
            try:
                async with aiohttp.ClientSession() as s, s.get(f"{url}/health") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.1)

    async def with_aiohttp() -> None:
        connector = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def one() -> None:
                async with session.post(f"{url}/inference/v1/generate", json=body) as r:
                    async for _ in r.content:
                        pass

            await _drive(one, concurrency, requests)

    async def with_httpx() -> None:
        limits = httpx.Limits(max_connections=concurrency)
        async with httpx.AsyncClient(limits=limits, timeout=60) as client:

            async def one() -> None:
                async with client.stream("POST", f"{url}/inference/v1/generate", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass

            await _drive(one, concurrency, requests)

    rates: dict[str, list[float]] = {"aiohttp": [], "httpx": []}
    for _ in range(3):  # alternated, so load from other jobs hits both alike
        for name, run in (("aiohttp", with_aiohttp), ("httpx", with_httpx)):
            t = time.perf_counter()
            await run()
            rates[name].append(requests / (time.perf_counter() - t))
    return {name: max(values) for name, values in rates.items()}


async def _drive(one: Any, concurrency: int, requests: int) -> None:
    """`requests` calls of `one`, `concurrency` at a time."""
    remaining = iter(range(requests))

    async def worker() -> None:
        for _ in remaining:
            await one()

    async with asyncio.TaskGroup() as tg:
        for _ in range(concurrency):
            tg.create_task(worker())


def report(
    timings: dict[str, list[float]],
    clients: dict[str, float],
    tokens: int,
    config: dict[str, Any],
    out: Path,
) -> None:
    rates = {key: [tokens / t for t in timings[key]] for key, _ in PATHS}
    base = statistics.median(rates["llm_generate"])
    inproc = statistics.median(rates["producer_inprocess"])
    rows = [
        [name, max(rates[key]), statistics.median(rates[key]),
         f"{statistics.median(rates[key]) / base:.3f}",
         f"{statistics.median(rates[key]) / inproc:.3f}"]
        for key, name in PATHS
    ]  # fmt: skip
    text = "## Producer + VLLMServerEngine next to VLLMEngine and offline LLM.generate\n\n"
    text += info_line(run_info()) + "\n\n"
    text += (
        f"{config['prompts']} prompts x n={config['n']} x {config['max_new_tokens']} new tokens "
        f"(eos ignored) per run, {config['reps']} runs per path, tiny model, float32\n"
    )
    text += print_section(
        "Generated tokens/s",
        ["path", "best", "median", "median vs LLM", "median vs in-process"],
        rows,
    )
    ms = {k: statistics.median(v) * 1e3 for k, v in timings.items() if "update" in k}
    text += print_section(
        "update_weights (all weights, pause + load + label + resume), ms",
        ["VLLMServerEngine, shared path", "VLLMServerEngine, label only", "VLLMEngine (in process)",
         "server start s"],
        [[ms["server_update_weights"], ms["server_update_label"], ms["inprocess_update_weights"],
          min(timings["server_start"])]],
    )  # fmt: skip
    text += print_section(
        f"HTTP clients: streamed replies/s at {config['clients']} concurrent requests (best of 3)",
        ["aiohttp", "httpx", "aiohttp / httpx"],
        [[clients["aiohttp"], clients["httpx"], f"{clients['aiohttp'] / clients['httpx']:.2f}"]],
    )
    payload = {"config": config, "tokens_per_run": tokens, "seconds": timings}
    payload |= {"tokens_per_s": rates, "client_requests_per_s": clients}
    save_outputs(out, "server_throughput", _plot(rates, ms, clients), payload, text)


def _plot(rates: dict[str, list[float]], ms: dict[str, float], clients: dict[str, float]) -> Any:
    fig, (ax, ax_upd, ax_cli) = new_figure(1, 3, width=5.2, height=3.4)
    base = statistics.median(rates["llm_generate"])
    for row, (key, _) in enumerate(PATHS):
        median = statistics.median(rates[key])
        ax.barh(row, median, color=("#888888", "#1f77b4", "#ff7f0e")[row])
        ax.plot(rates[key], [row] * len(rates[key]), "k|", markersize=14)
        ax.text(median, row, f" {median / base:.2f}x", va="center")
    ax.set_yticks(range(len(PATHS)), ["LLM.generate", "VLLMEngine", "VLLMServerEngine"])
    ax.invert_yaxis()
    ax.set_xlabel("generated tokens/s (bar: median, ticks: runs)")
    keys = ["server_update_weights", "server_update_label", "inprocess_update_weights"]
    ax_upd.bar(range(3), [ms[k] for k in keys], color=["#ff7f0e", "#fdae6b", "#1f77b4"])
    ax_upd.set_xticks(range(3), ["server\nweights", "server\nlabel only", "in-process\nweights"])
    ax_upd.set_ylabel("update_weights median ms")
    ax_cli.bar(range(2), [clients["aiohttp"], clients["httpx"]], color=["#2ca02c", "#9467bd"])
    ax_cli.set_xticks(range(2), ["aiohttp", "httpx"])
    ax_cli.set_ylabel("streamed replies/s")
    return fig


if __name__ == "__main__":
    sys.exit(main())
