"""The library's logging (SimEngine: a simulation). A storm of failures costs a few WARNING lines;
DEBUG has every drop and state change; records never keep a dropped group's payload alive; the
library prints nothing."""

from __future__ import annotations

import ast
import gc
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

import asyncroll
from asyncroll import Producer, SamplingConfig
from asyncroll._core.logs import FailureWarnings
from tests.test_producer import (
    VOCAB,
    RecordingEngine,
    consume_all,
    make_producer,
    parity_reward,
    prompts,
)


class KeepAll(logging.Handler):
    """Keeps every record, as caplog or a MemoryHandler would: the worst case for references."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def at(self, level: int) -> list[logging.LogRecord]:
        return [r for r in self.records if r.levelno == level]


@pytest.fixture
def kept() -> Iterator[KeepAll]:
    logger = logging.getLogger("asyncroll")
    handler, level = KeepAll(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_storm_of_failures_is_one_warning_per_interval() -> None:
    logger = logging.getLogger("asyncroll.test")
    handler = KeepAll()
    logger.addHandler(handler)
    try:
        clock = FakeClock()
        warnings = FailureWarnings(logger, interval_s=60.0, clock=clock)
        for i in range(10_000):
            warnings.record("engine_error" if i % 3 else "reward_deadline", "math", f"boom {i}")
        assert warnings.logged == 1  # the first failure, at once
        clock.now += 59.0
        warnings.record("engine_error", "code", "late")
        warnings.tick()
        assert warnings.logged == 1  # still inside the interval
        clock.now += 1.0
        warnings.tick()  # the interval passed with failures pending: one summary of all of them
        assert warnings.logged == 2
        warnings.flush()  # nothing pending: nothing logged
        assert warnings.logged == 2
    finally:
        logger.removeHandler(handler)
    first, summary = (r.getMessage() for r in handler.records)
    assert first.startswith("1 group failed by reason: reward_deadline: 1 (e.g. boom 0)")
    assert summary.startswith("10000 groups failed in the last 60 s by reason: engine_error: 6667")
    assert "reward_deadline: 3333" in summary and "math: 9999" in summary and "code: 1" in summary
    assert all(r.levelno == logging.WARNING for r in handler.records)


async def test_a_producer_failing_every_group_logs_two_warnings(kept: KeepAll) -> None:
    """2,000 groups fail (an engine that rejects every request): one warning at the first, one
    summary when the run ends, and a DEBUG line per drop."""
    producer = make_producer(
        2000, sim={"fail_rate": 1.0}, group_size=2, max_dropped_in_a_row=None,
        failure_log_interval_s=3600.0,
    )  # fmt: skip
    async with producer:
        assert await consume_all(producer, 16) == []
    assert producer.progress.counters.failed_groups == 2000
    warnings = [r.getMessage() for r in kept.at(logging.WARNING)]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("1 group failed by reason: engine_error: 1 (e.g. engine error")
    assert warnings[1].startswith("1999 groups failed in the last")
    drops = [r for r in kept.at(logging.DEBUG) if "dropped_failed" in r.getMessage()]
    assert len(drops) == 2000


async def test_state_changes_are_logged_at_debug(kept: KeepAll) -> None:
    producer = make_producer(20, batch_size=4)
    async with producer:
        await producer.produce_batch()
        await producer.update_weights()
    messages = [r.getMessage() for r in kept.at(logging.DEBUG)]
    for expected in (
        "Phase: new -> running", "Gate: open -> draining", "Gate: draining -> closed",
        "Gate: closed -> open", "policy version 0 -> 1", "Phase: running -> stopping",
        "Phase: stopping -> stopped",
    ):  # fmt: skip
        assert expected in messages, (expected, messages)
    assert {r.name for r in kept.records} <= {"asyncroll.producer", "asyncroll._core.lifecycle"}


async def test_log_records_keep_no_payload_alive(kept: KeepAll) -> None:
    """Every record is kept (as caplog does) and every failure logs a WARNING: still, every
    array the engine returned is freed once its group has landed (drop on arrival)."""
    engine = RecordingEngine(vocab_size=VOCAB, fail_rate=0.3, payload_bytes_per_sample=4096)
    producer = Producer(
        engine, prompts(200), parity_reward, group_size=4, filter="nonzero_std",
        sampling=SamplingConfig(max_new_tokens=32), failure_log_interval_s=0.0,
    )  # fmt: skip
    gc.disable()
    try:
        async with producer:
            await consume_all(producer, 16)
        assert engine.refs and all(r() is None for r in engine.refs)
    finally:
        gc.enable()
    assert producer.progress.counters.failed_groups > 20
    failures = [r for r in kept.at(logging.WARNING) if "by reason" in r.msg]  # not the last batch's
    assert len(failures) == producer.progress.counters.failed_groups
    assert len(kept.at(logging.DEBUG)) > producer.progress.counters.failed_groups
    for record in kept.records:  # only numbers and strings: nothing that could hold a group
        assert record.exc_info is None
        assert all(isinstance(a, int | float | str | None) for a in record.args or ())


async def test_the_library_prints_nothing(capfd: pytest.CaptureFixture[str]) -> None:
    """Failures, drops and a stop are logged, never printed, and with logging unconfigured
    (the `NullHandler` on "asyncroll") nothing reaches stderr either."""
    producer = make_producer(200, sim={"fail_rate": 0.5}, filter="nonzero_std")
    async with producer:
        await consume_all(producer, 8)
    assert producer.progress.counters.failed_groups > 10
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_no_print_in_the_library() -> None:
    """Only the command line and the demo write to the terminal; the library logs."""
    package = Path(asyncroll.__file__).parent
    allowed = {package / "app" / name for name in ("cli.py", "demo.py", "demo_ranks.py")}
    found = [
        f"{path.relative_to(package)}:{node.lineno}"
        for path in sorted(package.rglob("*.py"))
        if path not in allowed
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print"
    ]
    assert not found
