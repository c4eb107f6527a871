"""Laws of the single-device pieces: EarlyStopping, schedules, stack_forest."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

from eqx_train import EarlyStopping, lr_schedule, stack_forest
from eqx_train.testing import assert_trees_equal, strategies as ets

metric_values = st.one_of(
    st.floats(-100, 100, width=32),
    st.sampled_from([float("nan"), 1.0, 2.0, 2.0005]),
)


def _reference_decisions(metrics, min_delta, patience):
    """flax's rule written out in plain Python (NaN skipped as our documented extension)."""
    best, count, stop, out = math.inf, 0, False, []
    for m in metrics:
        m32 = float(np.float32(m))
        if not math.isnan(m32) and (math.isinf(best) or float(np.float32(best - m32)) > min_delta):
            best, count, improved = m32, 0, True
        else:
            stop = count >= patience or stop
            count, improved = count + 1, False
        out.append((stop, improved, count, best))
    return out


@given(
    metrics=st.lists(metric_values, min_size=1, max_size=25),
    min_delta=st.sampled_from([0.0, 1e-3, 0.5]),
    patience=st.integers(0, 4),
)
def test_early_stopping_eager_equals_scan_equals_reference(metrics, min_delta, patience):
    stopper = EarlyStopping(min_delta=min_delta, patience=patience)
    eager = []
    for m in metrics:
        stopper = stopper.update(m)
        eager.append(
            (
                bool(stopper.should_stop),
                bool(stopper.has_improved),
                int(stopper.patience_count),
                float(stopper.best_metric),
            )
        )

    def body(s, m):
        s = s.update(m)
        return s, (s.should_stop, s.has_improved, s.patience_count, s.best_metric)

    _, scanned = jax.lax.scan(
        body,
        EarlyStopping(min_delta=min_delta, patience=patience),
        jnp.asarray(metrics, jnp.float32),
    )
    scanned = list(zip(*(np.asarray(x).tolist() for x in scanned), strict=True))
    reference = _reference_decisions(metrics, np.float32(min_delta), patience)
    assert [e[:3] for e in eager] == [s[:3] for s in scanned] == [r[:3] for r in reference]
    assert [e[3] for e in eager] == [s[3] for s in scanned] == [r[3] for r in reference]


@given(
    base=st.floats(1e-4, 10.0),
    steps_per_epoch=st.integers(1, 50),
    warmup=st.floats(0.0, 5.0),
    steps=st.lists(st.integers(0, 2000), min_size=2, max_size=20),
)
def test_warmup_is_monotone_then_constant(base, steps_per_epoch, warmup, steps):
    schedule = lr_schedule.create_constant_learning_rate_schedule(base, steps_per_epoch, warmup)
    steps = sorted(steps)
    values = np.asarray(schedule(jnp.asarray(steps)))
    assert np.all(np.diff(values) >= -1e-6 * base)
    assert np.all(values <= base * (1 + 1e-6)) and np.all(values >= 0)
    past = [v for s, v in zip(steps, values, strict=True) if s >= warmup * steps_per_epoch]
    np.testing.assert_allclose(past, base, rtol=1e-6)


@given(
    base=st.floats(1e-3, 1.0),
    steps_per_epoch=st.integers(1, 20),
    halfcos=st.floats(0.5, 20.0),
    steps=st.lists(st.integers(0, 400), min_size=2, max_size=20),
)
def test_cosine_is_non_increasing_over_the_half_wave(base, steps_per_epoch, halfcos, steps):
    schedule = lr_schedule.create_cosine_learning_rate_schedule(base, steps_per_epoch, halfcos)
    half = halfcos * steps_per_epoch
    steps = sorted(s for s in steps if s <= half)
    values = np.asarray(schedule(jnp.asarray(steps, jnp.int32))) if steps else np.zeros(0)
    assert np.all(np.diff(values) <= 1e-6 * base)
    assert np.all((values >= -1e-6) & (values <= base * (1 + 1e-6)))


@given(
    base=st.floats(1e-3, 1.0),
    steps_per_epoch=st.integers(1, 20),
    plan=st.lists(st.tuples(st.floats(0, 30), st.floats(1e-4, 1.0)), min_size=1, max_size=4),
    step=st.integers(0, 800),
)
def test_stepped_is_piecewise_constant_with_flax_boundaries(base, steps_per_epoch, plan, step):
    plan = sorted(plan)
    schedule = lr_schedule.create_stepped_learning_rate_schedule(
        base, steps_per_epoch, [list(p) for p in plan]
    )
    boundaries = [round(e * steps_per_epoch) for e, _ in plan]
    passed = sum(b < step for b in boundaries)
    expected = base if passed == 0 else base * plan[passed - 1][1]
    np.testing.assert_allclose(np.asarray(schedule(step)), expected, rtol=1e-6)


@given(template=ets.pytrees(), size=st.integers(1, 4), data=st.data())
def test_stack_forest_then_index_gives_back_each_tree(template, size, data):
    def fresh_values(x):
        if isinstance(x, np.ndarray):
            return data.draw(ets.arrays([x.dtype], shapes=x.shape))
        return x

    def as_stacked(x):
        # Python scalars (module configuration) stack into NumPy arrays of their kind.
        return np.asarray(x) if isinstance(x, bool | int | float) else x

    forest = [jax.tree.map(fresh_values, template) for _ in range(size)]
    stacked = stack_forest(forest)
    for i, tree in enumerate(forest):
        picked = jax.tree.map(
            lambda s, i=i: s[i, ...] if isinstance(s, np.ndarray | jax.Array) else s, stacked
        )
        assert_trees_equal(picked, jax.tree.map(as_stacked, tree))
