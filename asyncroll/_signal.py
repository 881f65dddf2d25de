"""A broadcast wake-up for coroutines that wait on a condition over plain state.

`asyncio.Condition` needs its lock held to notify, which synchronous code (a `put` that must
never block) cannot take. Here `notify()` is synchronous and wakes every waiter, and each waiter
re-checks its own predicate, so a wake-up can never be lost or misdirected.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Signal:
    def __init__(self) -> None:
        self._waiters: set[asyncio.Future[None]] = set()

    def notify(self) -> None:
        """Wake every coroutine currently waiting (they re-check their predicates)."""
        if not self._waiters:
            return
        waiters, self._waiters = self._waiters, set()
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
                self._waiters.add(fut)
                try:
                    await fut
                finally:
                    self._waiters.discard(fut)
