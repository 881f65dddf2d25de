"""HTTP to the `vllm serve` replicas of a `VLLMServerEngine`: one bounded connection pool, a
deadline on every call, and the engine's own closing told apart from a replica's failure.

Every error of a call to a replica comes out as that replica's `ReplicaError`
(`replicas.control`, `replicas.liveness`), whatever aiohttp raised; only the engine closing
the pool under a call in flight comes out as `EngineDeadError`.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp

from asyncroll.engines import replicas as rp
from asyncroll.engines.base import EngineDeadError
from asyncroll.engines.replicas import Replica, ReplicaError

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
    ) -> None:
        self.max_connections = max_connections
        self.connect_timeout_s = connect_timeout_s
        self.control_timeout_s = control_timeout_s
        self.health_timeout_s = health_timeout_s
        self.liveness_timeout_s = liveness_timeout_s
        self.closed = False
        self._http: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._http is None:
            if self.closed:  # never a new session once `close()` closed the last one
                raise EngineDeadError("VLLMServerEngine is closed")
            connector = aiohttp.TCPConnector(
                limit=self.max_connections, limit_per_host=self.max_connections
            )
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)
            self._http = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return self._http

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
        with self.dead_if_closed():
            return await rp.control(
                self.session(),
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
        nothing of a HUNG core (`replica.core`, which the generate sets)."""
        if paused:
            await self.call(replica, "GET", "/health", timeout_s=self.health_timeout_s)
            return
        body = {
            "request_id": f"{LIVENESS}-{uuid.uuid4().hex[:12]}",
            "token_ids": [0],
            "stream": True,
            "sampling_params": {"n": 1, "max_tokens": 1, "temperature": 0.0, "logprobs": 0},
        }
        with self.dead_if_closed():
            try:
                await rp.liveness(self.session(), replica, body, self.liveness_timeout_s)
            except ReplicaError:
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
        if self._http is not None:
            await self._http.close()
            self._http = None
