"""EarlyStopping: flax's decisions, plus jit/scan/vmap, mode="max", NaN and validation."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.training.early_stopping import EarlyStopping as FlaxEarlyStopping

from eqx_train import EarlyStopping

SEED_LOSSES = [4, 3, 3, 3, 2, 2, 2, 2, 1, 1]


def _first_stop(stopper, metrics):
    for epoch, metric in enumerate(metrics):
        stopper = stopper.update(metric)
        if bool(stopper.should_stop):
            return epoch
    return None


def test_flax_documentation_example_stops_at_epoch_7():
    assert _first_stop(EarlyStopping(min_delta=1e-3, patience=2), SEED_LOSSES) == 7


def test_decision_sequence_matches_flax_field_by_field():
    metrics = [5.0, 4.0, 4.0005, 4.5, 3.0, 3.0, 3.0, 2.9999, 2.0, 7.0, 7.0, 7.0]
    ours, theirs = EarlyStopping(min_delta=1e-3, patience=1), FlaxEarlyStopping(1e-3, 1)
    for metric in metrics:
        ours, theirs = ours.update(metric), theirs.update(metric)
        assert bool(ours.should_stop) == theirs.should_stop
        assert bool(ours.has_improved) == theirs.has_improved
        assert int(ours.patience_count) == theirs.patience_count
        assert float(ours.best_metric) == pytest.approx(theirs.best_metric)


def test_update_returns_new_object_and_leaves_old_unchanged():
    stopper = EarlyStopping(patience=1)
    updated = stopper.update(1.0)
    assert float(stopper.best_metric) == math.inf
    assert float(updated.best_metric) == 1.0


def test_all_numeric_fields_are_arrays():
    stopper = EarlyStopping(min_delta=0.1, patience=3)
    for name in (
        "min_delta",
        "patience",
        "best_metric",
        "patience_count",
        "should_stop",
        "has_improved",
    ):
        assert isinstance(getattr(stopper, name), jax.Array), name


def test_update_under_jit_matches_eager():
    update = jax.jit(lambda s, m: s.update(m))
    eager, jitted = EarlyStopping(min_delta=1e-3, patience=2), EarlyStopping(1e-3, 2)
    for metric in SEED_LOSSES:
        eager, jitted = eager.update(metric), update(jitted, metric)
        assert bool(eager.should_stop) == bool(jitted.should_stop)
        assert int(eager.patience_count) == int(jitted.patience_count)


def test_scan_over_metrics_matches_python_loop():
    def body(stopper, metric):
        stopper = stopper.update(metric)
        return stopper, stopper.should_stop

    _, stops = jax.lax.scan(body, EarlyStopping(1e-3, 2), jnp.asarray(SEED_LOSSES, jnp.float32))
    assert int(np.argmax(np.asarray(stops))) == 7


def test_vmap_over_min_delta_gives_each_stopper_its_own_decision():
    deltas = jnp.asarray([1e-3, 0.5, 2.0])
    stoppers = jax.vmap(lambda d: EarlyStopping(min_delta=d, patience=0))(deltas)
    metrics = [4.0, 3.0, 2.6]
    for metric in metrics:
        stoppers = jax.vmap(lambda s, m=metric: s.update(m))(stoppers)
    # 4 -> 3 improves for deltas 1e-3 and 0.5; 3 -> 2.6 only for 1e-3.
    expected = []
    for delta in [1e-3, 0.5, 2.0]:
        s = EarlyStopping(min_delta=delta, patience=0)
        for metric in metrics:
            s = s.update(metric)
        expected.append(bool(s.should_stop))
    assert np.asarray(stoppers.should_stop).tolist() == expected == [False, True, True]


def test_mode_max_treats_higher_as_better():
    stopper = EarlyStopping(min_delta=0.01, patience=1, mode="max")
    assert float(stopper.best_metric) == -math.inf
    stopper = stopper.update(0.5).update(0.7)
    assert bool(stopper.has_improved) and float(stopper.best_metric) == pytest.approx(0.7)
    stopper = stopper.update(0.705).update(0.6)
    assert bool(stopper.should_stop)
    assert float(stopper.best_metric) == pytest.approx(0.7)


def test_nan_never_improves_nor_becomes_best():
    stopper = EarlyStopping(patience=5).update(float("nan"))
    assert not bool(stopper.has_improved)
    assert float(stopper.best_metric) == math.inf
    stopper = stopper.update(2.0).update(float("nan"))
    assert float(stopper.best_metric) == 2.0 and not bool(stopper.has_improved)
    assert int(stopper.patience_count) == 1


def test_reset_keeps_settings_and_clears_history():
    stopper = EarlyStopping(min_delta=0.1, patience=0, mode="max").update(1.0).update(0.0)
    stopper = stopper.update(0.0)
    assert bool(stopper.should_stop)
    fresh = stopper.reset()
    assert float(fresh.best_metric) == -math.inf
    assert int(fresh.patience_count) == 0
    assert not bool(fresh.should_stop) and not bool(fresh.has_improved)
    assert float(fresh.min_delta) == pytest.approx(0.1) and fresh.mode == "max"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"patience": -1}, "patience must be >= 0, got -1"),
        ({"min_delta": -0.5}, "min_delta must be >= 0, got -0.5"),
        ({"mode": "maximum"}, "mode must be 'min' or 'max', got 'maximum'"),
    ],
)
def test_invalid_arguments_raise_clear_errors(kwargs, message, without_type_checks):
    with pytest.raises(ValueError, match=message):
        EarlyStopping(**kwargs)
