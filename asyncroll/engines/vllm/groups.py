"""How a group's `GenerateRequest` runs as vLLM requests, for `VLLMEngine` and
`VLLMServerEngine` alike.

Both engines split a group into vLLM requests by the same rule, seed them the same way, keep
the same abort bookkeeping, stream a group's requests under the same rule (the first error ends
the others), end the streams the same way on close and read each token's version from the same
weight-version spans. Kept here once, a fix to one engine's splitting, seeding, abort handling
or version reading is a fix to both.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from asyncroll.engines.base import GenerateRequest, RecentIds, check_token_ids

P = TypeVar("P")
G = TypeVar("G", bound="RunningGroup")


class RunningGroup(Protocol):
    """A running group as this module sees it: whether it was aborted, and the tasks
    streaming its vLLM requests."""

    aborted: bool
    tasks: list[asyncio.Task[None]]


class VersionSpan(Protocol):
    """vLLM's label of the weights that sampled tokens `[start, end)` of a sample."""

    @property
    def version(self) -> str: ...

    @property
    def start(self) -> int: ...

    @property
    def end(self) -> int: ...


def split_group(
    request: GenerateRequest,
    vocab_size: int,
    *,
    together: bool,
    part: Callable[[str, list[int], int, list[int]], P],
) -> list[P]:
    """The vLLM requests of a group, each made by `part(id, prompt, max_tokens, indices)`:
    with `together`, fresh samples of one budget as one request of `n` samples, every other
    sample on its own (its prefix continues the prompt). The caller passes `together=False`
    when greedy: vLLM refuses n > 1 then. Token ids are checked here because vLLM does not
    check them when it has no tokenizer, and an out-of-vocabulary id kills its worker."""
    prompt = _token_list(request.prompt_tokens, vocab_size, "prompt")
    rid = request.request_id
    parts: list[P] = []
    fresh: dict[int, list[int]] = {}
    for i, sample in enumerate(request.samples):
        if together and len(sample.prefix) == 0:
            fresh.setdefault(sample.max_new_tokens, []).append(i)
            continue
        prefix = _token_list(sample.prefix, vocab_size, f"sample {i} prefix")
        parts.append(part(f"{rid}/{i}", prompt + prefix, sample.max_new_tokens, [i]))
    for max_tokens, indices in fresh.items():
        parts.append(part(f"{rid}/n{indices[0]}", prompt, max_tokens, indices))
    return parts


def part_seed(seed: int, part_id: str) -> int:
    """The sampling seed of one vLLM request of a seeded group: reproducible, yet distinct
    per group and sample."""
    return zlib.crc32(f"{seed}:{part_id}".encode())


def claim_abort(live: Mapping[str, G], recent: RecentIds, request_id: str) -> G | None:
    """The running group `request_id` names, now marked aborted, for the caller to abort its
    vLLM requests; None when there is nothing to abort now: an id not running yet is
    remembered for its coming `generate`, an ended one and one aborted already are left
    alone (the abort contract of `Engine`)."""
    group = live.get(request_id)
    if group is None:
        recent.abort_unknown(request_id)
        return None
    if group.aborted:
        return None
    group.aborted = True
    return group


async def first_error(tasks: list[asyncio.Task[None]]) -> BaseException | None:
    """Wait for a group's streaming tasks; on the first error, or when the caller is
    cancelled, cancel the rest (cancelling a stream makes vLLM abort its request) and wait for
    them to end. The error that ended the group (its cause before the cancellations it led
    to), or None when every task finished."""
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    errors.sort(key=lambda e: isinstance(e, asyncio.CancelledError))  # the cause first
    return errors[0] if errors else None


async def end_streams(groups: Iterable[RunningGroup], timeout: float) -> None:
    """Cancel the streaming tasks of every running group, which makes vLLM abort their
    requests, and wait for them (`timeout` s at most): on close, no `generate` outlives the
    engine."""
    streams = [task for group in groups for task in group.tasks]
    for task in streams:
        task.cancel()
    if streams:
        await asyncio.wait(streams, timeout=timeout)


def token_versions(
    spans: Iterable[VersionSpan] | None, n: int, version_of: Callable[[str], int]
) -> npt.NDArray[np.int32] | None:
    """The version of each of a sample's `n` tokens from vLLM's weight-version spans
    (`version_of` reads a label); None unless the spans label every token exactly once, one
    span after another from the first token (the caller fails such a sample). Counting the
    spans' lengths alone is not enough: an overlap beside a gap, or a negative start, adds up
    to `n` and leaves tokens with `np.empty`'s garbage for a version."""
    versions = np.empty(n, dtype=np.int32)
    covered = 0
    for span in spans or ():
        if not covered == span.start <= span.end <= n:
            return None
        versions[span.start : span.end] = version_of(span.version)
        covered = span.end
    return versions if covered == n else None


def _token_list(tokens: Any, vocab_size: int, what: str) -> list[int]:
    check_token_ids(tokens, vocab_size, what)
    return [int(t) for t in np.asarray(tokens).tolist()]
