import math

import numpy as np

from asyncroll import ProduceProgress, ProgressCounters
from asyncroll._core.progress import LatencyHistogram


def test_quantiles_within_one_bucket() -> None:
    hist = LatencyHistogram()
    values = np.random.default_rng(0).lognormal(0, 1, 10_000)
    for v in values:
        hist.record(float(v))
    for q in (0.5, 0.9, 0.99):
        exact = float(np.quantile(values, q))
        got = LatencyHistogram.quantile(hist.counts, q)
        assert exact <= got * 1.0001 and got <= exact * LatencyHistogram.RATIO**2


def test_quantile_of_nothing_is_nan_and_extremes_are_clamped() -> None:
    hist = LatencyHistogram()
    assert math.isnan(LatencyHistogram.quantile(hist.counts, 0.5))
    hist.record(0.0)
    hist.record(1e9)
    assert hist.counts[0] == 1 and hist.counts[-1] == 1


def test_consume_gives_deltas_and_totals() -> None:
    progress = ProduceProgress()
    progress.counters.started_groups += 5
    progress.latency.record(0.5)
    delta, totals, latency, window = progress.consume()
    assert delta.started_groups == 5 and totals.started_groups == 5 and latency.sum() == 1
    progress.counters.started_groups += 2
    delta, totals, latency, window = progress.consume()
    assert delta.started_groups == 2 and totals.started_groups == 7 and latency.sum() == 0
    assert window >= 0


def test_restore_continues_totals_with_a_fresh_window() -> None:
    progress = ProduceProgress()
    progress.restore(ProgressCounters(started_groups=9), [0] * LatencyHistogram.BUCKETS)
    progress.counters.started_groups += 1
    delta, totals, _, _ = progress.consume()
    assert delta.started_groups == 1 and totals.started_groups == 10
