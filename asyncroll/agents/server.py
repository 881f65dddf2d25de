"""`AgentEndpoint`: an OpenAI-compatible endpoint in the trainer's process, one URL per
episode, so that agent code written against the OpenAI API trains unchanged.

```python
fmt = ChatFormat(tokenizer)
endpoint = AgentEndpoint(fmt, lambda tools: RenderersParser(tokenizer, tools=tools),
                         sampling=config.sampling)

async def agent(base_url: str, episode: Episode) -> float:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
    reply = await client.chat.completions.create(
        model=endpoint.model, messages=episode.metadata["messages"])
    return score(reply.choices[0].message.content)   # the episode's reward

async with endpoint:  # the server runs while the producer does
    producer = Producer(engine, prompts, agent_reward, rollout_fn=endpoint.rollout(agent), ...)
```

One aiohttp server (bound to 127.0.0.1 unless told otherwise) serves every episode under
`/<token>/v1`, the token from `secrets.token_urlsafe`: a URL is unguessable, and it stops
answering (404) once its episode ends. A call's turn runs in the episode's task (see
`asyncroll.agents.session`), so the producer's pauses, weight updates, aborts, deadlines and
failures apply to it exactly as to any turn.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio

from asyncroll.agents.session import AgentSession, tools_key
from asyncroll.agents.wire import ApiError, chunks, completion, parse_call
from asyncroll.chat.parse import ReplyParser
from asyncroll.chat.template import ChatFormat
from asyncroll.engines.base import SamplingConfig
from asyncroll.episode import Episode, RolloutFn
from asyncroll.types import RolloutGroup

__all__ = ["Agent", "AgentEndpoint", "agent_reward"]

Agent = Callable[[str, Episode], Awaitable[float | None]]
"""`async def agent(base_url, episode) -> reward`: OpenAI-client code pointed at `base_url`;
its result (a number) is the episode's reward, stored as `episode.extra["reward"]`."""

_CACHED_FORMATS = 64  # tool sets whose chat format and parser are kept


def agent_reward(group: RolloutGroup) -> list[float]:
    """A reward function for the producer: each sample's `extra["reward"]` (what its agent
    returned)."""
    out = []
    for i, sample in enumerate(group.samples):
        value = sample.extra.get("reward")
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ValueError(
                f"sample {i} of {group.prompt_id} has reward {value!r}: the agent must return "
                "a number (or set episode.extra['reward'])"
            )
        out.append(float(value))
    return out


class AgentEndpoint:
    """The endpoint; enter it (`async with`) around the producer's run.

    `fmt` is the chat format of the policy's tokenizer; `parser(tools)` makes the reply parser
    for a call's tools; `sampling` is the producer's sampling config (a call asking for other
    sampling is refused); `model` is the name `/v1/models` lists and calls must use."""

    def __init__(
        self,
        fmt: ChatFormat,
        parser: Callable[[Sequence[dict[str, Any]] | None], ReplyParser],
        *,
        sampling: SamplingConfig,
        model: str = "asyncroll-policy",
        host: str = "127.0.0.1",
        port: int = 0,
        max_body_bytes: int = 32 << 20,
        close_timeout_s: float = 30.0,
    ) -> None:
        self.fmt = fmt
        self.parser = parser
        self.sampling = sampling
        self.model = model
        self.host = host
        self.port = port
        self.max_body_bytes = max_body_bytes
        self.close_timeout_s = close_timeout_s
        self._formats: dict[str, tuple[ChatFormat, ReplyParser]] = {}
        self._sessions: dict[str, AgentSession] = {}
        self._runner: Any = None  # aiohttp.web.AppRunner while serving

    # -- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> AgentEndpoint:
        from aiohttp import web  # the `server` extra

        app = web.Application(
            client_max_size=self.max_body_bytes, middlewares=[self._openai_errors]
        )
        app.router.add_post("/{token}/v1/chat/completions", self._chat)
        app.router.add_get("/{token}/v1/models", self._models)
        app.router.add_get("/{token}/v1/models/{model}", self._models)
        runner = web.AppRunner(
            app, handle_signals=False, access_log=None, shutdown_timeout=self.close_timeout_s
        )
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port, shutdown_timeout=self.close_timeout_s)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        runner, self._runner = self._runner, None
        for session in list(self._sessions.values()):
            session.close()
        if runner is not None:
            with anyio.fail_after(self.close_timeout_s * 2):
                await runner.cleanup()

    @property
    def sessions(self) -> int:
        """Episodes with an open URL."""
        return len(self._sessions)

    # -- episodes -------------------------------------------------------------------------------

    def rollout(self, agent: Agent) -> RolloutFn:
        """The producer's `rollout_fn` for `agent`: each episode gets its URL, the agent's
        result becomes its reward, and the URL closes when the agent returns or fails."""

        async def rollout_fn(episode: Episode) -> None:
            result = await self.run(agent, episode)
            if result is not None:
                episode.extra["reward"] = result

        return rollout_fn

    async def run(self, agent: Agent, episode: Episode) -> float | None:
        """Run `agent` on `episode` behind a fresh URL; its result, or its exception (which
        fails the group)."""
        if self._runner is None:
            raise RuntimeError(
                "the AgentEndpoint is not serving: enter it (`async with endpoint:`) around "
                "the producer's run"
            )
        token = secrets.token_urlsafe(24)
        session = AgentSession(
            episode,
            base_url=f"http://{self._url_host()}:{self.port}/{token}/v1",
            chat_for=self._chat_for,
            sampling=self.sampling,
            model=self.model,
        )
        self._sessions[token] = session
        results: list[float | None] = []
        failures: list[BaseException] = []
        try:
            async with anyio.create_task_group() as tg:

                async def serve() -> None:
                    try:
                        await session.serve()
                    except Exception as exc:  # a failed turn: the group fails with it
                        failures.append(exc)
                    tg.cancel_scope.cancel()

                async def drive() -> None:
                    try:
                        results.append(await agent(session.base_url, episode))
                        session.ended_by = "the episode's agent returned"
                    except Exception as exc:
                        failures.append(exc)
                        session.ended_by = f"the episode's agent raised {type(exc).__name__}"
                    tg.cancel_scope.cancel()

                tg.start_soon(serve, name=f"asyncroll-agent-turns-{episode.session}")
                tg.start_soon(drive, name=f"asyncroll-agent-{episode.session}")
        finally:
            del self._sessions[token]
            session.close()
        if failures:
            raise failures[0]
        return results[0] if results else None

    def _url_host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host

    def _chat_for(self, tools: tuple[dict[str, Any], ...] | None) -> tuple[ChatFormat, ReplyParser]:
        key = tools_key(tools)
        found = self._formats.get(key)
        if found is None:
            base = self.fmt
            fmt = base
            if key != tools_key(tuple(base.tools) if base.tools else None):
                fmt = ChatFormat(
                    base.tokenizer,
                    tools=tools,
                    end_of_turn=base.end_of_turn,
                    template_kwargs=base.template_kwargs,
                )
            if len(self._formats) >= _CACHED_FORMATS:
                self._formats.clear()
            found = self._formats[key] = (fmt, self.parser(list(tools) if tools else None))
        return found

    # -- routes ---------------------------------------------------------------------------------

    @property
    def _openai_errors(self) -> Any:
        """The errors aiohttp answers itself (no route for the path, a wrong method, a body
        over `max_body_bytes`) in OpenAI's shape, as the endpoint's own are: a client raises
        its usual exception with a message that says what to change."""
        from aiohttp import web

        @web.middleware
        async def middleware(request: Any, handler: Any) -> Any:
            try:
                return await handler(request)
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                error = self._http_error(request, exc.status, exc.reason)
                return web.json_response(error.body(), status=error.status)

        return middleware

    def _http_error(self, request: Any, status: int, reason: str) -> ApiError:
        if status == 404 and request.path.split("/")[1] in self._sessions:
            return ApiError(
                404,
                f"Invalid URL ({request.method} {request.path}): an episode's URL serves "
                "chat/completions and models",
            )
        if status == 404:
            return ApiError(
                404,
                f"no such episode: the URL {request.path} is unknown (each episode's base URL "
                "is /<token>/v1, given to its agent) or its episode has ended",
                code="episode_not_found",
            )
        if status == 405:
            return ApiError(
                405,
                f"{request.method} is not allowed on {request.path}: chat completions are "
                "POST, models GET",
                code="method_not_allowed",
            )
        if status == 413:
            return ApiError(
                413,
                f"the request body is over max_body_bytes={self.max_body_bytes}: send less, "
                "or raise AgentEndpoint(max_body_bytes=...)",
                code="request_too_large",
            )
        return ApiError(status, f"{status} {reason}")

    def _session(self, request: Any) -> AgentSession:
        session = self._sessions.get(request.match_info["token"])
        if session is None or session.closed:
            raise ApiError(
                404,
                "no such episode: its URL is unknown or its episode has ended",
                code="episode_not_found",
            )
        return session

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        try:
            self._session(request)
            name = request.match_info.get("model")
            entry = {"id": self.model, "object": "model", "created": 0, "owned_by": "asyncroll"}
            if name is None:
                return web.json_response({"object": "list", "data": [entry]})
            if name != self.model:
                raise ApiError(
                    404, f"the model {name!r} does not exist here", code="model_not_found"
                )
            return web.json_response(entry)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)

    async def _chat(self, request: Any) -> Any:
        from aiohttp import web

        try:
            session = self._session(request)
            body = await request.read()
            _, call = parse_call(
                body, model=self.model, sampling=self.sampling, tokenizer=self.fmt.tokenizer
            )
            answer = await session.submit(call)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        tokenizer = self.fmt.tokenizer
        if not call.stream:
            body = completion(answer, logprobs=call.logprobs, tokenizer=tokenizer)
            return web.json_response(body)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        parts = chunks(
            answer, logprobs=call.logprobs, include_usage=call.include_usage, tokenizer=tokenizer
        )
        try:
            await response.prepare(request)
            for part in parts:
                await response.write(b"data: " + json.dumps(part).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionError:
            # The client left mid-stream: the turn is in the episode already (trained as
            # sampled); a retry of the same call gets the same answer.
            pass
        return response
