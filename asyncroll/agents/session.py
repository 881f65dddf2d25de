"""One episode behind an OpenAI URL: each chat-completions call becomes a turn of its
`ChatEpisode`, run in the episode's own task (so the group's deadline, failure and the
producer's stop reach it like any turn), while the HTTP handler only waits for the answer.

How a call's messages relate to the episode (compared with `wire.known_message`):

* first call: its messages (and tools) must render to exactly the episode's prompt tokens;
* later calls: the messages must start with everything the episode holds (the prompt's
  messages, each reply as it was answered, each message added); what follows (tool results,
  a user message) is appended through the chat format's bridge, and the policy replies;
* after a reply that did not end its turn (`finish_reason` "length": cut by `max_tokens` or
  the episode's budget; or ended by a `stop` string of the call), the template's own
  end-of-turn token is appended before the bridge, untrained: the sampled ids stay as they
  were answered (`ChatEpisode.add(after_cut=True)`);
* a call that repeats the last call's messages (a client retrying a lost answer) gets the
  same answer again: no new turn is sampled;
* anything else rewrites the episode's history and is refused (400, `conversation_rewritten`):
  the policy's turns are what it sampled, so there is no honest way to train a rewritten one.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import anyio
import msgspec

from asyncroll.agents.wire import Answer, ApiError, ChatCall, Known, known_message, wire_message
from asyncroll.chat.episode import ChatEpisode
from asyncroll.chat.parse import ReplyParser
from asyncroll.chat.template import ChatError, ChatFormat, ContextLengthError, Message
from asyncroll.engines.base import SamplingConfig
from asyncroll.episode import Episode
from asyncroll.types import Status

__all__ = ["AgentSession", "ChatFor", "tools_key"]

_T = TypeVar("_T")

ChatFor = Callable[[tuple[dict[str, Any], ...] | None], tuple[ChatFormat, ReplyParser]]
"""The chat format and reply parser for a call's tools."""


def tools_key(tools: tuple[dict[str, Any], ...] | None) -> str:
    return json.dumps(tools, sort_keys=True) if tools else ""


class _Job:
    __slots__ = ("call", "done")

    def __init__(self, call: ChatCall) -> None:
        self.call = call
        self.done: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()

    def answer(self, result: Answer | ApiError) -> None:
        if self.done.done():  # the handler gave up (the server is closing)
            return
        if isinstance(result, ApiError):
            self.done.set_exception(result)
        else:
            self.done.set_result(result)


class AgentSession:
    """The endpoint's view of one episode. `submit` is called by the HTTP handler; `serve`
    runs in the episode's task and is the only writer of the episode."""

    def __init__(
        self,
        episode: Episode,
        *,
        base_url: str,
        chat_for: ChatFor,
        sampling: SamplingConfig,
        model: str,
    ) -> None:
        self.episode = episode
        self.base_url = base_url
        self.chat_for = chat_for
        self.sampling = sampling
        self.model = model
        self.chat: ChatEpisode | None = None
        self.closed = False
        self.turns = 0
        self._tools = ""
        self._known: list[Known] = []  # the messages the episode holds, as compared
        self._asked = 0  # messages in the call that sampled the last reply
        self._last: Answer | None = None
        self._job: _Job | None = None
        self._wake = asyncio.Event()
        self.ended_by: str | None = None
        """Why the episode's calls stop being answered, where its endpoint knows (its agent
        returned); None: the run stopped it (the producer, the group's failure or deadline)."""

    async def submit(self, call: ChatCall) -> Answer:
        """Run `call` as the episode's next turn and wait for its answer (or `ApiError`).
        The wait ends with the turn, or when the episode ends (`close`), which its group's
        `episode_timeout_s` bounds."""
        if self.closed:
            raise _ended()
        if self._job is not None:
            raise ApiError(
                409,
                "another call of this episode is in progress: an episode's turns are sampled "
                "one after the other (await each call before the next)",
                code="call_in_progress",
            )
        job = self._job = _Job(call)
        self._wake.set()
        try:
            return await job.done
        finally:
            if self._job is job:
                self._job = None

    def close(self) -> None:
        """The episode ended: a call still waiting gets 404, later ones too."""
        self.closed = True
        if (job := self._job) is not None:
            job.answer(_ended())

    async def serve(self) -> None:
        """Answer calls until cancelled (by the end of the episode). A failed turn fails the
        group: the error is raised here after the caller got a 500."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            job = self._job
            if job is None or job.done.done():
                continue
            try:
                answer = await self._turn(job.call)
            except ApiError as exc:
                job.answer(exc)
            except BaseException as exc:
                job.answer(_failed(exc, self.ended_by))
                raise
            else:
                job.answer(answer)

    # -- one call -------------------------------------------------------------------------------

    async def _turn(self, call: ChatCall) -> Answer:
        known = [known_message(m) for m in call.messages]
        if self.chat is None:
            return await self._first(call, known)
        chat = self.chat
        if tools_key(call.tools) != self._tools:
            raise ApiError(
                400,
                "the tools differ from the episode's first call: they are rendered into the "
                "prompt the policy saw; send the same tools on every call",
                param="tools",
                code="tools_changed",
            )
        held = len(self._known)
        if known[:held] != self._known:
            last = self._last
            if last is not None and len(known) == self._asked and known == self._known[: held - 1]:
                return last  # a retry of the last call: the same turn, not a new one
            at = next(
                (i for i, (a, b) in enumerate(zip(known, self._known, strict=False)) if a != b),
                min(len(known), held),
            )
            raise ApiError(
                400,
                f"messages[{at}] differs from the episode's history (or the messages end "
                f"before its {held} messages): each call must send the conversation so far "
                "unchanged (the policy's replies as they were answered) plus new messages; "
                "a rewritten history would train turns the policy did not sample",
                param=f"messages[{at}]",
                code="conversation_rewritten",
            )
        new = call.messages[held:]
        if not new:
            raise ApiError(
                400,
                "the messages end with the episode's last reply: add the tool results or the "
                "user's message before asking for the next one",
                code="no_new_messages",
            )
        for i, m in enumerate(new, held):
            if m["role"] == "assistant":
                raise ApiError(
                    400,
                    f"messages[{i}] is an assistant message the policy did not sample: the "
                    "policy's turns come from the endpoint, never from the client",
                    param=f"messages[{i}]",
                    code="conversation_rewritten",
                )
        self._check_turns()
        left = self.episode.tokens_left - 1  # the reply needs a token
        try:  # after a cut reply, the template's end of turn first (`ChatEpisode.add`)
            context = await _off_loop(
                functools.partial(chat.continuation, new, after_cut=True, max_ids=max(left, 0)),
                new,
            )
        except ContextLengthError:
            raise self._over_budget(f"more than {max(left, 0) + 1}") from None
        except ChatError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        self._check_budget(len(context.ids) + 1)
        chat.append(context)
        return await self._reply(call, known)

    async def _first(self, call: ChatCall, known: list[Known]) -> Answer:
        episode = self.episode
        fmt, parser = self.chat_for(call.tools)
        prompt = episode.prompt_tokens.tolist()
        try:
            ids = await _off_loop(
                functools.partial(_first_ids, fmt, call.messages, len(prompt)), call.messages
            )
        except ChatError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        if ids is None:
            raise ApiError(
                400,
                f"the first call's messages render to more than {len(prompt)} tokens, the "
                "episode's prompt: send the messages (and tools) the prompt was rendered from",
                param="messages",
                code="prompt_mismatch",
            )
        if ids != prompt:
            at = next(
                (i for i, (a, b) in enumerate(zip(ids, prompt, strict=False)) if a != b),
                min(len(ids), len(prompt)),
            )
            raise ApiError(
                400,
                f"the first call's messages render to {len(ids)} tokens that differ from the "
                f"episode's prompt ({len(prompt)} tokens) at token {at}: send the messages "
                "(and tools) the prompt was rendered from",
                param="messages",
                code="prompt_mismatch",
            )
        self._check_budget(1)
        self.chat = ChatEpisode(episode, fmt, parser, messages=call.messages)
        self._tools = tools_key(call.tools)
        return await self._reply(call, known)

    def _check_turns(self) -> None:
        episode = self.episode
        if episode.turns_left == 0:
            raise ApiError(
                400,
                f"the episode has taken its {episode.policy_turns} turns (max_turns): end the "
                "agent's loop sooner or raise max_turns",
                code="max_turns_exceeded",
            )

    def _check_budget(self, need: int) -> None:
        self._check_turns()
        if self.episode.tokens_left < need:
            raise self._over_budget(str(need))

    def _over_budget(self, need: str) -> ApiError:
        episode = self.episode
        return ApiError(
            400,
            f"the episode's token budget is spent: {episode.num_tokens} response tokens "
            f"held, {episode.tokens_left} left, this call needs {need} (max_episode_tokens "
            "or the engine's max_model_len)",
            code="context_length_exceeded",
        )

    async def _reply(self, call: ChatCall, known: list[Known]) -> Answer:
        chat = self.chat
        assert chat is not None
        episode = self.episode
        want = min(call.max_tokens or self.sampling.max_new_tokens, episode.tokens_left)
        stops = (*self.sampling.stop_token_ids, *chat.fmt.stop_token_ids, *call.stop_ids)
        chat.sampling = msgspec.structs.replace(
            self.sampling, stop_token_ids=tuple(dict.fromkeys(stops))
        )
        prompt_tokens = len(episode.prompt_tokens) + len(episode.tokens)
        reply = await chat.reply(want)
        self.turns += 1
        message, finish = wire_message(reply, self.turns)
        n = len(reply.ids)
        logprobs = episode.sample(Status.COMPLETED).logprobs[len(episode.tokens) - n :]
        answer = Answer(
            id=f"chatcmpl-{episode.session}-t{self.turns}",
            created=int(time.time()),
            model=self.model,
            message=message,
            finish_reason=finish,
            prompt_tokens=prompt_tokens,
            ids=reply.ids,
            logprobs=tuple(float(x) for x in logprobs),
        )
        self._asked = len(known)
        self._known = [*known, known_message(message)]
        self._last = answer
        return answer


_INLINE_CHARS = 8192
"""Messages up to this much text are rendered and tokenized on the event loop (a few ms at
most); more in a worker thread, whose hop costs a few ms of its own on a busy machine."""


async def _off_loop(work: Callable[[], _T], messages: Sequence[Message]) -> _T:
    """`work()` (rendering and tokenizing `messages`) in a worker thread when they are large:
    a large request must not stop the event loop, where every other agent, the producer and
    the trainer run. Abandoned if the episode is cancelled meanwhile (it only reads)."""
    chars = sum(len(m.get("content") or "") + len(str(m.get("tool_calls") or "")) for m in messages)
    if chars <= _INLINE_CHARS:
        return work()
    return await anyio.to_thread.run_sync(work, abandon_on_cancel=True)


def _first_ids(fmt: ChatFormat, messages: Sequence[Message], limit: int) -> list[int] | None:
    """The first call's prompt ids (`ChatFormat.prompt_ids`), or None when they are certainly
    more than `limit` (the episode's prompt): found without tokenizing all of them."""
    if fmt.more_ids_than(fmt.render_text(messages, generation_prompt=True), limit):
        return None
    return fmt.prompt_ids(messages)


def _failed(exc: BaseException, ended_by: str | None) -> ApiError:
    """The answer to a call whose turn ended with `exc`: a cancellation is the run (or the
    agent) ending the episode, whose text is empty or anyio's; anything else failed the turn
    (and fails the group)."""
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        why = ended_by or (
            "the producer stopped, or the episode's group ended (a sample failed, or the "
            "group's deadline passed)"
        )
        return ApiError(
            503,
            f"the run stopped before this call was answered: {why}; the episode takes no "
            "more calls",
            kind="server_error",
            code="run_stopped",
        )
    return ApiError(
        500, f"the episode's turn failed: {type(exc).__name__}: {exc}", kind="server_error"
    )


def _ended() -> ApiError:
    return ApiError(
        404,
        "no such episode: its URL is unknown or its episode has ended",
        code="episode_not_found",
    )
