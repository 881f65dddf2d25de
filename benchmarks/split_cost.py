"""Which cost model predicts a micro-batch's forward + backward time: tokens or squared lengths.

`split_batch` deals rows to ranks by a per-row cost, so that ranks finish together: "tokens"
(a row's length; the linear layers' work) or "squared" (its length squared; attention's work,
TRL's balance). This builds micro-batches as `split_batch` does (random batches, lengths spread
log-uniformly over 16..max, packed within a token budget), times each one's forward and
backward on the tiny Llama model (`token_logprobs` + `policy_loss` + backward, the work of one
micro-batch in `train_step`), and fits time = a + b x for each predictor x: the sum of the
rows' lengths, the sum of their squares, and, for reference, the padded size the micro-batch
actually computes (rows x longest row, known only after packing). It reports R^2 and the
median relative error of each fit, and the same for the per-rank totals of a split (what the
balance needs: the sum over a rank's micro-batches), and, splitting each batch by each model,
the measured imbalance of the ranks' times (max / mean).

Timings are the process's CPU time (`time.process_time`), the best of `--repeats` runs of each
micro-batch on one torch thread: on a shared 2-core machine the wall time mostly measured the
other processes (R^2 of every predictor under 0.4 in a first run under a load of 8).

    python benchmarks/split_cost.py            # ~60 micro-batches up to 1,024 tokens, ~6 min
    python benchmarks/split_cost.py --quick    # ~12 micro-batches up to 256 tokens, ~30 s
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import DEFAULT_OUT, info_line, new_figure, print_section, run_info, save_outputs

from asyncroll.app.models import build_tiny_model
from asyncroll.train import LossNorm, TrainBatch, policy_loss, split_batch, token_logprobs

PREDICTORS = ("tokens", "squared", "padded")


def random_batch(rng: random.Random, rows: int, longest: int, vocab: int) -> TrainBatch:
    """`rows` right-padded rows of log-uniform lengths in [16, longest], the first quarter of
    each a prompt (untrained)."""
    lengths = [round(16 * (longest / 16) ** rng.random()) for _ in range(rows)]
    width = max(lengths)
    n = torch.tensor(lengths)
    attention = torch.arange(width) < n[:, None]
    trained = attention & (torch.arange(width) >= (n // 4)[:, None])
    return TrainBatch(
        input_ids=torch.randint(3, vocab, (rows, width)) * attention,
        attention_mask=attention,
        loss_mask=trained,
        old_logprobs=-torch.rand(rows, width) * trained,
        versions=torch.zeros(rows, width, dtype=torch.int32),
        advantages=torch.randn(rows),
        rewards=torch.zeros(rows),
        group_index=torch.arange(rows),
    )


def step_time(model: Any, batch: TrainBatch, norm: LossNorm, repeats: int) -> float:
    """Best of `repeats` forward + backward passes of one micro-batch, in CPU seconds of this
    process (one torch thread: the work itself, not the time other processes took the core)."""
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms the allocator for these shapes
        start = time.process_time()
        logits = model(batch.input_ids, attention_mask=batch.attention_mask.long()).logits
        logprobs = token_logprobs(logits, batch.input_ids)
        loss, _ = policy_loss(logprobs, batch, norm=norm)
        loss.backward()
        model.zero_grad(set_to_none=True)
        best = min(best, time.process_time() - start)
    return best


def measure(model: Any, batch: TrainBatch, norm: LossNorm, repeats: int) -> dict[str, float]:
    """A micro-batch's time and its three predictors."""
    lengths = batch.attention_mask.sum(-1).double()
    return {
        "seconds": step_time(model, batch, norm, repeats),
        "tokens": float(lengths.sum()),
        "squared": float(lengths.square().sum()),
        "padded": float(batch.input_ids.numel()),
    }


def fit(x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Least squares y = a + b x: R^2 and the median |relative error|."""
    design = np.stack([np.ones_like(x), x], axis=1)
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    predicted = design @ coef
    residual = ((y - predicted) ** 2).sum()
    r2 = 1 - residual / ((y - y.mean()) ** 2).sum()
    return {
        "r2": float(r2),
        "median_rel_error": float(np.median(np.abs(predicted - y) / y)),
        "a_ms": float(coef[0] * 1e3),
        "b_ms": float(coef[1] * 1e3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI size")
    parser.add_argument("--longest", type=int, default=None, help="longest row (tokens)")
    parser.add_argument("--batches", type=int, default=None, help="random batches to split")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=None, help="micro-batch budget")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--stem", default="split_cost")
    args = parser.parse_args()
    longest = args.longest or (256 if args.quick else 1024)
    batches = args.batches or (2 if args.quick else 6)
    max_tokens = args.max_tokens or 4 * longest
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(), dtype=torch.float32)
    vocab = model.config.vocab_size
    samples: list[dict[str, float]] = []
    ranks: list[dict[str, float]] = []
    imbalance: dict[str, list[float]] = {cost: [] for cost in ("tokens", "squared")}
    for _ in range(batches):
        batch = random_batch(rng, 32, longest, vocab)
        for cost in imbalance:  # the same batch split by each cost model
            times = []
            for shard in split_batch(batch, args.ranks, max_tokens=max_tokens, cost=cost):
                total = {"seconds": 0.0, **dict.fromkeys(PREDICTORS, 0.0)}
                for micro in shard.micro_batches:
                    if not micro.padding:
                        sample = measure(model, micro.batch, shard.norm, args.repeats)
                        samples.append(sample)
                        total = {k: v + sample[k] for k, v in total.items()}
                ranks.append(total)
                times.append(total["seconds"])
            imbalance[cost].append(max(times) / (sum(times) / len(times)))
        print(f"{len(samples)} micro-batches timed", flush=True)

    info = run_info()
    report = (
        f"## split_cost: which cost predicts a micro-batch's forward + backward time\n\n"
        f"{info_line(info)}\n\ntiny Llama ({sum(p.numel() for p in model.parameters()):,} "
        f"parameters, vocab {vocab}), one torch thread; {len(samples)} micro-batches of "
        f"{batches} random batches of 32 rows (16..{longest} tokens, log-uniform), split over "
        f"{args.ranks} ranks within {max_tokens} padded tokens; best of {args.repeats}.\n"
    )
    results: dict[str, Any] = {}
    for level, rows in (("micro-batch", samples), ("rank", ranks)):
        y = np.array([s["seconds"] for s in rows])
        fits = {p: fit(np.array([s[p] for s in rows]), y) for p in PREDICTORS}
        results[level] = fits
        report += print_section(
            f"per {level} ({len(rows)}): time = a + b x",
            ["predictor x", "R^2", "median relative error", "a (ms)", "b (ms per unit)"],
            [
                [p, f["r2"], f["median_rel_error"], f["a_ms"], f"{f['b_ms']:.3g}"]
                for p, f in fits.items()
            ],
        )
    report += print_section(
        "measured time imbalance of the split by each cost model (max / mean of the ranks' times)",
        ["split by", "mean", "worst", "batches"],
        [[c, float(np.mean(v)), float(max(v)), len(v)] for c, v in imbalance.items()],
    )
    results["time_imbalance"] = imbalance
    fig, axes = new_figure(1, 2, width=11, height=4)
    y = np.array([s["seconds"] for s in samples]) * 1e3
    for ax, p in zip(axes, ("tokens", "squared"), strict=True):
        ax.scatter([s[p] for s in samples], y, s=12)
        ax.set(xlabel=f"{p} of the micro-batch", ylabel="forward + backward (ms)")
        ax.set_title(f"{p}: R^2 {results['micro-batch'][p]['r2']:.3f}")
    save_outputs(
        args.out,
        args.stem,
        fig,
        {"info": info, "args": vars(args) | {"out": str(args.out)}, "samples": samples,
         "ranks": ranks, "fits": results},
        report,
    )  # fmt: skip


if __name__ == "__main__":
    main()
