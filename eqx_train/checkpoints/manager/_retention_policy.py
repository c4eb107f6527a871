"""Retention policies: which checkpoints a `CheckpointManager` keeps after each save.

A policy is a small frozen object with one method, `keep(context)`, that names the steps
it keeps; `KeepAny` keeps what any of its members keeps. The manager deletes every other
checkpoint once the new one is durable (never the one just saved, whatever the policy).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence, Set
from decimal import Decimal
from typing import Any, Literal, Protocol, runtime_checkable

Mode = Literal["min", "max"]


@dataclasses.dataclass(frozen=True)
class RetentionContext:
    """The checkpoints of a manager's directory, as a retention policy sees them.

    **Arguments:**

    - `steps`: the step of every checkpoint, oldest first, each once. Steps are
      `decimal.Decimal`s, so that float steps compare and subtract without rounding.
    - `rank`: `rank(metric, mode)` returns the steps whose checkpoint holds a usable value
      of `metric` (a number, not NaN), best first (lowest for `mode="min"`, highest for
      `"max"`; ties: the newer first). The manager reads the metrics from the checkpoint
      files only when a policy asks, and once per retention.
    """

    steps: tuple[Decimal, ...]
    rank: Callable[[str, Mode], Sequence[Decimal]]

    def ranked(self, metric: str, mode: Mode = "min") -> Sequence[Decimal]:
        """The steps with a usable `metric`, best first (see `rank`)."""
        return self.rank(metric, mode)


@runtime_checkable
class RetentionPolicy(Protocol):
    """Which checkpoints to keep: any object with this one method (the policies here, or
    one of your own) is a retention policy."""

    def keep(self, context: RetentionContext) -> Set[Decimal]:
        """The steps of `context.steps` to keep; the others are deleted.

        **Arguments:**

        - `context`: the checkpoints of the directory (`RetentionContext`).

        **Returns:** a set of steps (steps not in `context.steps` are ignored).
        """
        ...


def _check_count(value: Any, label: str, minimum: int, why: str = "") -> None:
    """Raises `ValueError` unless `value` is an int (not a bool) >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{label} must be an int >= {minimum}{why}, got {value!r}.")


def check_mode(mode: Any, label: str) -> None:
    """Raises `ValueError` unless `mode` is `"min"` or `"max"`."""
    if mode not in ("min", "max"):
        raise ValueError(f"{label} must be 'min' or 'max', got {mode!r}.")


@dataclasses.dataclass(frozen=True)
class KeepLatest:
    """Keeps the newest `n` checkpoints (the newest one is what resuming needs).

    **Arguments:**

    - `n`: how many (an int >= 1).
    """

    n: int

    def __post_init__(self) -> None:
        _check_count(self.n, "KeepLatest: n", 1)

    def keep(self, context: RetentionContext) -> Set[Decimal]:
        """The newest `n` of `context.steps`."""
        return frozenset(context.steps[-self.n :])


@dataclasses.dataclass(frozen=True)
class KeepBest:
    """Keeps the best `n` checkpoints by a metric saved with them
    (`CheckpointManager.save(..., metrics={metric: value})`). A checkpoint without the
    metric, or with NaN, never counts; ties go to the newer step.

    **Arguments:**

    - `n`: how many (an int >= 1).
    - `metric`: the metric's name (`"val_loss"`).
    - `mode`: `"min"` (default: lower is better) or `"max"`.
    """

    n: int
    metric: str
    mode: Mode = "min"

    def __post_init__(self) -> None:
        _check_count(self.n, "KeepBest: n", 1)
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(
                f"KeepBest: metric must be the non-empty name of a metric saved with the "
                f"checkpoints (e.g. 'val_loss'), got {self.metric!r}."
            )
        check_mode(self.mode, "KeepBest: mode")

    def keep(self, context: RetentionContext) -> Set[Decimal]:
        """The best `n` steps by `metric`."""
        return frozenset(context.ranked(self.metric, self.mode)[: self.n])


@dataclasses.dataclass(frozen=True)
class KeepEveryNSteps:
    """Keeps a sparse history, by flax's `keep_every_n_steps` rule: walking the
    checkpoints from the oldest, keeps a step when it is at least `n` steps past the last
    step kept by this rule. Step 0 is never kept by it (as in flax).

    **Arguments:**

    - `n`: the spacing (a number > 0).
    """

    n: int | float

    def __post_init__(self) -> None:
        n = self.n
        if isinstance(n, bool) or not isinstance(n, int | float) or not n > 0:
            raise ValueError(f"KeepEveryNSteps: n must be a positive number, got {n!r}.")

    def keep(self, context: RetentionContext) -> Set[Decimal]:
        """The steps flax's rule keeps."""
        spacing = Decimal(str(self.n))
        kept: set[Decimal] = set()
        last = Decimal("-Infinity")
        for step in context.steps:
            # A step's fate depends only on older steps: walking all of them keeps, among
            # the older ones, exactly what flax keeps among those older than the newest N.
            if step and step - last >= spacing:
                kept.add(step)
                last = step
        return frozenset(kept)


@dataclasses.dataclass(frozen=True, init=False)
class KeepAny:
    """Keeps a checkpoint when any of `policies` keeps it.

    The members are asked in order, and once every checkpoint is kept the rest are not
    asked: put the ones that read metrics (`KeepBest`) last, so that metrics are read only
    when some checkpoint might go.

    **Arguments:**

    - `*policies`: retention policies (at least one).

    **Example:** `KeepAny(KeepLatest(2), KeepEveryNSteps(1000), KeepBest(1, "val_loss"))`.
    """

    policies: tuple[RetentionPolicy, ...]

    def __init__(self, *policies: RetentionPolicy):
        object.__setattr__(self, "policies", tuple(policies))
        self.__post_init__()

    def __post_init__(self) -> None:
        if not self.policies:
            raise ValueError("KeepAny: give at least one retention policy.")
        for policy in self.policies:
            if not isinstance(policy, RetentionPolicy):
                raise TypeError(
                    "KeepAny: every member must be a retention policy (an object with a "
                    f"keep(context) method, such as KeepLatest(2)), got {policy!r}."
                )

    def keep(self, context: RetentionContext) -> Set[Decimal]:
        """The union of what the members keep."""
        everything = set(context.steps)
        kept: set[Decimal] = set()
        for policy in self.policies:
            if kept >= everything:
                break
            kept.update(policy.keep(context))
        return frozenset(kept)


def best_of(policy: RetentionPolicy) -> tuple[str, Mode] | None:
    """The (metric, mode) of the `KeepBest` members of `policy`, when they all rank by one;
    else None."""
    found: set[tuple[str, Mode]] = set()

    def visit(member: RetentionPolicy) -> None:
        if isinstance(member, KeepBest):
            found.add((member.metric, member.mode))
        elif isinstance(member, KeepAny):
            for inner in member.policies:
                visit(inner)

    visit(policy)
    return found.pop() if len(found) == 1 else None
