"""`math_reward`: GSM8K / MATH-style answers checked with math-verify (the ``math`` extra:
``pip install "asyncroll[math]"``), as a text reward in TRL's convention::

    reward = text_reward(math_reward, tokenizer)
    Producer(engine, prompts, reward, reward_executor="process")

Each completion scores 1.0 when the answer it gives (its ``\\boxed{}``, or else its last number
or LaTeX expression, as math-verify extracts them) equals the row's ``answer`` (a number,
LaTeX, or GSM8K's worked solution ending in ``#### 42``), else 0.0: an answer it cannot parse,
and math-verify's own errors, score 0.0.

math-verify bounds its parsing and its comparison with SIGALRM, which only the main thread of
a process may use: in a reward worker thread it fails or, with its timeouts off, may hang for
good. Run it with ``reward_executor="process"``: there each call runs in a worker process's
main thread, math-verify's timeouts work, and the executor's deadline (`reward_timeout_s`)
kills a worker that hangs all the same. Called from any other thread, `math_reward` raises a
`RuntimeError` that says so.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["gold_answer", "math_reward"]


def gold_answer(answer: Any) -> str:
    """The reference answer as math-verify reads it: GSM8K's worked solution cut to what follows
    its ``####`` (thousands separators dropped), anything else as text."""
    text = str(answer)
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip().replace(",", "")
    return text


def math_reward(completions: Sequence[Any], answer: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 per completion whose answer math-verify finds equal to `answer`, else 0.0 (see the
    module docstring). Chat completions (``[{"role": "assistant", "content": ...}]``) and
    plain texts both work."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "math_reward runs math-verify, whose timeouts use SIGALRM and so need a process's "
            "main thread: give the producer (or Evaluator) reward_executor='process'"
        )
    from math_verify import parse, verify

    out = []
    for completion, gold in zip(completions, answer, strict=True):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        reference = gold_answer(gold)
        expected = parse(reference if "$" in reference else f"${reference}$")
        given = parse(text)
        out.append(float(bool(expected) and bool(given) and verify(expected, given)))
    return out
