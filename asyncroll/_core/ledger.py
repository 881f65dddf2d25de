"""The ledger: where every started group, sample and generated token is right now, and the
identity that says none was lost or counted twice (docs/design.md, invariant 4)."""

from __future__ import annotations

import msgspec

from asyncroll._core.core import Core


class LedgerError(AssertionError):
    """The accounting identity does not hold: a bug, never a user error."""


class Ledger(msgspec.Struct, frozen=True, kw_only=True):
    """Where every started group, sample and generated token is right now."""

    started_groups: int
    in_flight_groups: int
    ready_groups: int
    resume_groups: int
    consumed_groups: int
    filtered_groups: int
    failed_groups: int
    expired_groups: int
    started_samples: int
    in_flight_samples: int
    ready_samples: int
    resume_samples: int
    consumed_samples: int
    filtered_samples: int
    failed_samples: int
    expired_samples: int
    generated_tokens: int
    in_flight_tokens: int
    ready_tokens: int
    resume_tokens: int
    consumed_tokens: int
    wasted_tokens: int
    policy_tokens: int = 0
    environment_tokens: int = 0

    def problems(self) -> list[str]:
        out = []
        for unit in ("groups", "samples"):
            parts = ("in_flight", "ready", "resume", "consumed", "filtered", "failed", "expired")
            total = sum(getattr(self, f"{p}_{unit}") for p in parts)
            started = getattr(self, f"started_{unit}")
            if started != total:
                out.append(f"started_{unit}={started} but the states add up to {total}")
        held = (
            self.in_flight_tokens + self.ready_tokens + self.resume_tokens + self.consumed_tokens
            + self.wasted_tokens
        )  # fmt: skip
        if held != self.generated_tokens:
            out.append(f"generated_tokens={self.generated_tokens} but the states hold {held}")
        if self.policy_tokens + self.environment_tokens != self.generated_tokens:
            out.append(
                f"generated_tokens={self.generated_tokens} but policy_tokens="
                f"{self.policy_tokens} + environment_tokens={self.environment_tokens}"
            )
        return out


def ledger_of(core: Core) -> Ledger:
    """The ledger of the producer whose shared state is `core`."""
    c, b = core.progress.counters, core.buffer.stats()
    inflight = core.inflight.values()
    return Ledger(
        started_groups=c.started_groups,
        in_flight_groups=len(inflight),
        ready_groups=b.ready_groups,
        resume_groups=b.resume_groups,
        consumed_groups=c.consumed_groups,
        filtered_groups=c.filtered_groups,
        failed_groups=c.failed_groups,
        expired_groups=c.expired_groups,
        started_samples=c.started_samples,
        in_flight_samples=sum(f.samples for f in inflight),
        ready_samples=b.ready_samples,
        resume_samples=b.resume_samples,
        consumed_samples=c.consumed_samples,
        filtered_samples=c.filtered_samples,
        failed_samples=c.failed_samples,
        expired_samples=c.expired_samples,
        generated_tokens=c.generated_tokens,
        in_flight_tokens=sum(f.tokens for f in inflight),
        ready_tokens=b.ready_tokens,
        resume_tokens=b.resume_tokens,
        consumed_tokens=c.consumed_tokens,
        wasted_tokens=c.wasted_tokens_failed + c.wasted_tokens_filtered
        + c.wasted_tokens_expired + c.wasted_tokens_restarted + c.wasted_tokens_truncated,
        policy_tokens=c.policy_tokens,
        environment_tokens=c.environment_tokens,
    )  # fmt: skip


def check(core: Core) -> Ledger:
    """Raise `LedgerError` unless every started group, sample and token is in exactly one
    state; return the ledger."""
    ledger = ledger_of(core)
    problems = ledger.problems()
    if problems:
        raise LedgerError("; ".join(problems) + f" ({ledger})")
    return ledger
