"""Multi-process coordination on the key-value store and barriers of the coordination service
that `jax.distributed.initialize` starts. The only module that touches JAX's internals.

Placeholder interface (issue 12): single-process behaviour only; the multi-process
implementation lands with the issue.
"""

from __future__ import annotations

from collections.abc import Callable

import jax


class BarrierTimeoutError(TimeoutError):
    """A multi-process operation waited longer than its timeout for its peers; the message
    names the processes that did not arrive."""


def next_id(kind: str) -> str:
    """A key prefix unique to this collective call: every process calls collectives in the
    same order, so the n-th call of `kind` gets the same id everywhere."""
    count = _COUNTERS.get(kind, 0)
    _COUNTERS[kind] = count + 1
    return f"eqx_train/{kind}/{count}"


_COUNTERS: dict[str, int] = {}


def broadcast(op: str, value: str | None, *, timeout_s: float, caller: str) -> str:
    """Process 0's `value` (ignored on other processes), returned on every process."""
    if jax.process_count() == 1:
        assert value is not None
        return value
    raise NotImplementedError


def gather(op: str, value: str, *, timeout_s: float, caller: str) -> list[str]:
    """Every process's `value`, in process order, returned on every process."""
    if jax.process_count() == 1:
        return [value]
    raise NotImplementedError


def barrier(op: str, *, timeout_s: float, caller: str) -> None:
    """Returns once every process has called `barrier` with the same `op`."""
    if jax.process_count() == 1:
        return
    raise NotImplementedError


def decide(
    op: str,
    make_decision: Callable[[], bool | str],
    *,
    timeout_s: float,
    caller: str,
) -> bool | str:
    """`make_decision()` computed on process 0 only and returned on every process, so that a
    decision that reads a clock or the filesystem is the same everywhere."""
    if jax.process_count() == 1:
        return make_decision()
    raise NotImplementedError


def reached_preemption(step: int) -> bool:
    """True at the step where every process of the job agreed to stop for a preemption
    (JAX's preemption sync point); False when the preemption service is not available."""
    if jax.process_count() == 1:
        return False
    raise NotImplementedError
