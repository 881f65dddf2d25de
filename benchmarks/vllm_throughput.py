"""Tokens/s of `Producer` + `VLLMEngine` against vLLM's own offline `LLM.generate`.

Both run the same prompts, samples per prompt (n), lengths (eos ignored) and sampling settings
(temperature 1, the sampled token's logprob, no detokenization), one engine after the other in
this process, each warmed up, best of `--reps` timed runs. The producer path is measured with
VLLMEngine's two ways to send a group's n samples (one vLLM request with n=k, or k requests),
and the time of `update_weights` with the model's full weights is measured too.

    python benchmarks/vllm_throughput.py --quick --out bench-out          # CPU, tiny model
    python benchmarks/vllm_throughput.py --hidden 2048 --layers 16 --heads 16 --kv-heads 8 \\
        --intermediate 5632 --vocab 32000 --dtype bfloat16 --prompts 256 --out bench-gpu

Prints a table and writes `vllm_throughput.json` and `vllm_throughput.png` to `--out`.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import DEFAULT_OUT, info_line, new_figure, print_section, run_info, save_outputs

from asyncroll import Producer, SamplingConfig
from asyncroll.app.models import TinyModelConfig, build_tiny_model


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    on_cpu = not _cuda_available()
    if on_cpu:  # the same setting VLLMEngine gives its own processes, for a fair baseline
        os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    model = Path(args.model) if args.model else build_model(args)
    engine_args = dict(
        max_model_len=args.prompt_len + args.max_new_tokens + 8,
        dtype=args.dtype or ("float32" if on_cpu else "auto"),
        seed=0,
        **dict(_engine_arg(a) for a in args.engine_arg),
    )
    if on_cpu:
        engine_args.setdefault("kv_cache_memory_bytes", args.kv_cache_mib << 20)
    rng = np.random.default_rng(0)
    vocab = _vocab_size(model)
    prompts = [rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(args.prompts)]
    tokens = args.prompts * args.n * args.max_new_tokens
    print(
        f"model {model.name}: {args.prompts} prompts x n={args.n} x {args.max_new_tokens} new "
        f"tokens = {tokens} tokens per run, {args.reps} runs x {args.rounds} engine starts per "
        f"path; engine args {engine_args}",
        flush=True,
    )
    timings: dict[str, list[float]] = {}  # seconds, pooled over rounds
    for _ in range(args.rounds):  # alternate the engines, so load from others hits both alike
        for key, values in bench_llm(model, prompts, args, engine_args).items():
            timings.setdefault(key, []).extend(values)
        for key, values in asyncio.run(bench_producer(model, prompts, args, engine_args)).items():
            timings.setdefault(key, []).extend(values)
    report(timings, tokens, _weights_bytes(model), vars(args), Path(args.out))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small CI run (about a minute on CPU)")
    p.add_argument("--model", help="a Hugging Face model folder (default: build a random one)")
    defaults = TinyModelConfig()
    p.add_argument("--hidden", type=int, default=defaults.hidden_size)
    p.add_argument("--intermediate", type=int, default=defaults.intermediate_size)
    p.add_argument("--layers", type=int, default=defaults.num_layers)
    p.add_argument("--heads", type=int, default=defaults.num_heads)
    p.add_argument("--kv-heads", type=int, default=defaults.num_kv_heads)
    p.add_argument("--vocab", type=int, default=defaults.vocab_size)
    p.add_argument("--dtype", help="default: float32 on CPU, the model's on GPU")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3, help="timed runs per engine start")
    p.add_argument("--rounds", type=int, default=2, help="engine starts per path, alternated")
    p.add_argument("--update-reps", type=int, default=5)
    p.add_argument("--kv-cache-mib", type=int, default=512, help="CPU only")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra vLLM engine argument, e.g. tensor_parallel_size=2")  # fmt: skip
    p.add_argument("--out", default=str(DEFAULT_OUT))
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens, args.reps, args.rounds = 32, 128, 2, 1
    return args


def build_model(args: argparse.Namespace) -> Path:
    return build_tiny_model(
        name=f"bench-h{args.hidden}-l{args.layers}",
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=max(1024, args.prompt_len + args.max_new_tokens + 8),
    )


def bench_llm(
    model: Path, prompts: list[list[int]], args: argparse.Namespace, engine_args: dict[str, Any]
) -> dict[str, list[float]]:
    """vLLM's offline API: every prompt in one `LLM.generate` call, as a batch job would."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(str(model), skip_tokenizer_init=True, enforce_eager=True, **engine_args)
    started = time.perf_counter() - start

    def run(llm: Any, max_tokens: int) -> float:
        params = SamplingParams(
            n=args.n, max_tokens=max_tokens, temperature=1.0, ignore_eos=True, logprobs=0,
            flat_logprobs=True, detokenize=False,
        )  # fmt: skip
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        t = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        assert sum(len(c.token_ids) for o in outputs for c in o.outputs) == (
            len(prompts) * args.n * max_tokens
        )
        return elapsed

    run(llm, 8)  # warm up
    times = [run(llm, args.max_new_tokens) for _ in range(args.reps)]
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return {"llm_generate": times, "llm_start": [started]}


async def bench_producer(
    model: Path, prompts: list[list[int]], args: argparse.Namespace, engine_args: dict[str, Any]
) -> dict[str, list[float]]:
    """The producer on VLLMEngine, with a group's samples as k requests and as one n=k
    request, alternated run by run; then `update_weights` with all the model's weights."""
    from asyncroll.engines import VLLMEngine

    start = time.perf_counter()
    engine = VLLMEngine(model, **engine_args)
    out: dict[str, list[float]] = {"engine_start": [time.perf_counter() - start]}
    async with engine:
        await run_producer(engine, prompts, args.n, 8)  # warm up
        for _ in range(args.reps):
            for key, parallel in (("producer_separate", False), ("producer_n_parallel", True)):
                engine.parallel_sampling = parallel
                elapsed = await run_producer(engine, prompts, args.n, args.max_new_tokens)
                out.setdefault(key, []).append(elapsed)
        out["update_weights"] = await time_updates(engine, model, args.update_reps)
    return out


async def run_producer(engine: Any, prompts: list[list[int]], n: int, max_new_tokens: int) -> float:
    """Seconds for the producer to deliver every prompt's group (all admitted at once)."""

    async def reward(group: Any) -> list[float]:
        return [0.0] * group.num_samples

    producer = Producer(
        engine, prompts, reward, group_size=n, max_inflight_groups=len(prompts),
        max_buffer_groups=len(prompts),
        sampling=SamplingConfig(max_new_tokens=max_new_tokens, ignore_eos=True),
    )  # fmt: skip
    async with producer:  # its scheduler starts at the first await below
        start = time.perf_counter()
        batch = await producer.produce_batch(len(prompts))
        elapsed = time.perf_counter() - start
        producer.check_ledger()
    assert batch.delta.consumed_tokens == len(prompts) * n * max_new_tokens
    return elapsed


async def time_updates(engine: Any, model: Path, reps: int) -> list[float]:
    """Seconds per `update_weights` with every weight of the model, from the device a trainer
    would hold them on."""
    from safetensors.torch import load_file

    weights = load_file(model / "model.safetensors")
    if _cuda_available():
        weights = {k: v.cuda() for k, v in weights.items()}
    times = []
    for version in range(1, reps + 1):
        t = time.perf_counter()
        await engine.update_weights(weights.items(), version=version)
        times.append(time.perf_counter() - t)
    return times


PATHS = (
    ("llm_generate", "vLLM LLM.generate (offline)"),
    ("producer_separate", "Producer + VLLMEngine, k requests"),
    ("producer_n_parallel", "Producer + VLLMEngine, n=k request"),
)


def report(
    timings: dict[str, list[float]], tokens: int, weight_bytes: int, config: Any, out: Path
) -> None:
    rates = {key: [tokens / t for t in timings[key]] for key, _ in PATHS}
    base_best = max(rates["llm_generate"])
    base_median = statistics.median(rates["llm_generate"])
    rows = [
        [name, max(rates[key]), statistics.median(rates[key]),
         f"{max(rates[key]) / base_best:.3f}", f"{statistics.median(rates[key]) / base_median:.3f}"]
        for key, name in PATHS
    ]  # fmt: skip
    upd = timings["update_weights"]
    text = "## vLLM: Producer + VLLMEngine next to offline LLM.generate\n\n"
    text += info_line(run_info()) + "\n\n"
    text += (
        f"{config['prompts']} prompts x n={config['n']} x {config['max_new_tokens']} new "
        f"tokens (eos ignored) per run; {config['reps']} runs x {config['rounds']} engine "
        "starts per path\n"
    )
    text += print_section(
        "Generated tokens/s", ["path", "best", "median", "best vs LLM", "median vs LLM"], rows
    )
    text += print_section(
        "Engine start and weight update",
        ["LLM start s", "VLLMEngine start s", "weights MiB", "update_weights median ms",
         "update_weights min ms"],
        [[min(timings["llm_start"]), min(timings["engine_start"]), weight_bytes / 2**20,
          statistics.median(upd) * 1e3, min(upd) * 1e3]],
    )  # fmt: skip
    payload = {"config": config, "tokens_per_run": tokens, "weight_bytes": weight_bytes}
    payload |= {"seconds": timings, "tokens_per_s": rates}
    save_outputs(out, "vllm_throughput", _plot(rates), payload, text)


def _plot(rates: dict[str, list[float]]) -> Any:
    fig, (ax,) = new_figure(1, 1, width=8, height=3.5)
    base = max(rates["llm_generate"])
    for row, (key, _) in enumerate(PATHS):
        best = max(rates[key])
        ax.barh(row, best, color=("#888888", "#1f77b4", "#6baed6")[row])
        ax.plot(rates[key], [row] * len(rates[key]), "k|", markersize=14)  # every run
        ax.text(best, row, f" {best / base:.3f}x", va="center")
    ax.set_yticks(range(len(PATHS)), [name for _, name in PATHS])
    ax.invert_yaxis()
    ax.set_xlabel("generated tokens/s (bar: best run, ticks: every run)")
    ax.set_title("same prompts, n and lengths")
    return fig


def _engine_arg(text: str) -> tuple[str, Any]:
    key, _, value = text.partition("=")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def _weights_bytes(model: Path) -> int:
    return (model / "model.safetensors").stat().st_size


def _vocab_size(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


if __name__ == "__main__":  # vLLM starts its processes with spawn: the guard is required
    sys.exit(main())
