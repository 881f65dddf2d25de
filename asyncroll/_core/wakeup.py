"""A broadcast wake-up for coroutines that wait on a condition over plain state.

`asyncio.Condition` needs its lock held to notify, which synchronous code (a `put` that must
never block) cannot take. Here `notify()` is synchronous and wakes every waiter, and each waiter
re-checks its own predicate, so a wake-up can never be lost or misdirected.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Signal:
    """Wakes every `wait_until` waiter on `notify()`; each re-checks its predicate."""

    def __init__(self) -> None:
        # a dict, not a set: waiters wake in the order they came (a set's order follows
        # memory addresses, and a deterministic simulation replays only a fixed order)
        self._waiters: dict[asyncio.Future[None], None] = {}

    def notify(self) -> None:
        """Wake every coroutine currently waiting (they re-check their predicates)."""
        if not self._waiters:
            return
        waiters, self._waiters = self._waiters, {}
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait_until(self, predicate: Callable[[], bool], timeout: float | None = None) -> None:
        """Return once `predicate()` is true; raise `TimeoutError` after `timeout` seconds."""
        if predicate():
            return
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout):
            while not predicate():
                fut: asyncio.Future[None] = loop.create_future()
                self._waiters[fut] = None
                try:
                    await fut
                finally:
                    self._waiters.pop(fut, None)
