"""A small chat template for the tiny model's tokenizer (`asyncroll.app.models.build_tiny_model`).

The tiny tokenizer has no chat template of its own (it knows only `<|bos|>`, `<|eos|>` and
`<|pad|>`), so chat tests and the chat demo give it this one. It renders::

    <|bos|>system: Be brief.
    user: What is 2 + 3?
    assistant: 5<|eos|>
    user: And 2 + 4?
    assistant:␣

(␣: the space the generation prompt ends with.) An assistant turn ends with `<|eos|>`, the
token the engine stops at, so a reply the policy sampled ends where the template would end it;
the newline after it is a separator the policy never samples. The generation prompt ends in a
space: the tokenizer splits digits and the space before a word apart from the word, so a reply
starts on its first digit or word. Like real templates it refuses what it cannot render (an
unknown role, content that is not text) with `raise_exception`, which transformers raises as a
`jinja2.TemplateError`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}tools: {{ tools | tojson }}{{ '\\n' }}{% endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{ raise_exception('tiny chat template: unknown role ' ~ message['role']) }}"
    "{%- endif -%}"
    "{%- if message['content'] is not string -%}"
    "{{ raise_exception('tiny chat template: message content must be text') }}"
    "{%- endif -%}"
    "{{ message['role'] }}: {{ message['content'] }}"
    "{%- if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}assistant: {% endif -%}"
)
"""The tiny tokenizer's chat template (jinja, as `tokenizer.chat_template` takes it)."""


def tiny_chat_tokenizer(model_dir: str | Path) -> Any:
    """The tokenizer of a tiny model folder, with `TINY_CHAT_TEMPLATE` as its chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer
