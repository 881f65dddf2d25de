"""The library's logging: the `asyncroll` logger and its children, and a rate-limited summary
of failed groups.

asyncroll never prints and never configures logging: it logs to `logging.getLogger("asyncroll")`
and its children (`asyncroll.producer`, `asyncroll._core.lifecycle`, ...), which carry a
`NullHandler`, as Python's logging guide asks of libraries. The application decides what is
shown (`logging.basicConfig(level=logging.INFO)` shows the warnings and errors below).

Levels:

* ERROR: the producer stopped, once, with the reason it raises as `ProducerError`.
* WARNING: failed groups, summarised (`FailureWarnings`): the first failure at once, then at
  most one summary per `failure_log_interval_s`, counting the failures since the previous one by
  `FailureReason`, each with one example error. A storm of failures (an engine that rejects
  every request) costs a few lines, not one per group.
* DEBUG: every drop (uid, prompt id, outcome, error) and every state change (phase, gate,
  policy version).

Log records never hold a group, a sample or an array, and no exception is attached with
`exc_info`: every argument is a number or a string. A handler that keeps records (pytest's
`caplog`, a `MemoryHandler`, a queue to a slow sink) must not keep a dropped group's payload
alive, or dropping on arrival would free nothing.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

logging.getLogger("asyncroll").addHandler(logging.NullHandler())

_EXAMPLE_CHARS = 300  # an example error is cut to this length: one line, not a page


class FailureWarnings:
    """Summarises failed groups at WARNING, at most once per `interval_s` after the first.

    `record` counts a failure and logs when the previous warning is at least `interval_s` old
    (the first failure of a run logs at once); `flush` logs what is counted but not yet logged
    (at the end of a run, or from `tick` once the interval has passed with no new failure).
    Memory is one counter and one example string per `FailureReason`, however many groups fail.
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._interval_s = interval_s
        self._clock = clock
        self._pending: Counter[str] = Counter()
        self._examples: dict[str, str] = {}
        self._tasks: Counter[str] = Counter()
        self._last: float | None = None  # when the last warning went out
        self.logged = 0  # warnings emitted (tests and the curious)

    def record(self, reason: str, task: str, error: str | None) -> None:
        """Count one failed group; log if the previous warning is old enough."""
        self._pending[reason] += 1
        self._tasks[task] += 1
        if reason not in self._examples and error:
            self._examples[reason] = error[:_EXAMPLE_CHARS]
        self.tick()

    def tick(self) -> None:
        """Log the pending failures if the interval since the last warning has passed."""
        if self._pending and (self._last is None or self._clock() - self._last >= self._interval_s):
            self.flush()

    def flush(self) -> None:
        """Log every failure counted since the last warning, if any."""
        if not self._pending:
            return
        now = self._clock()
        total = self._pending.total()
        since = "" if self._last is None else f" in the last {now - self._last:.0f} s"
        reasons = "; ".join(
            f"{reason}: {count}"
            + (f" (e.g. {self._examples[reason]})" if reason in self._examples else "")
            for reason, count in self._pending.most_common()
        )
        tasks = ", ".join(f"{task}: {count}" for task, count in self._tasks.most_common(5))
        self._log.warning(
            "%d group%s failed%s by reason: %s; by task: %s (failures are summarised at most "
            "every %g s; DEBUG on logger 'asyncroll' logs each one)",
            total, "" if total == 1 else "s", since, reasons, tasks, self._interval_s,
        )  # fmt: skip
        self.logged += 1
        self._last = now
        self._pending.clear()
        self._examples.clear()
        self._tasks.clear()
