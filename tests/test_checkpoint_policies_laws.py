"""Retention policy laws over random histories: a combination keeps exactly the union of
what its members keep, each member's rule written out independently here; the newest
checkpoint survives any policy that includes `KeepLatest`; float steps are exact."""

import math
from decimal import Decimal

from hypothesis import given, strategies as st

from eqx_train.checkpoints import (
    KeepAny,
    KeepBest,
    KeepEveryNSteps,
    KeepLatest,
    RetentionContext,
    RetentionPolicy,
)

metric = st.one_of(st.none(), st.just(float("nan")), st.floats(-5, 5, allow_nan=False))


def _context(steps, metrics):
    def rank(name, mode):
        usable = [s for s in steps if metrics[s] is not None and not math.isnan(metrics[s])]
        sign = 1 if mode == "min" else -1
        return sorted(usable, key=lambda s: (sign * metrics[s], -s))

    return RetentionContext(tuple(steps), rank)


def _latest(steps, n):
    return set(steps[-n:])


def _every(steps, n):
    kept, last = set(), None
    for s in steps:
        if s != 0 and (last is None or s - last >= n):
            kept.add(s)
            last = s
    return kept


def _best(steps, metrics, n, mode):
    usable = [s for s in steps if metrics[s] is not None and not math.isnan(metrics[s])]
    return set(sorted(usable, key=lambda s: ((1 if mode == "min" else -1) * metrics[s], -s))[:n])


@given(
    history=st.lists(st.tuples(st.integers(1, 4), metric), min_size=1, max_size=15),
    latest=st.integers(1, 4),
    every=st.one_of(st.none(), st.integers(1, 6)),
    best=st.integers(0, 3),
    mode=st.sampled_from(["min", "max"]),
)
def test_keep_any_is_the_union_of_its_members(history, latest, every, best, mode):
    steps, metrics, step = [], {}, 0
    for gap, value in history:
        step += gap
        steps.append(Decimal(step))
        metrics[Decimal(step)] = value
    members: list[RetentionPolicy] = [KeepLatest(latest)]
    expected = _latest(steps, latest)
    if every is not None:
        members.append(KeepEveryNSteps(every))
        expected |= _every(steps, every)
    if best:
        members.append(KeepBest(best, "m", mode))
        expected |= _best(steps, metrics, best, mode)
    kept = KeepAny(*members).keep(_context(steps, metrics))
    assert set(kept) == expected
    assert steps[-1] in kept


@given(st.lists(st.integers(0, 40), min_size=1, max_size=12, unique=True), st.integers(1, 5))
def test_keep_every_n_steps_is_exact_on_float_steps(tenths, n):
    # Steps 0.1 apart: Decimal keeps 0.3 - 0.1 == 0.2 exact, as floats would not.
    steps = sorted(Decimal(t) / 10 for t in tenths)
    spacing = Decimal(n) / 10
    kept, last = set(), None
    for s in steps:
        if s != 0 and (last is None or s - last >= spacing):
            kept.add(s)
            last = s
    assert set(KeepEveryNSteps(n / 10).keep(_context(steps, dict.fromkeys(steps)))) == kept
