"""Save policies: when `CheckpointManager.should_save` says yes.

A policy is a small frozen object with one method, `should_save(context)`; `SaveAny` says
yes when any of its members does. Whatever the policy, the manager never says yes to a
step that is not newer than every checkpoint already saved.
"""

from __future__ import annotations

import dataclasses
import math
from decimal import Decimal
from typing import Any, Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class SaveContext:
    """What a save policy knows when `should_save` is asked.

    **Arguments:**

    - `step`: the step asked about, exactly (a `decimal.Decimal`).
    - `seconds_since_save`: seconds since the last save through this manager began, or
      since the manager was created (by a monotonic clock).
    - `preempted`: whether a preemption was signalled (SIGTERM, or JAX's preemption sync
      point at this step); the job is about to end.
    """

    step: Decimal
    seconds_since_save: float
    preempted: bool


@runtime_checkable
class SavePolicy(Protocol):
    """When to save: any object with this one method (the policies here, or one of your
    own) is a save policy."""

    def should_save(self, context: SaveContext) -> bool:
        """Whether to save at `context.step`.

        **Arguments:**

        - `context`: the step, the time since the last save, and whether the job is being
          preempted (`SaveContext`).

        **Returns:** `True` to save.
        """
        ...


def check_steps(value: Any, label: str, none: str = "") -> None:
    """Raises `ValueError` unless `value` is an int (not a bool) >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{label} must be an int >= 1 (save at every multiple of it){none}, got {value!r}."
        )


def check_seconds(value: Any, label: str, none: str = "") -> None:
    """Raises `ValueError` unless `value` is a finite number (not a bool) > 0."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"{label} must be a finite number > 0 (the seconds between saves){none}, got {value!r}."
        )


@dataclasses.dataclass(frozen=True)
class SaveEveryNSteps:
    """Saves at every multiple of `n` (step 0 included).

    **Arguments:**

    - `n`: the interval (an int >= 1).
    """

    n: int

    def __post_init__(self) -> None:
        check_steps(self.n, "SaveEveryNSteps: n")

    def should_save(self, context: SaveContext) -> bool:
        """Whether `context.step` is a multiple of `n`."""
        return context.step % self.n == 0


@dataclasses.dataclass(frozen=True)
class SaveEveryNSeconds:
    """Saves once `seconds` have passed since the last save through the manager began (or
    since the manager was created).

    **Arguments:**

    - `seconds`: the interval (a finite number > 0).
    """

    seconds: int | float

    def __post_init__(self) -> None:
        check_seconds(self.seconds, "SaveEveryNSeconds: seconds")

    def should_save(self, context: SaveContext) -> bool:
        """Whether `seconds` have passed."""
        return context.seconds_since_save >= self.seconds


@dataclasses.dataclass(frozen=True)
class SaveOnPreemption:
    """Saves when the job is being preempted (SIGTERM, or JAX's preemption sync point), so
    that the next run resumes from that step. Part of every manager's default policy."""

    def should_save(self, context: SaveContext) -> bool:
        """Whether a preemption was signalled."""
        return context.preempted


@dataclasses.dataclass(frozen=True, init=False)
class SaveAny:
    """Saves when any of `policies` says so.

    **Arguments:**

    - `*policies`: save policies (at least one).

    **Example:** `SaveAny(SaveOnPreemption(), SaveEveryNSteps(1000), SaveEveryNSeconds(1800))`.
    """

    policies: tuple[SavePolicy, ...]

    def __init__(self, *policies: SavePolicy):
        object.__setattr__(self, "policies", tuple(policies))
        self.__post_init__()

    def __post_init__(self) -> None:
        if not self.policies:
            raise ValueError("SaveAny: give at least one save policy.")
        for policy in self.policies:
            if not isinstance(policy, SavePolicy):
                raise TypeError(
                    "SaveAny: every member must be a save policy (an object with a "
                    f"should_save(context) method, such as SaveEveryNSteps(100)), got "
                    f"{policy!r}."
                )

    def should_save(self, context: SaveContext) -> bool:
        """Whether any member says yes."""
        return any(policy.should_save(context) for policy in self.policies)
