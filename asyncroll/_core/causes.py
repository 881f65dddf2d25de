"""Why groups were dropped, counted by label with the most frequent message of each: what the
error that stops a run and `ProduceBatchResult.failure_causes` say, so a broken verifier is
seen by its message ("returned 3 rewards for 4 samples"), not only by a count.

Memory is bounded however many groups fail: at most `MAX_MESSAGES` distinct messages are kept
per label; a message first seen after that is counted under its label only.
"""

from __future__ import annotations

import traceback
from collections import Counter

import msgspec

MAX_MESSAGES = 16
MESSAGE_CHARS = 300  # a message is cut to this length: one line, not a page


class FailureCause(msgspec.Struct, frozen=True, kw_only=True):
    """The groups dropped for one reason, and its most frequent message (`message_groups` of
    them had it, word for word)."""

    groups: int
    message: str
    message_groups: int


class Causes:
    """Counts of dropped groups by label (a `FailureReason` value, "filtered", ...), each with
    a bounded count of its messages."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._messages: dict[str, Counter[str]] = {}

    def add(self, label: str, message: str | None) -> None:
        self.counts[label] += 1
        if message is None:
            return
        messages = self._messages.setdefault(label, Counter())
        message = message[:MESSAGE_CHARS]
        if message in messages or len(messages) < MAX_MESSAGES:
            messages[message] += 1

    def total(self) -> int:
        return self.counts.total()

    def clear(self) -> None:
        self.counts.clear()
        self._messages.clear()

    def causes(self) -> dict[str, FailureCause]:
        """Each label's count and most frequent message, the most frequent label first."""
        out = {}
        for label, groups in self.counts.most_common():
            top = self._messages.get(label, Counter()).most_common(1)
            message, count = top[0] if top else ("", 0)
            out[label] = FailureCause(groups=groups, message=message, message_groups=count)
        return out

    def summary(self) -> str:
        """ "reward_error x16: <its most frequent message>; filtered x2", most frequent first."""
        parts = []
        for label, cause in self.causes().items():
            part = f"{label} x{cause.groups}"
            if cause.message:
                same = "" if cause.message_groups == cause.groups else f" ({cause.message_groups})"
                part += f": {cause.message}{same}"
            parts.append(part)
        return "; ".join(parts)


def origin(exc: BaseException) -> str:
    """Where `exc` was raised, as "file.py:12 in fn" (the innermost frame), or "" when it
    carries no traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    frame = frames[-1]
    name = frame.filename.replace("\\", "/").rsplit("/", 1)[-1]
    return f"{name}:{frame.lineno} in {frame.name}"


def described(exc: BaseException) -> str:
    """`exc` as "KeyError: 'answer' (at reward.py:12 in score)"."""
    where = origin(exc)
    return f"{type(exc).__name__}: {exc}" + (f" (at {where})" if where else "")
