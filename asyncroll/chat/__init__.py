"""Text and chat in, exact tokens out: the layer users start from, over the token-level core.

* `chat_prompts` / `PromptBuilder`: dataset rows of chat messages (or text) become `Prompt`s
  through the model's tokenizer and chat template, rendered once; the row rides along as
  metadata.
* `text_reward`: a reward function on decoded completions (TRL's `reward_funcs` convention),
  sync or async, as the producer's `RewardFn`; `math_reward`, one for GSM8K / MATH answers
  with math-verify (the ``math`` extra; run with ``reward_executor="process"``).
* `TINY_CHAT_TEMPLATE` / `tiny_chat_tokenizer`: a small chat template for the tiny test model.
* `ChatFormat` / `ChatEpisode`: multi-turn chat over the exact sampled token stream: each turn
  adds only the new messages' ids (the bridge), never re-rendering what was sampled; replies
  are parsed (`RenderersParser`) into content, reasoning and tool calls.
"""

from asyncroll.chat.answers import gold_answer, math_reward
from asyncroll.chat.episode import ChatEpisode, Continuation
from asyncroll.chat.parse import (
    RenderersParser,
    Reply,
    ReplyParser,
    TextParser,
    ToolCall,
    ToolCallError,
)
from asyncroll.chat.prompts import (
    RESERVED_FIELDS,
    ChatTokenizer,
    PromptBuilder,
    PromptError,
    chat_prompts,
)
from asyncroll.chat.rewards import (
    THREAD_MIN_TOKENS,
    Decoder,
    DecodeTokenizer,
    TextRewardFn,
    batch_decoder,
    decode_completions,
    text_reward,
)
from asyncroll.chat.template import CHAT_ROLES, ChatError, ChatFormat, ContextLengthError
from asyncroll.chat.tiny import TINY_CHAT_TEMPLATE, tiny_chat_tokenizer

__all__ = [
    "CHAT_ROLES",
    "RESERVED_FIELDS",
    "THREAD_MIN_TOKENS",
    "TINY_CHAT_TEMPLATE",
    "ChatEpisode",
    "ChatError",
    "ChatFormat",
    "ChatTokenizer",
    "ContextLengthError",
    "Continuation",
    "DecodeTokenizer",
    "Decoder",
    "PromptBuilder",
    "PromptError",
    "RenderersParser",
    "Reply",
    "ReplyParser",
    "TextParser",
    "TextRewardFn",
    "ToolCall",
    "ToolCallError",
    "batch_decoder",
    "chat_prompts",
    "decode_completions",
    "gold_answer",
    "math_reward",
    "text_reward",
    "tiny_chat_tokenizer",
]
