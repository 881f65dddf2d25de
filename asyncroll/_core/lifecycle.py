"""The producer's explicit states, and the only transitions allowed between them.

Three small state machines replace what used to be flags read by predicates:

* `Phase`: the producer's life (new, running, stopping, stopped).
* `Gate`: whether groups may start. Holders (`Hold`) close it: the user's `pause()`, an
  `update_weights` or a `save` in progress. Closing drains (or freezes) what is in flight, so a
  gate is OPEN, DRAINING or CLOSED, and a failed drain rolls back to OPEN.
* `Stage`: one group in flight. What a drain does to a group depends only on its stage: a group
  that has not called the engine yet is CANCELLED before it can (so no generation runs after its
  abort), a GENERATING one is aborted, a SCORING one is left to finish (its generation is done and
  its reward has its own deadline, so a pause never throws finished work away).

Each machine moves through `move`, which refuses a transition not in its table: a wrong move is
a bug in asyncroll and surfaces at once instead of leaving a state nobody expects.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from typing import TypeVar

log = logging.getLogger(__name__)


class LifecycleError(RuntimeError):
    """A transition that the state tables do not allow: a bug in asyncroll."""


class Phase(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class Gate(enum.Enum):
    OPEN = "open"  # groups may start
    DRAINING = "draining"  # closed; in-flight work is being aborted (or frozen)
    CLOSED = "closed"  # closed; nothing in flight makes progress until the gate opens


class Hold(enum.Enum):
    """Who keeps the gate closed. Only a USER hold makes a waiting `produce_batch` a stall: the
    others end by themselves."""

    USER = "user"
    UPDATE = "update"
    SAVE = "save"


class Stage(enum.Enum):
    STARTING = "starting"  # its task exists; the engine has not been called
    CANCELLED = "cancelled"  # drained before calling the engine: it lands without calling it
    GENERATING = "generating"
    ABORTING = "aborting"  # abort sent; the engine returns what it has
    SCORING = "scoring"  # generation finished; reward and filter run


_PHASES: Mapping[Phase, frozenset[Phase]] = {
    Phase.NEW: frozenset({Phase.RUNNING, Phase.STOPPED}),
    Phase.RUNNING: frozenset({Phase.STOPPING}),
    Phase.STOPPING: frozenset({Phase.STOPPED}),
    Phase.STOPPED: frozenset(),
}
_GATES: Mapping[Gate, frozenset[Gate]] = {
    Gate.OPEN: frozenset({Gate.DRAINING}),
    Gate.DRAINING: frozenset({Gate.CLOSED, Gate.OPEN}),  # OPEN: the drain failed, rolled back
    Gate.CLOSED: frozenset({Gate.OPEN}),
}
_STAGES: Mapping[Stage, frozenset[Stage]] = {
    Stage.STARTING: frozenset({Stage.GENERATING, Stage.CANCELLED}),
    Stage.CANCELLED: frozenset(),
    Stage.GENERATING: frozenset({Stage.ABORTING, Stage.SCORING}),
    Stage.ABORTING: frozenset({Stage.SCORING}),  # the abort landed after the last token
    Stage.SCORING: frozenset(),
}
_TABLES: dict[type[enum.Enum], Mapping[object, frozenset[object]]] = {
    Phase: _PHASES,  # type: ignore[dict-item]
    Gate: _GATES,  # type: ignore[dict-item]
    Stage: _STAGES,  # type: ignore[dict-item]
}


S = TypeVar("S", Phase, Gate, Stage)


def move(current: S, to: S) -> S:
    """`to`, if the table of `current`'s machine allows the transition; else `LifecycleError`."""
    if to not in _TABLES[type(current)][current]:
        name = type(current).__name__
        raise LifecycleError(f"{name}: {current.value} -> {to.value} is not allowed")
    if type(to) is not Stage:  # a group's stage changes on the hot path: its landing is logged
        log.debug("%s: %s -> %s", type(to).__name__, current.value, to.value)
    return to
