"""Job states and the transitions between them (pure)."""

from __future__ import annotations

from typing import Literal

JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
TRANSITIONS = {
    "queued": {"running", "failed", "cancelled"},
    "running": {"succeeded", "failed", "cancelled"},
}


class InvalidTransition(ValueError):
    pass


def transition(current: str, new: str) -> str:
    if new not in TRANSITIONS.get(current, set()):
        raise InvalidTransition(f"a job in state {current} cannot become {new}")
    return new
