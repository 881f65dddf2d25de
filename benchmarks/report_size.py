"""The report of a large run: build time, size on disk and page load time in headless Chromium.

A synthetic record (written here with the record's own line structs: no producer, no model)
of `--steps` steps x `--groups` groups x `--samples` samples x `--tokens` tokens, every
sample with its pieces, logprobs, versions and a trainer line with logprobs and advantages,
as `asyncroll.record` writes them. Measured: the record's size, `build_report`'s wall time
and peak RSS, the report's size (all of it, its first-load part `data/run.js`, one chunk), and
in headless Chromium (tests/browser.py) the time to open the page (its load event: the index
and the curves) and then to open one sample (its chunk's script added, parsed and drawn),
`--loads` times each, median.

    python benchmarks/report_size.py                # 1,000 x 8 x 8 x 256 (16.4 M tokens)
    python benchmarks/report_size.py --quick        # 20 steps
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np
from _common import ROOT, run_info

sys.path.insert(0, str(ROOT))

from asyncroll.record.format import (
    RECORD_DIR,
    GroupLine,
    RunLine,
    SampleLine,
    StepLine,
    TrainLine,
)
from asyncroll.report import build_report

PIECES = [f"w{i}" for i in range(64)] + [" ", "\n", "é", "<tool>"]


def write_record(run: Path, steps: int, groups: int, samples: int, tokens: int) -> int:
    """The synthetic record, one file per 100 steps; returns its bytes."""
    rng = np.random.default_rng(0)
    encoder = msgspec.json.Encoder()
    folder = run / RECORD_DIR
    folder.mkdir(parents=True)
    out = None
    uid = 0
    for step in range(steps):
        if step % 100 == 0:
            if out is not None:
                out.close()
            out = (folder / f"rollouts-{step // 100:06d}.jsonl").open("wb")
            if step == 0:
                out.write(encoder.encode(RunLine(started="2026-12-07T00:00:00+00:00")) + b"\n")
        assert out is not None
        rewards = []
        for _ in range(groups):
            uid += 1
            group_samples, train = [], []
            for i in range(samples):
                ids = rng.integers(0, len(PIECES), tokens)
                lp = (-rng.random(tokens)).astype(np.float32)
                reward = float(rng.integers(0, 2))
                rewards.append(reward)
                group_samples.append(
                    SampleLine(
                        index=i, status="completed", finish_reason="length", reward=reward,
                        error=None, tokens=ids.tolist(), pieces=[PIECES[t] for t in ids],
                        logprobs=lp.astype(np.float64).tolist(),
                        versions=np.full(tokens, max(step - 1, 0)).tolist(),
                        loss_mask=None, turn_ends=None,
                    )
                )  # fmt: skip
                trainer = (lp + rng.normal(0, 0.01, tokens)).astype(np.float32)
                train.append(TrainLine(
                    step=step, uid=uid, index=i, logprobs=trainer.astype(np.float64).tolist(),
                    advantages=np.full(tokens, reward - 0.5, dtype=np.float64).tolist(),
                ))  # fmt: skip
            out.write(encoder.encode(GroupLine(
                uid=uid, prompt_id=f"prompt-{uid % 977}", task="echo", status="completed",
                error=None, step=step, version=step, start_version=max(step - 1, 0),
                attempts=1, latency_s=0.5, prompt_tokens=[1, 2, 3], prompt_text="q:",
                samples=group_samples,
            )) + b"\n")  # fmt: skip
            out.write(b"".join(encoder.encode(t) + b"\n" for t in train))
        metrics = {
            "rollout/reward_mean": float(np.mean(rewards)),
            "rollout/tokens_per_s": 1000.0,
            "rollout/staleness_mean": 1.0,
            "rollout/wait_ratio": 0.1,
            "train/loss": 1.0 / (step + 1),
        }
        out.write(encoder.encode(StepLine(step=step, version=step, time_s=step, metrics=metrics)))
        out.write(b"\n")
    assert out is not None
    out.close()
    return sum(p.stat().st_size for p in folder.iterdir())


async def page_times(index: Path, uid: int, loads: int) -> tuple[float, float]:
    """Median seconds to open the page (load event), then to show one sample of group `uid`."""
    from tests.browser import chromium

    opened, sampled = [], []
    async with chromium() as browser:
        for n in range(loads):
            start = time.perf_counter()
            await browser.open(index.as_uri() + f"#page={n}")
            opened.append(time.perf_counter() - start)
            start = time.perf_counter()
            await browser.evaluate(f"asyncrollReport.open({uid}, 0)")
            sampled.append(time.perf_counter() - start)
            assert not browser.errors, browser.errors
            count = await browser.evaluate("document.querySelectorAll('#tokens .tok').length")
            assert count > 0, "no sample shown"
    return statistics.median(opened), statistics.median(sampled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--loads", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="20 steps")
    parser.add_argument("--out", type=Path, default=None, help="keep the run folder here")
    args = parser.parse_args()
    if args.quick:
        args.steps = 20
    with tempfile.TemporaryDirectory() as tmp:
        run = (args.out or Path(tmp)) / "run"
        start = time.perf_counter()
        record_bytes = write_record(run, args.steps, args.groups, args.samples, args.tokens)
        write_s = time.perf_counter() - start
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        start = time.perf_counter()
        index = build_report(run)
        build_s = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        files = [p for p in index.parent.rglob("*") if p.is_file()]
        chunks = sorted(p for p in files if p.name.startswith("chunk-"))
        middle = args.steps // 2 * args.groups + 1  # a group of the middle step
        opened, sampled = asyncio.run(page_times(index, middle, args.loads))
        tokens = args.steps * args.groups * args.samples * args.tokens
        rows = [
            ("run", f"{args.steps} steps x {args.groups} groups x {args.samples} samples x "
                    f"{args.tokens} tokens = {tokens / 1e6:.1f} M tokens"),
            ("record (JSON Lines)",
             f"{record_bytes / 2**20:,.0f} MiB (written in {write_s:.0f} s)"),
            ("build_report", f"{build_s:.1f} s ({tokens / build_s / 1e6:.2f} M tokens/s)"),
            ("peak RSS while building", f"{peak:,.0f} MiB (before: {before:,.0f} MiB)"),
            ("report, all files", f"{sum(p.stat().st_size for p in files) / 2**20:,.0f} MiB"),
            ("first load: data/run.js",
             f"{(index.parent / 'data' / 'run.js').stat().st_size / 2**20:.2f} MiB"),
            ("one chunk (10 steps)", f"{chunks[len(chunks) // 2].stat().st_size / 2**20:.1f} MiB,"
                                     f" {len(chunks)} chunks"),
            ("open the page (load event)", f"{opened * 1000:.0f} ms (median of {args.loads})"),
            ("then open one sample (its chunk)", f"{sampled * 1000:.0f} ms"),
        ]  # fmt: skip
        info = run_info()
        print(f"report_size, {info['date']}, commit {info['commit']}")
        print("| what | measured |\n|---|---|")
        for name, value in rows:
            print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
