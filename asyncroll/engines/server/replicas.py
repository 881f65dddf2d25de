"""The `vllm serve` replicas behind `VLLMServerEngine`: their states, routing, and HTTP calls.

A replica is UNSYNCED until the engine has given it the current weights and version label
(at first use, and again after it came back), UP while it serves, and DOWN after it failed
until a health probe finds it answering again. A replica that answers but missed weights sent
over NCCL (they cannot be sent again) is STALE until the next weight update includes it.
Routing is rendezvous hashing of a session key over the UP replicas: a session stays on its
replica while that replica is up, and only the sessions of a replica that went down move.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from aiohttp.http_exceptions import LineTooLong


class ReplicaState(enum.Enum):
    UNSYNCED = "unsynced"  # not yet given the engine's weights and version label
    UP = "up"
    DOWN = "down"  # failed; probed again once `retry_at` has passed
    STALE = "stale"  # answers, but missed an NCCL broadcast: out until the next weight update


class CoreHealth(enum.Enum):
    """What the last one-token generate told of a replica's engine core. vLLM's `/health`
    passes a hung one, so only another generate brings a HUNG one back."""

    ANSWERED = "answered"  # its last liveness generate answered (or none was tried yet)
    HUNG = "hung"  # its last liveness generate failed


class ReplicaError(RuntimeError):
    """A call to one replica failed; the message starts with the replica's URL."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"replica {url}: {message}")
        self.url = url


class StreamLost(ReplicaError):
    """A generate stream's connection ended before its `[DONE]`: closed before the reply or
    mid-body, reset, refused, or a clean end too soon. That is the failure of one request,
    not by itself its replica's: a server that died and one that dropped a connection (a
    proxy, a keep-alive race, a loaded machine) look the same here, so the replica's
    liveness generate decides (`Supervisor.failed`), and the request is sent again if it
    passes (`request_path`). `cause`: what aiohttp (or the stream) said."""

    def __init__(self, url: str, cause: str) -> None:
        super().__init__(url, f"generate stream lost ({cause})")
        self.cause = cause


class ReplicaHTTPError(ReplicaError):
    """A replica answered a control call with an HTTP error status: `status` and the head of
    its body (`text`) let a caller tell a refusal of what it sent (an adapter vLLM cannot
    load) from the replica's own failure."""

    def __init__(self, url: str, message: str, status: int, text: str) -> None:
        super().__init__(url, message)
        self.status = status
        self.text = text


class NoReplicaError(RuntimeError):
    """No replica in the rotation took a request before its deadline: none served then, which
    is no dead engine (replicas come back); the message names each replica's state."""


class ProbeOvertaken(Exception):
    """A liveness generate ran out of time after a `/pause` reached its replica: a paused vLLM
    freezes it, so it proves nothing of the engine core (it is tried again after a resume)."""


class UnsyncedReplicaError(ReplicaError):
    """The replica serves weights this engine never gave it: its process restarted behind the
    engine's back (vLLM's initial weight label), and it answers every probe all the same."""


class Replica:
    """One `vllm serve` base URL and what the engine knows of it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.state = ReplicaState.UNSYNCED
        self.error: str | None = None  # why it went down
        self.retry_at = 0.0  # loop time of the next health probe while DOWN
        self.failures = 0  # failures in a row, since it last joined the rotation
        self.streams = 0  # generate requests open on it now
        self.sent = 0  # generate requests sent to it so far
        # the folder it was last told to load (None: none since the model it started from);
        # one an update reached before any committed may serve that update's weights
        self.loaded: Path | None = None
        # the identity of the process that took the weights it serves (`replica_load.process`):
        # a label is put on that process only (`WeightUpdates.label`)
        self.process: str | None = None
        self.core = CoreHealth.ANSWERED
        self.syncing = asyncio.Lock()
        self.pauses = 0  # `/pause` calls sent to it so far (a probe they overtook proves nothing)

    def mark_down(self, error: str, retry_at: float) -> None:
        self.state = ReplicaState.DOWN
        self.error = error
        self.retry_at = retry_at

    def fail(self, error: str, now: float, interval_s: float) -> None:
        """Out of the rotation: a circuit breaker, open until its next probe, which backs off
        with every failure in a row (a replica that keeps failing its probes is not paused
        and reloaded every `interval_s` for ever)."""
        self.failures += 1
        self.mark_down(error, now + backoff_s(interval_s, self.failures))

    def mark_up(self) -> None:
        self.state = ReplicaState.UP
        self.error = None
        self.failures = 0

    def mark_unsynced(self, error: str) -> None:
        """Out of the rotation until synced again (at once, by the next request's route)."""
        self.state = ReplicaState.UNSYNCED
        self.error = error

    def __repr__(self) -> str:
        return f"Replica({self.url!r}, {self.state.value})"


MAX_BACKOFF_DOUBLINGS = 5
"""A failing replica is probed at most `2**5` health intervals apart (160 s at 5 s)."""


def backoff_s(interval_s: float, failures: int) -> float:
    """How long a replica that failed `failures` times in a row waits for its next probe."""
    doublings: int = min(max(failures - 1, 0), MAX_BACKOFF_DOUBLINGS)
    return interval_s * (1 << doublings)


def pick(
    replicas: Sequence[Replica],
    session: str,
    states: frozenset[ReplicaState] = frozenset({ReplicaState.UP}),
) -> Replica | None:
    """The replica in one of `states` (UP ones by default) that `session` maps to
    (rendezvous hashing), or None when there is none."""
    best: tuple[bytes, Replica] | None = None
    for replica in replicas:
        if replica.state not in states:
            continue
        score = hashlib.blake2b(f"{session}\0{replica.url}".encode(), digest_size=8).digest()
        if best is None or score > best[0]:
            best = (score, replica)
    return None if best is None else best[1]


ERROR_BODY_BYTES = 500
"""How much of an error reply is read (and quoted): a replica's 500 page can be any size."""

REPLY_BYTES = 64 << 20
"""The largest control reply read (a `/collective_rpc` result of every worker); a longer one
is a replica answering garbage."""


class PausedRefusal(Exception):
    """The replica refused a generate because its vLLM is paused (`vllm.refusals`): nothing
    ran, so it is neither the request's fault nor the replica's (no `ReplicaError`); the
    request is sent again after the pause. `message`: vLLM's."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"replica {url}: refused as paused: {message}")
        self.url = url
        self.message = message


def refusal(error: Any) -> str | None:
    """vLLM's message when `error` (an error event's or error reply's `error` object) is its
    retryable refusal, which from 0.33 a pause in mode "abort" or "wait" answers every new
    request with: `RetryableRequestError`, sent as `{"type": "ServiceUnavailableError", "code":
    503, ...}` (vllm/entrypoints/serve/exception_handling/error_response.py). None otherwise."""
    if not isinstance(error, dict):
        return None
    if error.get("code") != 503 or error.get("type") != "ServiceUnavailableError":
        return None
    return str(error.get("message"))


def refused_reply(status: int, text: str) -> str | None:
    """`refusal` of an HTTP error reply (vLLM's 503 to a request that does not stream): its
    body `{"error": {...}}`; None for any other status or body (a proxy's 503 page is the
    replica's failure)."""
    if status != 503:
        return None
    try:
        body = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return None
    return refusal(body.get("error")) if isinstance(body, dict) else None


class Rejected(ValueError):
    """The replica refused a request as malformed (HTTP 4xx on a generate): the request is at
    fault, not the replica, so this is no `ReplicaError`."""


def replica_failure(replica: Replica, what: str, exc: Exception) -> ReplicaError:
    """`exc`, raised while talking to `replica`, as that replica's failure. What counts is
    where an error came from, not its type: aiohttp alone raises `ClientResponseError` for a
    port that answers something other than HTTP, `LineTooLong`, payload, connection and
    timeout errors, and a list of them was once short of one, which took every replica's
    requests down with it. A `ReplicaError` already names its replica."""
    if isinstance(exc, ReplicaError):
        return exc
    return ReplicaError(replica.url, f"{what}: {type(exc).__name__}: {exc}")


def stream_failure(replica: Replica, exc: Exception) -> ReplicaError:
    """`exc`, raised by a generate stream to `replica`, classified by where it came from:
    from the connection (aiohttp's connection and payload errors, whatever their subclass) it
    is `StreamLost`, a failure of that request; from what the replica sent, the replica's
    failure (`replica_failure`)."""
    if isinstance(exc, aiohttp.ClientConnectionError | aiohttp.ClientPayloadError):
        return StreamLost(replica.url, f"{type(exc).__name__}: {exc}")
    return replica_failure(replica, "generate", exc)


async def read_at_most(reply: aiohttp.ClientResponse, limit: int) -> bytes:
    """Up to `limit` bytes of `reply`'s body (all of it when shorter), never more in memory."""
    body = bytearray()
    while len(body) < limit:
        chunk = await reply.content.read(limit - len(body))
        if not chunk:
            break
        body += chunk
    return bytes(body)


async def control(
    session: aiohttp.ClientSession,
    replica: Replica,
    method: str,
    path: str,
    *,
    timeout_s: float,
    json: Any = None,
    idempotent: bool = True,
    text: bool = False,
) -> Any:
    """One control call (`/pause`, `/collective_rpc`, ...) within `timeout_s`; its JSON reply
    (None for an empty body), or with `text` its body as text (vLLM's adapter routes answer
    plain text). Any failure raises `ReplicaError` naming the replica (`ReplicaHTTPError` for an
    HTTP error status; a closed `session` raises aiohttp's own error: the caller closed it, no
    replica failed). The connection is not reused: after a 500 from vLLM's RL routes the next
    request on the same connection was measured to fail. An `idempotent` call is tried once more
    on a fresh connection after a connection error (a pooled one may have been closed by the
    server's keep-alive timeout just as it was reused); any other (an NCCL step: a second join
    or receive would wait for a broadcast that never comes) is not."""
    url = f"{replica.url}{path}"
    try:
        async with asyncio.timeout(timeout_s):  # one deadline for both tries: a retry must
            body = await _request(session, replica, method, path, url, json, idempotent)
    except Exception as exc:  # not stretch a pause past its bound (`pause_bound_s`)
        if session.closed or not _is_deadline(exc):
            raise
        message = f"{method} {path}: no reply within {timeout_s} s"
        raise ReplicaError(replica.url, message) from None
    if len(body) > REPLY_BYTES:
        raise ReplicaError(replica.url, f"{method} {path} -> a reply over {REPLY_BYTES} B")
    if text:
        return body.decode(errors="replace")
    try:
        return msgspec.json.decode(body) if body.strip() else None
    except msgspec.DecodeError:  # garbage (a proxy's error page) fails like any bad reply
        head = body[:ERROR_BODY_BYTES].decode(errors="replace")
        raise ReplicaError(replica.url, f"{method} {path} -> not JSON: {head}") from None


async def _request(
    session: aiohttp.ClientSession,
    replica: Replica,
    method: str,
    path: str,
    url: str,
    json: Any,
    idempotent: bool,
) -> bytes:
    """The tries of `control`, under its deadline: the reply's body (up to one byte past
    `REPLY_BYTES`), or `ReplicaError`."""
    attempts = 2 if idempotent else 1
    for attempt in range(1, attempts + 1):
        try:
            async with session.request(
                method, url, json=json, headers={"Connection": "close"}
            ) as reply:
                if reply.status != 200:
                    err = (await read_at_most(reply, ERROR_BODY_BYTES)).decode(errors="replace")
                    message = f"{method} {path} -> HTTP {reply.status}: {err}"
                    raise ReplicaHTTPError(replica.url, message, reply.status, err)
                return await read_at_most(reply, REPLY_BYTES + 1)
        except Exception as exc:
            if session.closed or _is_deadline(exc):
                raise
            if isinstance(exc, aiohttp.ClientConnectionError) and attempt < attempts:
                continue
            raise replica_failure(replica, f"{method} {path}", exc) from None
    raise AssertionError("unreachable")


def _is_deadline(exc: BaseException) -> bool:
    """Whether `exc` is the caller's deadline passing. aiohttp's own timeouts (a connect
    timeout, say) are `TimeoutError`s as well, and were once reported as "no reply within
    600 s" after 10 s; they are transport errors, retried and named as such."""
    return isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ClientError)


async def liveness(
    session: aiohttp.ClientSession, replica: Replica, body: dict[str, Any], timeout_s: float
) -> None:
    """Send the generate `body` (one token) and read its stream to the end within
    `timeout_s`; raise `ReplicaError` naming the replica otherwise."""
    try:
        async with (
            asyncio.timeout(timeout_s),
            session.post(f"{replica.url}/inference/v1/generate", json=body) as reply,
        ):
            if reply.status != 200:
                text = (await read_at_most(reply, ERROR_BODY_BYTES)).decode(errors="replace")
                if refused_reply(reply.status, text) is not None:
                    return  # its engine core answered: refused as paused, it is alive
                raise ReplicaError(replica.url, f"liveness generate -> HTTP {reply.status}: {text}")
            async for _ in events(reply, replica.url, 1):
                pass
    except PausedRefusal:
        return  # the engine core refused it itself (paused by someone else): it is alive
    except Exception as exc:
        if session.closed:
            raise
        if _is_deadline(exc):
            message = f"liveness generate: no token within {timeout_s} s (a hung engine core)"
            raise ReplicaError(replica.url, message) from None
        raise replica_failure(replica, "liveness generate", exc) from None


class StreamEvent(msgspec.Struct):
    """One server-sent event of `/inference/v1/generate` (only the fields used here)."""

    choices: list[StreamChoice] = []
    error: dict[str, Any] | None = None


class LogprobEntry(msgspec.Struct):
    token_id: int
    logprob: float


class Logprobs(msgspec.Struct):
    content: list[LogprobEntry] = []


class Span(msgspec.Struct):
    version: str
    start: int
    end: int


class StreamChoice(msgspec.Struct):
    index: int
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    logprobs: Logprobs | None = None
    weight_versions: list[Span] | None = None


_DECODER = msgspec.json.Decoder(StreamEvent)


# JSON bytes one streamed token can take in an event (id, logprob, its decoded text, version);
# one event of 4,084 tokens passed 512 KiB (over 128 each), so this leaves room for long tokens.
EVENT_BYTES_PER_TOKEN = 1024
EVENT_OVERHEAD_BYTES = 1 << 16


async def events(
    reply: aiohttp.ClientResponse, url: str, max_tokens: int
) -> AsyncIterator[StreamEvent]:
    """The events of a generate stream of at most `max_tokens` tokens until `[DONE]`. An error
    event (the engine core died mid-request, vLLM's own errors) raises `ReplicaError`, except
    a paused vLLM's refusal (`PausedRefusal`); so does a malformed event; a stream that ends
    without `[DONE]` raises `StreamLost`. One event can carry every token of the request
    (aiohttp's default line limit, 512 KiB, is ~4,000 tokens), so lines may be as long as
    `max_tokens` tokens can make them."""
    limit = EVENT_OVERHEAD_BYTES + EVENT_BYTES_PER_TOKEN * max_tokens
    while raw := await _line(reply, url, limit):
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        try:
            event = _DECODER.decode(data)
        except msgspec.DecodeError as exc:  # not JSON, or not the shape of an event
            raise ReplicaError(url, f"generate stream: malformed event: {exc}") from None
        if event.error is not None:
            if (message := refusal(event.error)) is not None:
                raise PausedRefusal(url, message)
            raise ReplicaError(url, f"generate stream error: {event.error.get('message')}")
        yield event
    raise StreamLost(url, "it ended without [DONE]")


async def _line(reply: aiohttp.ClientResponse, url: str, limit: int) -> bytes:
    """The next line of a stream (empty at its end). A longer line than `limit` is a replica
    answering garbage: aiohttp's `LineTooLong` is no transport error, so it becomes a
    `ReplicaError` here."""
    try:
        return await reply.content.readline(max_line_length=limit)
    except LineTooLong:
        raise ReplicaError(url, f"generate stream: a line over {limit} bytes") from None
