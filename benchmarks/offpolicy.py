"""Does off-policy correction recover what staleness costs? The demo's reward curve at
max_staleness 0, 1, 2, with and without correction, over seeds.

Each run is `asyncroll demo` (real vLLM on the tiny model, GRPO in torch, weight sync every
step) for a fixed number of steps, early stopping off. "none" trains with PPO clipped against the
behaviour policy; the correction (default "tis": decoupled PPO with truncated IS, cap 2) clips
around the trainer's own weights and weights each token by pi_prox / mu. Per setting, averaged
over seeds:

- reward, mean: mean reward over all steps (the area under the learning curve, per step);
- reward, last 5: mean reward of the last 5 steps;
- vs s0 none: both as a ratio to max_staleness 0 without correction (the synchronous run);
- KL, stale tokens: mean over steps of KL(behaviour || trainer) on tokens of staleness >= 1.

    python benchmarks/offpolicy.py            # 3 x 2 x 2 runs of 30 steps, ~7.5 min on 2 cores
    python benchmarks/offpolicy.py --quick    # CI smoke run: staleness 1, one seed, 3 steps
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from _common import DEFAULT_OUT, info_line, new_figure, print_section, run_info, save_outputs

from asyncroll.app.demo import DemoConfig, demo_model, run_demo
from asyncroll.app.demo_report import StepRecord
from asyncroll.engines import VLLMEngine

Key = tuple[int, str]  # (max_staleness, correction)


def main(argv: list[str] | None = None) -> int:
    asyncio.run(measure(parse_args(argv)))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--correction", default="tis", help="a key of training.CORRECTIONS")
    parser.add_argument("--quick", action="store_true", help="staleness 1, 1 seed, 3 steps")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.staleness, args.seeds = 3, [1], [0]
    return args


async def measure(args: argparse.Namespace, engine: VLLMEngine | None = None) -> None:
    """Every setting's runs, then the report. `engine`: an engine to run on instead of
    starting one (the test suite's smoke run uses its session's)."""
    runs: dict[Key, list[list[StepRecord]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        configs = [
            DemoConfig(
                steps=args.steps,
                max_staleness=s,
                seed=seed,
                correction=correction,
                out=f"{tmp}/{s}-{correction}-{seed}",
                solved_reward=0.0,
            )
            for s in args.staleness
            for correction in ("none", args.correction)
            for seed in args.seeds
        ]
        if engine is None:
            async with VLLMEngine(demo_model(configs[0]), seed=configs[0].seed) as started:
                records = await run_all(configs, started)
        else:
            records = await run_all(configs, engine)
        for config, recorded in zip(configs, records, strict=True):
            runs.setdefault((config.max_staleness, config.correction), []).append(recorded)
    report(runs, args.out, args.steps)


async def run_all(configs: list[DemoConfig], engine: VLLMEngine) -> list[list[StepRecord]]:
    """Each config's demo run, one after another on one engine (a start costs 11-20 s on 2
    cores), each starting from its model's weights at version 0 as a fresh engine would."""
    from safetensors.torch import load_file

    out = []
    for c in configs:
        print(f"max_staleness={c.max_staleness} correction={c.correction} seed={c.seed}: "
              f"{c.steps} steps", file=sys.stderr, flush=True)  # fmt: skip
        weights = list(load_file(demo_model(c) / "model.safetensors").items())
        await engine.update_weights(weights, version=0)
        out.append(await run_demo(c, progress=False, engine=engine))
    return out


def curve(runs: list[list[StepRecord]], steps: int) -> np.ndarray[Any, np.dtype[np.float64]]:
    """Reward per step, averaged over seeds (a run that stopped early holds its last value)."""
    rows = [[r.reward for r in records] for records in runs]
    padded = [row + [row[-1]] * (steps - len(row)) for row in rows]
    return np.mean(np.array(padded, dtype=np.float64), axis=0)


def stale_kl(runs: list[list[StepRecord]]) -> float:
    """Mean over steps of the token-weighted KL on tokens of staleness >= 1 (NaN if none)."""
    values = []
    for records in runs:
        for r in records:
            kl = [(v, r.offpolicy[k.replace("/kl", "/tokens")]) for k, v in r.offpolicy.items()
                  if k.startswith("offpolicy/staleness_") and k.endswith("/kl")
                  and not k.startswith("offpolicy/staleness_0/")]  # fmt: skip
            tokens = sum(n for _, n in kl)
            if tokens:
                values.append(sum(v * n for v, n in kl) / tokens)
    return float(np.mean(values)) if values else float("nan")


def report(runs: dict[Key, list[list[StepRecord]]], out: Path, steps: int) -> None:
    curves = {key: curve(r, steps) for key, r in runs.items()}
    base = curves.get((0, "none"))
    rows: list[list[Any]] = []
    summary: dict[str, dict[str, float]] = {}
    for (s, correction), c in curves.items():
        mean, last = float(c.mean()), float(c[-5:].mean())
        vs_mean = mean / float(base.mean()) if base is not None else float("nan")
        vs_last = last / float(base[-5:].mean()) if base is not None else float("nan")
        kl = stale_kl(runs[(s, correction)])
        rows.append([s, correction, len(runs[(s, correction)]), mean, f"{vs_mean:.2f}", last,
                     f"{vs_last:.2f}", kl])  # fmt: skip
        summary[f"{s}/{correction}"] = {"reward_mean": mean, "reward_last5": last,
                                        "vs_s0_mean": vs_mean, "vs_s0_last5": vs_last,
                                        "stale_kl": kl}  # fmt: skip
    text = "## Off-policy correction: the demo's reward at max_staleness 0 / 1 / 2\n\n"
    text += info_line(run_info()) + "\n"
    text += print_section(
        f"Reward per setting ({steps} steps, averaged over seeds)",
        ["max_staleness", "correction", "seeds", "reward, mean", "vs s0 none", "reward, last 5",
         "vs s0 none", "KL, stale tokens"],
        rows,
    )  # fmt: skip
    fig, axes = new_figure(1, 2, width=5.8, height=3.8)
    step_axis = np.arange(1, steps + 1)
    for (s, correction), c in curves.items():
        style = "-" if correction != "none" else "--"
        axes[0].plot(step_axis, c, style, color=f"C{s}", label=f"staleness {s}, {correction}")
    axes[0].set(title="reward (mean over seeds)", xlabel="step", ylim=(0, 1))
    axes[0].legend(fontsize=8)
    labels = [f"s{s}\n{c}" for s, c in curves]
    axes[1].bar(labels, [c.mean() for c in curves.values()],
                color=[f"C{s}" for s, _ in curves])  # fmt: skip
    axes[1].set(title="mean reward over the run", ylim=(0, 1))
    payload = {
        "summary": summary,
        "runs": {f"{s}/{c}": [msgspec.to_builtins(r) for r in rs] for (s, c), rs in runs.items()},
    }
    save_outputs(out, "offpolicy", fig, payload, text)


if __name__ == "__main__":
    sys.exit(main())
