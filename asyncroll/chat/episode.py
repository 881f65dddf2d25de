"""Chat episodes: messages in, parsed replies out, over the exact token stream.

```python
fmt = ChatFormat(tokenizer, tools=TOOLS)
parser = RenderersParser(tokenizer, renderers.Qwen3RendererConfig(), tools=TOOLS)

async def agent(episode: Episode) -> None:  # the producer's rollout_fn; its prompt is
    chat = ChatEpisode(episode, fmt, parser)  # fmt.prompt_ids(messages)
    for _ in range(4):
        reply = await chat.reply(max_new_tokens=256)
        if reply.truncated or not reply.tool_calls:
            break
        results = [run_tool(c) for c in reply.checked_tool_calls()]  # ToolCallError if bad
        chat.add([{"role": "tool", "content": r} for r in results])
```

What is trained, and where it differs from the template (docs/chat-episodes.md has more):

* `reply()` is one policy turn (`Episode.generate`) that stops at the format's end-of-turn
  tokens. Its ids, the end-of-turn token included, are trained (`loss_mask` 1) exactly as
  sampled, and stay in the stream as sampled: they are never decoded and encoded again.
* `add(messages)` appends what the template writes after the reply's end-of-turn token for
  those messages (`ChatFormat.bridge`): separators the model never samples, the messages, the
  next assistant header. Untrained (`loss_mask` 0).
* A reply cut by the length limit has no end-of-turn token: `add` refuses to continue it
  unless `after_cut=True`, which appends the template's own end-of-turn token first (one id,
  `ChatFormat.end_of_turn`), untrained like the bridge: the sampled ids stay as they are, and
  the policy is not taught to end its turn where it was cut.
* Where the policy ended its turn with another end-of-turn token than the one the template
  writes there (e.g. GLM's `<|user|>` before tool results), the sampled token stays and
  `differences` says so.
* Where the template would render history differently (Qwen3 drops earlier turns' reasoning
  once a user message follows; gpt-oss writes `<|end|>` where `<|return|>` was sampled; a
  non-canonical BPE split would re-encode differently), the stream keeps what the policy saw
  when it sampled: each turn's prompt is the previous prompt, the sampled reply and the new
  messages' tokens. A full re-render of `messages` can therefore differ from the stream in the
  earlier assistant turns, and only there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from asyncroll.chat.parse import Reply, ReplyParser
from asyncroll.chat.template import (
    ChatError,
    ChatFormat,
    ContextLengthError,
    Message,
    check_roles,
)
from asyncroll.engines.base import SamplingConfig
from asyncroll.episode import Episode

__all__ = ["ChatEpisode", "Continuation"]


class Continuation(msgspec.Struct, frozen=True):
    """What `ChatEpisode.add` appends after a reply, computed and not yet appended
    (`ChatEpisode.continuation`, then `ChatEpisode.append`)."""

    ids: tuple[int, ...]
    """The untrained ids: the template's end of turn after a cut reply, then the bridge."""
    messages: tuple[dict[str, Any], ...]
    """The messages they render, for `ChatEpisode.messages`."""
    difference: str
    """What differs from the template at the reply's end ("" for nothing)."""
    at: int
    """The episode's response length it was computed at: it continues only that stream."""


class ChatEpisode:
    """A chat view of one `Episode`. `messages` are the prompt's messages (kept in
    `self.messages` with each reply and added message, for the rollout function and its
    reward); `sampling` is what each reply samples with, the format's end-of-turn ids added
    to its stop tokens: by default the producer's, as `Episode.generate` samples (other
    temperature or top-p/k than the producer's make the behaviour logprobs describe another
    policy than the one the trainer recomputes)."""

    def __init__(
        self,
        episode: Episode,
        fmt: ChatFormat,
        parser: ReplyParser,
        *,
        messages: Sequence[Message] = (),
        sampling: SamplingConfig | None = None,
    ) -> None:
        check_roles(messages)
        self.episode = episode
        self.fmt = fmt
        self.parser = parser
        self.messages: list[dict[str, Any]] = [dict(m) for m in messages]
        base = episode.sampling if sampling is None else sampling
        stops = tuple(dict.fromkeys((*base.stop_token_ids, *fmt.stop_token_ids)))
        self.sampling = msgspec.structs.replace(base, stop_token_ids=stops)
        self.last: Reply | None = None
        self.differences: list[str] = []
        """Where the stream differs from the template at a turn's end (gpt-oss ends a reply
        with `<|return|>` that history writes as `<|end|>`; GLM ends it with the next role's
        token, which may not be the role that follows): the sampled token stays."""
        self._needs_messages = False  # a reply was sampled: the next turn needs messages

    async def reply(self, max_new_tokens: int | None = None) -> Reply:
        """Sample one policy turn and parse it. Refused (`ChatError`) right after another
        reply: add the messages that answer it first."""
        if self._needs_messages:
            raise ChatError(
                "reply() right after a reply: add() the tool results or the user's message "
                "first (two assistant turns in a row have no template rendering)"
            )
        turn = await self.episode.generate(max_new_tokens, sampling=self.sampling)
        ids = [int(i) for i in turn.tokens]
        before = self.episode.tokens[: len(self.episode.tokens) - len(ids)]
        prompt = [*self.episode.prompt_tokens.tolist(), *before.tolist()]
        parsed = self.parser.parse(ids, prompt_ids=prompt)
        reply = msgspec.structs.replace(parsed, ids=tuple(ids), finish_reason=turn.finish_reason)
        self.last = reply
        self._needs_messages = True
        self.messages.append(reply.message())
        return reply

    def add(self, messages: Sequence[Message], *, after_cut: bool = False) -> list[int]:
        """Append `messages` (tool results, a user message) after the last reply as the
        template renders them there; returns the ids appended (untrained). `ChatError` if
        there is no reply to follow or the template rejects the messages.

        A last reply that did not end at an end-of-turn token (cut by the length limit, or
        stopped by a stop token of the caller's) has no end of turn to continue from:
        refused (`ChatError`) unless `after_cut`, which first appends the end-of-turn token
        the template writes after an assistant turn there (`ChatFormat.after_reply`), as
        context the policy did not sample (untrained), and says so in `differences`.

        `add` is `append(continuation(messages, after_cut=after_cut))`: a caller that checks
        its budget against the ids first (the agent endpoint) calls the two itself, and the
        template is rendered once."""
        return self.append(self.continuation(messages, after_cut=after_cut))

    def append(self, continuation: Continuation) -> list[int]:
        """Append a `continuation` of this episode's last reply (`add`'s second half); the
        ids appended. `ChatError` if the stream has moved since it was computed."""
        if not self._needs_messages or len(self.episode.tokens) != continuation.at:
            raise ChatError(
                "the continuation was computed for another point of the episode (a reply or "
                "an add() came since): compute it again with continuation()"
            )
        ids = list(continuation.ids)
        self.episode.append(ids)
        if continuation.difference:
            self.differences.append(continuation.difference)
        self.messages.extend(dict(m) for m in continuation.messages)
        self._needs_messages = False
        return ids

    def continuation(
        self, messages: Sequence[Message], *, after_cut: bool = False, max_ids: int | None = None
    ) -> Continuation:
        """What `add(messages, after_cut=after_cut)` would append (`add`'s first half: the
        template rendered, nothing appended); `append` it. `ChatError` as `add` raises it.

        `max_ids`: a caller's budget. `ContextLengthError` when the ids would certainly be
        more, found before the whole text is encoded (`ChatFormat.more_ids_than`): a huge
        tool result costs a few times the budget, not its size. Within it, the caller checks
        `len(ids)` itself (a text a little over passes this check)."""
        last = self.last
        if last is None or not self._needs_messages:
            raise ChatError(
                "add() before a reply: the prompt's messages are rendered into the prompt; "
                "new messages follow a reply"
            )
        ended = not last.truncated and bool(last.ids) and last.ids[-1] in self.fmt.stop_token_ids
        if not ended and not after_cut:
            raise ChatError(
                f"the last reply ended with finish reason {last.finish_reason!r}, not at an "
                f"end-of-turn token {list(self.fmt.stop_token_ids)}: there is no end of turn "
                "to continue from, so the episode must end here (raise max_new_tokens, or "
                "add(..., after_cut=True) to close the turn with the template's end of turn)"
            )
        end, text = self.fmt.after_reply(last.message(), messages)
        if max_ids is not None and self.fmt.more_ids_than(text, max_ids - (0 if ended else 1)):
            raise ContextLengthError(
                f"the messages add more than {max_ids} tokens after reply "
                f"{self.episode.policy_turns}"
            )
        ids = self.fmt.encode(text)
        turn = self.episode.policy_turns
        difference = ""
        if not ended:
            ids = [*self.fmt.encode(end), *ids]
            difference = (
                f"after reply {turn}: it did not end its turn (finish reason "
                f"{last.finish_reason!r}); the template's {end!r} appended as context "
                "(untrained)"
            )
        elif (sampled_end := str(self.fmt.tokenizer.decode([last.ids[-1]]))) != end:
            difference = (
                f"after reply {turn}: the policy ended its turn with {sampled_end!r} (kept and "
                f"trained), where the template writes {end!r}"
            )
        return Continuation(
            ids=tuple(ids),
            messages=tuple(dict(m) for m in messages),
            difference=difference,
            at=len(self.episode.tokens),
        )
