"""HTTP to the `vllm serve` replicas of a `VLLMServerEngine`: two connection pools, a deadline
on every call, and the engine's own closing told apart from a replica's failure.

Generate streams and control calls never share connections. Streams use a pool bounded by
`max_connections`; control calls (pauses, loads, labels, aborts, health and liveness probes)
use a pool of their own, unbounded (each is short, bounded by its deadline, and their count
by the replicas and the requests in flight): with one shared pool, `max_connections` open
streams once left a keep-mode update's `/pause` waiting for a connection until both healthy
replicas were marked down.

Every error of a call to a replica comes out as that replica's `ReplicaError`
(`replicas.control`, `replicas.liveness`), whatever aiohttp raised; only the engine closing
the pool under a call in flight comes out as `EngineDeadError`.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp

from asyncroll.engines.base import EngineDeadError
from asyncroll.engines.server import replicas as rp
from asyncroll.engines.server.replicas import Replica, ReplicaError

Sessions = Callable[[int], aiohttp.ClientSession]
"""Makes an HTTP session with at most that many connections (0: no limit). The seam of the
control plane's deterministic simulation (`benchmarks/control_sim.py`), whose sessions
answer as simulated replicas on a virtual clock; None: aiohttp's."""

LIVENESS = "asyncroll-liveness"
"""The request id prefix of a liveness probe's generate (tests and logs tell them apart)."""


class ReplicaClient:
    """The engine's HTTP client: its session is made in the loop that first uses it (the
    engine may be built outside one) and never again once closed."""

    def __init__(
        self,
        *,
        max_connections: int,
        connect_timeout_s: float,
        control_timeout_s: float,
        health_timeout_s: float,
        liveness_timeout_s: float,
        sessions: Sessions | None = None,
    ) -> None:
        self._sessions = sessions
        self.max_connections = max_connections
        self.connect_timeout_s = connect_timeout_s
        self.control_timeout_s = control_timeout_s
        self.health_timeout_s = health_timeout_s
        self.liveness_timeout_s = liveness_timeout_s
        self.closed = False
        self._http: aiohttp.ClientSession | None = None
        self._control: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        """The pool of generate streams (`max_connections`)."""
        if self._http is None:
            self._http = self._new_session(self.max_connections)
        return self._http

    def control_session(self) -> aiohttp.ClientSession:
        """The pool of control calls and probes: never queued behind streams."""
        if self._control is None:
            self._control = self._new_session(0)  # aiohttp: 0 is no limit
        return self._control

    def _new_session(self, limit: int) -> aiohttp.ClientSession:
        if self.closed:  # never a new session once `close()` closed the last one
            raise EngineDeadError("VLLMServerEngine is closed")
        if self._sessions is not None:
            return self._sessions(limit)
        connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)
        return aiohttp.ClientSession(connector=connector, timeout=timeout)

    async def call(
        self,
        replica: Replica,
        method: str,
        path: str,
        json: Any = None,
        *,
        timeout_s: float | None = None,
        idempotent: bool = True,
        text: bool = False,
    ) -> Any:
        """A control call within `timeout_s` (default `control_timeout_s`); only an
        `idempotent` one is tried again after a connection error; `text`: the reply's body as
        text, not JSON (`replicas.control`)."""
        timeout = self.control_timeout_s if timeout_s is None else timeout_s
        if path.startswith("/pause"):
            replica.pauses += 1  # counted as sent: a reply that never comes may still land
        with self.dead_if_closed():
            return await rp.control(
                self.control_session(),
                replica,
                method,
                path,
                timeout_s=timeout,
                json=json,
                idempotent=idempotent,
                text=text,
            )

    async def check_alive(self, replica: Replica, *, paused: bool) -> None:
        """Raise `ReplicaError` unless `replica`'s engine core serves: a one-token generate
        within `liveness_timeout_s`. vLLM's `/health` reports a dead engine core, not a hung
        one, so a wedged replica passed it for ever. A paused replica cannot generate
        (vLLM queues the request): then `/health` is all there is to ask, which tells
        nothing of a HUNG core (`replica.core`, which the generate sets). A generate that a
        `/pause` overtook (a keep-mode pause freezes it) raises `ProbeOvertaken`: no verdict."""
        if paused:
            await self.call(replica, "GET", "/health", timeout_s=self.health_timeout_s)
            return
        body = {
            "request_id": f"{LIVENESS}-{uuid.uuid4().hex[:12]}",
            "token_ids": [0],
            "stream": True,
            "sampling_params": {"n": 1, "max_tokens": 1, "temperature": 0.0, "logprobs": 0},
        }
        pauses = replica.pauses
        with self.dead_if_closed():
            try:
                await rp.liveness(self.control_session(), replica, body, self.liveness_timeout_s)
            except ReplicaError as exc:
                if replica.pauses != pauses:
                    raise rp.ProbeOvertaken(str(exc)) from None
                replica.core = rp.CoreHealth.HUNG
                raise
        replica.core = rp.CoreHealth.ANSWERED

    @contextlib.contextmanager
    def dead_if_closed(self) -> Iterator[None]:
        """Around an HTTP call: `close()` closes the session under the calls in flight,
        which aiohttp reports as `RuntimeError("Session is closed")` or a lost connection.
        That is the engine's death, raised as such, not an error of the call or the
        replica."""
        try:
            yield
        except Exception as exc:
            if self.closed and not isinstance(exc, ReplicaError):
                raise EngineDeadError("VLLMServerEngine is closed") from None
            raise

    async def close(self) -> None:
        self.closed = True
        for session in (self._http, self._control):
            if session is not None:
                await session.close()
        self._http = self._control = None
