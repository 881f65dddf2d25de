"""What `token_logprobs` allocates besides the logits, per sampling filter, forward and backward.

The trainer's logprobs are a chosen logit minus a logsumexp over the vocabulary, so the logits
([B, L, V], 156 MB in bf16 for 2 x 256 tokens at Qwen's 152,064) are the memory a training step
cannot avoid. `token_logprobs` processes them in chunks of rows; this measures what the chunks
cost on top, as a share of the logits' own size:

- forward, extra: the peak of the process's resident memory during the forward pass, above
  what it held before (the logits and ids; there is no model), after a first pass of the same
  shapes has warmed torch up;
- backward, extra: the same during backward, less the gradient of the logits that backward
  must return (same size as the logits);
- against the naive trainer: `log_softmax` of the float32 logits, gathered (the full-size
  float32 tensor that chunking exists to avoid).

Each configuration runs in a fresh process with glibc's mmap threshold fixed at 64 KiB, so every
tensor of a chunk is mapped on allocation and unmapped on free, and the kernel's peak-RSS mark
(VmHWM, reset through /proc/self/clear_refs before each pass) is the true high-water mark of
live memory, kernels' own temporaries included. The tests assert the op-level budget
deterministically (`tests/test_training.py`, a tracker of every tensor torch allocates); this is
the ground truth under it.

    python benchmarks/logprob_memory.py            # 2 x 256 x 152,064, bf16 and float32: ~5 min
    python benchmarks/logprob_memory.py --quick    # 2 x 256 x 32,000, bf16 only, in parallel
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _common import DEFAULT_OUT, info_line, new_figure, print_section, run_info, save_outputs

FILTERS: dict[str, dict[str, Any]] = {
    "none": {},
    "top-p 0.9": {"top_p": 0.9},
    "top-k 50": {"top_k": 50},
    "top-k 50 + top-p 0.9": {"top_k": 50, "top_p": 0.9},
    "top-k vocab/2": {"top_k": "vocab/2"},  # `topk` returns half a chunk's values and ids
    "top-k vocab": {"top_k": "vocab"},
    "naive log_softmax": {},  # the baseline, not token_logprobs
}
TEMPERATURE = 0.7
LIMIT = 0.25  # the bound on the extra peak, as a share of the logits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=152_064)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--quick", action="store_true", help="2 x 256 x 32,000, bf16 only")
    parser.add_argument("--filters", nargs="+", choices=list(FILTERS), default=list(FILTERS))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one measurement, in a new process
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(json.loads(args.child))))
        return 0
    shape = (args.batch, args.length, args.vocab)
    dtypes = args.dtypes
    if args.quick:
        shape, dtypes = (2, 256, 32_000), ["bfloat16"]
    specs = [
        {"shape": shape, "dtype": dtype, "filter": name}
        for dtype in dtypes
        for name in args.filters
    ]
    # Each measurement is its own process's peak RSS, whatever runs beside it: --quick runs
    # them side by side (its times are then not one core's; the full run's are).
    with ThreadPoolExecutor(max_workers=os.cpu_count() if args.quick else 1) as pool:
        results = list(pool.map(run_child, specs))
    report(results, shape, args.out)
    worst = max(
        max(r["forward_share"], r["backward_share"])
        for r in results
        if r["filter"] != "naive log_softmax"
    )
    return 0 if worst < LIMIT else 1


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    print(f"{spec['dtype']} {spec['filter']}", file=sys.stderr, flush=True)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    return {**spec, **json.loads(proc.stdout.strip().splitlines()[-1])}


def _status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}


def _reset_peak() -> int:
    """Reset the peak-RSS mark to the current RSS; return that RSS."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status()["VmRSS"]


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from asyncroll.train import token_logprobs

    b, length, vocab = spec["shape"]
    torch.manual_seed(0)
    logits = (2 * torch.randn(b, length, vocab)).to(getattr(torch, spec["dtype"]))
    logits.requires_grad_(True)
    ids = torch.randint(vocab, (b, length))
    sizes = {"vocab/2": vocab // 2, "vocab": vocab}
    options = {k: sizes.get(v, v) for k, v in FILTERS[spec["filter"]].items()}

    def forward() -> torch.Tensor:
        if spec["filter"] == "naive log_softmax":
            full = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
            return full[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        return token_logprobs(logits, ids, temperature=TEMPERATURE, **options)

    # A first pass touches torch's code, thread pools and caches: resident memory that is no
    # allocation of the pass. The measured pass is the second.
    torch.autograd.grad(forward().sum(), logits)
    before = _reset_peak()
    start = time.perf_counter()
    out = forward()
    forward_s = time.perf_counter() - start
    forward_extra = _status()["VmHWM"] - before
    before = _reset_peak()
    start = time.perf_counter()
    (grad,) = torch.autograd.grad(out.sum(), logits)
    backward_s = time.perf_counter() - start
    backward_extra = _status()["VmHWM"] - before - grad.nbytes
    size = logits.nbytes
    return {
        "logits_bytes": size,
        "forward_share": forward_extra / size,
        "backward_share": backward_extra / size,
        "forward_s": forward_s,
        "backward_s": backward_s,
    }


def report(results: list[dict[str, Any]], shape: tuple[int, int, int], out: Path) -> None:
    b, length, vocab = shape
    text = f"## token_logprobs: extra memory at {b} x {length} x {vocab:,}\n\n"
    text += info_line(run_info()) + "\n"
    rows = [
        [
            r["dtype"],
            r["filter"],
            f"{r['logits_bytes'] / 1e6:.0f}",
            f"{r['forward_share']:.3f}",
            f"{r['backward_share']:.3f}",
            f"{r['forward_s']:.2f}",
            f"{r['backward_s']:.2f}",
        ]
        for r in results
    ]
    text += print_section(
        f"Peak RSS above the logits, as a share of the logits' size (T {TEMPERATURE})",
        ["logits", "filter", "logits MB", "forward, extra", "backward, extra", "forward s",
         "backward s"],
        rows,
    )  # fmt: skip
    dtypes = sorted({r["dtype"] for r in results})
    fig, axes = new_figure(1, len(dtypes), width=6.4, height=4.0)
    for ax, dtype in zip(axes, dtypes, strict=True):
        mine = [r for r in results if r["dtype"] == dtype]
        x = range(len(mine))
        ax.bar([i - 0.2 for i in x], [r["forward_share"] for r in mine], 0.4, label="forward")
        ax.bar([i + 0.2 for i in x], [r["backward_share"] for r in mine], 0.4, label="backward")
        ax.axhline(LIMIT, color="k", linestyle="--", linewidth=1, label=f"{LIMIT}x")
        ax.set_xticks(list(x), [r["filter"].replace(" + ", "\n+ ") for r in mine], fontsize=7)
        ax.set(title=f"{dtype} logits {b} x {length} x {vocab:,}", ylabel="extra / logits")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    save_outputs(out, "logprob_memory", fig, {"shape": shape, "results": results}, text)


if __name__ == "__main__":
    sys.exit(main())
