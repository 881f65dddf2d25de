"""The demo trainer's terms for the problems GRPO is blind to, on CPU with the tiny model
(no vLLM): what a step does to a blind problem's sampled tokens, and the flags' validation."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np
import pytest

from asyncroll.app.demo import DemoConfig, demo_config
from asyncroll.types import RolloutGroup
from tests.factories import make_group

torch = pytest.importorskip("torch")

SAID = 7  # the token every sample of the blind group said


def blind_group(reward: float) -> RolloutGroup:
    """8 samples that all said `SAID` 4 times and all scored `reward`: zero variance."""
    group = make_group(samples=8, tokens=4)
    samples = tuple(
        msgspec.structs.replace(
            s, tokens=np.full(4, SAID, dtype=np.int32), logprobs=np.full(4, -6.0, np.float32),
            reward=reward,
        )
        for s in group.samples
    )  # fmt: skip
    return msgspec.structs.replace(group, samples=samples)


def said_probability(trainer: Any, group: RolloutGroup) -> float:
    ids = torch.tensor([[*group.prompt_tokens.tolist(), SAID]])
    with torch.no_grad():
        logits = trainer.model(input_ids=ids).logits
    return float(torch.softmax(logits[0, -2], -1)[SAID])


def trained_once(reward: float, **options: Any) -> tuple[float, float]:
    from asyncroll.app.demo import demo_model
    from asyncroll.app.demo_trainer import Trainer
    from asyncroll.engines.base import SamplingConfig

    cfg = DemoConfig(seed=0)
    trainer = Trainer(demo_model(cfg), 3e-3, 0, SamplingConfig(max_new_tokens=4), "tis", **options)
    group = blind_group(reward)
    before = said_probability(trainer, group)
    trainer.step([group], version=0)
    return before, said_probability(trainer, group)


def test_a_blind_problem_gets_no_gradient_without_the_push_and_is_pushed_off_with_it() -> None:
    """All 8 samples said the same wrong token: GRPO's advantages are 0, and a step leaves
    the policy exactly as it was. With `blind_push` on every blind problem (`push_on="blind"`)
    the step makes that token less likely, for an all-0 problem and for an equal partial one;
    not for a solved one (all 1), nor once the context's entropy is at the target (the tiny
    model starts near uniform, ~6.2 nats, above a target of 2)."""
    push = {"blind_push": 1.0, "blind_target": 10.0, "push_on": "blind"}
    before, after = trained_once(0.0)
    assert after == before
    before, after = trained_once(0.0, **push)
    assert after < before * 0.9
    before, after = trained_once(0.5, **push)
    assert after < before * 0.9
    before, after = trained_once(1.0, **push)
    assert after == before
    before, after = trained_once(0.0, **{**push, "blind_target": 2.0})
    assert after == before


def test_the_push_on_failed_problems_leaves_an_equal_partial_problem_alone() -> None:
    """`push_on="failed"` (the default): the push acts where every sample scored 0 (each
    sampled token is a wrong answer), not where every sample scored the same partial reward:
    there the sampled tokens hold right answers too, and pushing them down unlearns them (a
    run's plateau at 0.5, tool_echo_dynamics.md)."""
    assert DemoConfig().push_on == "failed"  # the default, the trainer's too
    push = {"blind_push": 1.0, "blind_target": 10.0}
    before, after = trained_once(0.0, **push)
    assert after < before * 0.9
    before, after = trained_once(0.5, **push)
    assert after == before


def test_push_on_is_refused_by_flag() -> None:
    with pytest.raises(ValueError, match="--push-on must be one of failed, blind"):
        DemoConfig(push_on="some")


@pytest.mark.parametrize("name", ["blind_entropy", "blind_target", "blind_push"])
@pytest.mark.parametrize("value", [-0.1, math.nan, math.inf])
def test_blind_options_are_refused_by_flag(name: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"--{name.replace('_', '-')}"):
        DemoConfig(**{name: value})


def test_tool_echo_defaults_reach_the_config() -> None:
    from asyncroll.app.demo_tool import DEFAULTS

    cfg = demo_config(task="tool_echo")
    assert {k: getattr(cfg, k) for k in DEFAULTS} == dict(DEFAULTS)
    assert demo_config(task="tool_echo", blind_push=0.0).blind_push == 0.0


def test_solved_needs_the_last_ten_steps_settled_too() -> None:
    """The demo stops once the last 3 steps average `solved_reward` and the last 10 at least
    0.9: a steep rise (0.98 over 3 steps, the 7 before it low) goes on until it is settled."""
    from asyncroll.app.demo import solved
    from asyncroll.app.demo_report import StepRecord

    def records(rewards: list[float]) -> list[StepRecord]:
        return [
            StepRecord(
                step=i, version=i, reward=r, train_s=0.0, wait_s=0.0, wall_s=0.0,
                tokens_per_s=0.0, failed_groups=0, filtered_groups=0, expired_groups=0,
                rss_mib=0.0, loss=0.0, staleness_mean=0.0, idle_s=0.0, offpolicy={},
            )
            for i, r in enumerate(rewards)
        ]  # fmt: skip

    steep = [0.8] * 7 + [0.98] * 3  # last 10: 0.854
    assert not solved(records(steep), 0.98)
    assert solved(records(steep[3:] + [0.98] * 4), 0.98)  # last 10: 0.934
    assert solved(records([0.98] * 3), 0.98)  # a short run: the 3 steps are all there is
    assert not solved(records([0.98] * 2), 0.98)
    assert solved(records([0.5] * 10), 0.5)  # a threshold below 0.9 asks that much of the 10
    assert not solved(records([1.0] * 10), 0.0)  # 0: never
