"""The demo's OpenAI-client task, "openai_echo": tool_echo (`asyncroll.app.demo_tool`) with its
agent written as plain `openai`-client code against the episode's endpoint (`asyncroll.agents`).

The prompts are tool_echo's ("q:", a letter and a colon) and so are the turns, the answers
and the scores. The agent calls `client.chat.completions.create` on the episode's `base_url`
with the task's one tool, `say`: a reply that ends its turn (`<|eos|>`) is a call of `say`
with the reply's text, answered with a tool message; a reply cut by the token limit
(`finish_reason="length"`, tool_echo's usual 4-token turn) is text, answered with a user
message. Either way the answer is the next letter, for tool_echo's `TURNS` turns. The agent
returns the episode's reward (the mean of its turns' scores) and leaves each turn's score in
`episode.extra`, which the demo's trainer gives each turn its own GRPO advantage from, as it
does for tool_echo.

The token stream is tool_echo's with one difference: after a turn cut by the token limit the
endpoint appends the template's end of turn (`<|eos|>`) before the next letter, as context
(untrained): "<|bos|>q:qqqq<|eos|>c:..." where tool_echo has "<|bos|>q:qqqqc:...". The trained
tokens and their scores are tool_echo's (`turn_score`: the letter's share of the turn's
tokens, from the text the agent was given and the reply's `usage.completion_tokens`).

It learns as tool_echo does: last-10 mean reward 0.964, 0.952, 0.926 on seeds 1-3 of the
default run (benchmarks/results/openai_echo.md). Why the cut turns are continued: when the
endpoint refused to continue a cut reply, the policy had to learn to end its turns
(`<|eos|>` within 4 tokens) before any turn after the first counted, then learnt short
replies, one letter to explore per turn where tool_echo has four: 0.47-0.54 at step 200 on
three seeds, none solved.

The task's chat template renders exactly tool_echo's stream: a user or tool message as its
text and a colon, an assistant turn as what was sampled and `<|eos|>`. It writes no tool specs
into the prompt (a 361k-parameter random-weight model gains nothing from reading JSON); the
tool-call syntax is the reply itself (`SayParser`). The trainer, its loss, the defaults
(`demo_tool.DEFAULTS`) and the demo's loop are tool_echo's: a change to how tool_echo trains
is a change to this task too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from asyncroll.agents import AgentEndpoint, agent_reward
from asyncroll.app import demo_tool
from asyncroll.chat.parse import Reply, ToolCall
from asyncroll.chat.template import ChatFormat
from asyncroll.engines.base import SamplingConfig
from asyncroll.episode import Episode, split_turns
from asyncroll.types import Prompt, RolloutGroup

TURNS = demo_tool.TURNS
EOS = 1
"""The tiny tokenizer's `<|eos|>`: the template's end of turn."""
CALL_TIMEOUT_S = 600.0
"""Every phase of a call, connecting included (the client's default gives a connection 5 s:
on a loaded machine the endpoint, on the trainer's event loop, accepted later, and the
group failed with `APITimeoutError`); the group's episode deadline bounds it anyway."""
DEFAULTS: Final = demo_tool.DEFAULTS
"""tool_echo's defaults, the push on failed problems included: with it 4 runs of 4 on seeds
1-3 were solved in 50-72 steps, without it 5 of 5 (benchmarks/results/openai_echo.md)."""

TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}{{ message['content'] }}{{ eos_token }}"
    "{%- else -%}{{ message['content'] }}:{%- endif -%}"
    "{%- endfor -%}"
)
"""The task's chat template: [user "q"] renders to tool_echo's prompt "<|bos|>q:", a reply
and a tool message "c" to the sampled ids, `<|eos|>` and "c:" (tool_echo's answer)."""

TOOLS: Final = [
    {
        "type": "function",
        "function": {
            "name": "say",
            "description": "Say the letter you were given; the answer is the next letter.",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string"}},
                "required": ["text"],
            },
        },
    }
]


class SayParser:
    """The tiny format's tool calls: a reply that ends its turn (`<|eos|>`) is a call of
    `say` with the reply's text; one cut by the token limit is text, and no call."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.end = int(tokenizer.eos_token_id)

    def parse(self, ids: Sequence[int], *, prompt_ids: Sequence[int]) -> Reply:
        ids = tuple(int(i) for i in ids)
        ended = bool(ids) and ids[-1] == self.end
        text = str(self.tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False))
        if not ended:
            return Reply(text, None, (), ids, "length")
        call = ToolCall(name="say", arguments={"text": text}, raw=text)
        return Reply("", None, (call,), ids, "stop")


def episode_tokens(max_new_tokens: int) -> int:
    """tool_echo's budget and room for the end of turn the endpoint appends after each cut
    turn but the last."""
    return demo_tool.episode_tokens(max_new_tokens) + TURNS - 1


def turn_score(text: str, letter: str, tokens: int) -> float:
    """tool_echo's score of a turn: the share of its `tokens` (the sampled ids, `<|eos|>`
    included when it ended the turn) that are the letter, from the text the agent was given
    ("cccc" cut 1, "cc<|eos|>" 2/3, "<|eos|>" 0). The letters are one token each, so this is
    `demo_tool.turn_rewards` of the same ids."""
    return min(text.count(letter), tokens) / tokens if tokens > 0 else 0.0


async def openai_echo_agent(client: Any, episode: Episode, model: str) -> float:
    """The agent: plain OpenAI-client code. `client` is an `openai.AsyncOpenAI` on the
    episode's URL. Each turn's score goes to `episode.extra["turn_scores"]`, each call's wall
    time to `episode.extra["call_s"]`; the result is the episode's reward."""
    letters = episode.metadata["letters"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": letters[0]}]
    scores = [0.0] * TURNS
    calls: list[float] = []
    for turn in range(TURNS):
        start = time.perf_counter()
        response = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        calls.append(time.perf_counter() - start)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:  # the turn ended: the tool scores what was said
            (call,) = message.tool_calls
            said = _text(call.function.arguments)
            answer = {"role": "tool", "tool_call_id": call.id}
        else:  # cut by the token limit (finish_reason "length"): its text is what was said
            said = message.content or ""
            answer = {"role": "user"}
        scores[turn] = turn_score(said, letters[turn], response.usage.completion_tokens)
        if turn + 1 < TURNS:
            messages.append({**answer, "content": letters[turn + 1]})
    episode.extra["turn_scores"] = scores
    episode.extra["call_s"] = calls
    return float(np.mean(scores))


def _text(arguments: str) -> str:
    import json

    value = json.loads(arguments)
    return str(value.get("text", "")) if isinstance(value, dict) else ""


def turn_scores(group: RolloutGroup) -> npt.NDArray[np.float64]:
    """[samples, TURNS]: each turn's score as the agent gave it (0 for a turn not reached):
    the trainer's per-turn rewards, as tool_echo's are."""
    return np.array([s.extra["turn_scores"] for s in group.samples], dtype=np.float64)


def step_metrics(groups: list[RolloutGroup]) -> dict[str, float]:
    """Per batch: each turn's mean score, the share of episodes that reached it, the share of
    turns that ended with `<|eos|>` (a `say` call) and the mean proxy call time in ms."""
    scores = np.stack([turn_scores(g) for g in groups])  # [groups, samples, turns]
    samples = [s for g in groups for s in g.samples]
    reached = np.zeros(TURNS)
    for s in samples:
        reached[: len(s.extra["call_s"])] += 1
    out = {f"turn{k}": float(scores[:, :, k].mean()) for k in range(TURNS)}
    out |= {f"reached{k}": float(reached[k] / len(samples)) for k in range(TURNS)}
    ends = [t[-1] == EOS for s in samples for policy, t in split_turns(s) if policy and len(t)]
    out["ended"] = float(np.mean(ends)) if ends else 0.0
    calls = [t for s in samples for t in s.extra["call_s"]]
    out["call_ms"] = 1e3 * float(np.mean(calls))
    return out


class OpenAIEchoTask:
    """What the demo needs of openai_echo: tool_echo's prompts, the endpoint the agents call
    (`serving()`, entered around the producer's run), the producer's episode settings and
    reward, and the per-turn rewards."""

    def __init__(
        self, model_dir: Path, raw_tokenizer: Any, seed: int, sampling: SamplingConfig
    ) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        tokenizer.chat_template = TEMPLATE
        self.fmt = ChatFormat(tokenizer, tools=TOOLS)
        if self.fmt.stop_token_ids != (EOS,):
            raise ValueError(f"the template ends a turn with {self.fmt.end_of_turn}, not <|eos|>")
        parser = SayParser(tokenizer)
        self.endpoint = AgentEndpoint(self.fmt, lambda tools: parser, sampling=sampling)
        bos = raw_tokenizer.token_to_id("<|bos|>")
        for letter in demo_tool.LETTERS:  # the first call's message renders to the prompt
            ids = self.fmt.prompt_ids([{"role": "user", "content": letter}])
            if ids != [bos, *raw_tokenizer.encode(f"{letter}:").ids]:
                raise ValueError(f"the template renders {letter!r} to {ids}, not tool_echo's")
        self.raw_tokenizer = raw_tokenizer
        self.seed = seed
        self.max_new_tokens = sampling.max_new_tokens
        self._client: Any = None  # an openai.AsyncOpenAI while serving
        self.reward = agent_reward
        self.turn_rewards = turn_scores

    def prompts(self) -> Iterator[Prompt]:
        """tool_echo's prompts (the first call's message renders to each one's tokens)."""
        return demo_tool.tool_echo_prompts(self.raw_tokenizer, self.seed)

    def episodes(self) -> dict[str, Any]:
        """The producer's episode arguments: the agent behind the endpoint, tool_echo's
        turns, tool_echo's budget and room for the ends of turn (`episode_tokens`)."""
        return {
            "rollout_fn": self.endpoint.rollout(self._agent),
            "max_turns": TURNS,
            "max_episode_tokens": episode_tokens(self.max_new_tokens),
        }

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[OpenAIEchoTask]:
        """The endpoint's server and one HTTP client the agents share (an `AsyncOpenAI` with
        its own HTTP client costs ~20 ms to make; with a shared one, ~40 µs)."""
        try:
            import openai
        except ImportError as exc:
            raise RuntimeError(
                "--task openai_echo runs an OpenAI-client agent: pip install openai "
                "(or asyncroll[agents])"
            ) from exc
        async with openai.DefaultAsyncHttpxClient() as http, self.endpoint:
            self._client = openai.AsyncOpenAI(
                base_url="http://unused/v1",
                api_key="unused",
                http_client=http,
                max_retries=0,
                timeout=CALL_TIMEOUT_S,
            )
            try:
                yield self
            finally:
                self._client = None

    async def _agent(self, base_url: str, episode: Episode) -> float:
        if self._client is None:
            raise RuntimeError("the openai_echo task is not serving: enter task.serving()")
        client = self._client.with_options(base_url=base_url)
        return await openai_echo_agent(client, episode, self.endpoint.model)
