"""Factories of groups and samples shared by the core tests."""

from __future__ import annotations

from typing import Any

import numpy as np

from asyncroll.types import RolloutGroup, RolloutState, Status


def make_sample(
    n: int = 4,
    *,
    status: Status = Status.COMPLETED,
    version: int = 0,
    reward: float | None = 1.0,
    payload: int = 0,
    finish: str | None = "length",
    seed: int = 0,
) -> RolloutState:
    rng = np.random.default_rng(seed)
    return RolloutState(
        tokens=rng.integers(0, 100, n, dtype=np.int32),
        logprobs=-rng.random(n, dtype=np.float32),
        versions=np.full(n, version, dtype=np.int32),
        status=status,
        finish_reason=finish,
        reward=reward,
        routed_experts=np.ones((n, payload), dtype=np.uint8) if payload else None,
    )


def make_group(
    uid: int = 0,
    *,
    status: Status = Status.COMPLETED,
    samples: int = 2,
    tokens: int = 4,
    version: int = 0,
    payload: int = 0,
    **kwargs: Any,
) -> RolloutGroup:
    sample_status = Status.ABORTED if status is Status.ABORTED else Status.COMPLETED
    return RolloutGroup(
        uid=uid,
        prompt_id=f"p/{uid}",
        task="t",
        prompt_tokens=np.arange(3, dtype=np.int32),
        samples=tuple(
            make_sample(tokens, status=sample_status, version=version, payload=payload, seed=i)
            for i in range(samples)
        ),
        status=status,
        **kwargs,
    )
