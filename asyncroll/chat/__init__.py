"""Text and chat in, exact tokens out: the layer users start from, over the token-level core.

* `chat_prompts` / `PromptBuilder`: dataset rows of chat messages (or text) become `Prompt`s
  through the model's tokenizer and chat template, rendered once; the row rides along as
  metadata.
* `text_reward`: a reward function on decoded completions (TRL's `reward_funcs` convention),
  sync or async, as the producer's `RewardFn`.
* `TINY_CHAT_TEMPLATE` / `tiny_chat_tokenizer`: a small chat template for the tiny test model.
"""

from asyncroll.chat.prompts import (
    CHAT_ROLES,
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
from asyncroll.chat.tiny import TINY_CHAT_TEMPLATE, tiny_chat_tokenizer

__all__ = [
    "CHAT_ROLES",
    "RESERVED_FIELDS",
    "THREAD_MIN_TOKENS",
    "TINY_CHAT_TEMPLATE",
    "ChatTokenizer",
    "DecodeTokenizer",
    "Decoder",
    "PromptBuilder",
    "PromptError",
    "TextRewardFn",
    "batch_decoder",
    "chat_prompts",
    "decode_completions",
    "text_reward",
    "tiny_chat_tokenizer",
]
