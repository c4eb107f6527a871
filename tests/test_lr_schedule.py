"""Learning-rate schedules: flax's values, elementwise over steps, jit/vmap, validation."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl import logging as absl_logging
from flax.training import lr_schedule as flax_lr

from eqx_train import lr_schedule

absl_logging.set_verbosity(absl_logging.ERROR)  # flax logs a deprecation notice per schedule

STEPS = list(range(0, 1200, 7)) + [0, 1, 299, 300, 301, 600, 601]


def _both(name, *args, **kwargs):
    return getattr(lr_schedule, name)(*args, **kwargs), getattr(flax_lr, name)(*args, **kwargs)


@pytest.mark.parametrize("warmup", [0.0, 2.5])
def test_constant_matches_flax(warmup):
    ours, theirs = _both("create_constant_learning_rate_schedule", 0.1, 100, warmup)
    for step in STEPS:
        np.testing.assert_allclose(ours(step), theirs(step), rtol=1e-6)


@pytest.mark.parametrize("warmup", [0.0, 1.0])
def test_stepped_matches_flax_including_boundaries(warmup):
    sched = [[3, 0.1], [6, 0.01], [8.005, 0.001]]
    ours, theirs = _both("create_stepped_learning_rate_schedule", 0.4, 100, sched, warmup)
    for step in STEPS:
        np.testing.assert_allclose(ours(step), theirs(step), rtol=1e-6)


def test_stepped_boundary_rule_is_round_epoch_times_steps_and_strict():
    # Boundary round(2.5 * 3) = round(7.5) = 8 (NumPy rounds half to even).
    schedule = lr_schedule.create_stepped_learning_rate_schedule(1.0, 3, [[2.5, 0.5]])
    assert [float(np.asarray(schedule(s))) for s in (7, 8, 9)] == [1.0, 1.0, 0.5]


@pytest.mark.parametrize("warmup", [0.0, 3.0])
def test_cosine_matches_flax(warmup):
    ours, theirs = _both("create_cosine_learning_rate_schedule", 0.2, 100, 10, warmup)
    for step in STEPS:
        np.testing.assert_allclose(ours(step), theirs(step), rtol=1e-6)
    steps = jnp.asarray(STEPS)
    np.testing.assert_allclose(ours(steps), theirs(steps), rtol=1e-6)


def test_cosine_reference_values():
    schedule = lr_schedule.create_cosine_learning_rate_schedule(1.0, 10, 2)
    np.testing.assert_allclose(
        [float(np.asarray(schedule(s))) for s in (0, 5, 10, 20)],
        [1.0, 0.8535534, 0.5, 0.0],
        atol=1e-6,
    )


def test_warmup_ramps_linearly_from_zero():
    schedule = lr_schedule.create_constant_learning_rate_schedule(0.5, 10, warmup_length=2)
    np.testing.assert_allclose(
        [float(np.asarray(schedule(s))) for s in (0, 5, 10, 20, 40)], [0.0, 0.125, 0.25, 0.5, 0.5]
    )


@pytest.mark.parametrize(
    "schedule",
    [
        lr_schedule.create_constant_learning_rate_schedule(0.1, 10, 1.0),
        lr_schedule.create_stepped_learning_rate_schedule(0.1, 10, [[1, 0.5], [3, 0.1]], 0.5),
        lr_schedule.create_cosine_learning_rate_schedule(0.1, 10, 5, 1.0),
    ],
    ids=["constant", "stepped", "cosine"],
)
def test_schedule_is_elementwise_under_jit_and_vmap(schedule):
    steps = jnp.arange(0, 60, 3)
    one_by_one = np.asarray([float(np.asarray(schedule(s))) for s in steps])
    # XLA's vectorised cos differs from its scalar cos by a few ulps near zero.
    close: dict[str, Any] = {"rtol": 1e-6, "atol": 1e-8}
    np.testing.assert_allclose(schedule(steps), one_by_one, **close)
    np.testing.assert_allclose(jax.jit(schedule)(steps), one_by_one, **close)
    np.testing.assert_allclose(jax.vmap(schedule)(steps), one_by_one, **close)
    # Python ints are computed in float64 before rounding (as flax): equal up to float32 noise.
    python_ints = np.asarray([float(schedule(int(s))) for s in steps])
    np.testing.assert_allclose(python_ints, one_by_one, rtol=1e-6, atol=1e-7)
    assert schedule(jnp.int32(4)).shape == ()


def test_stepped_schedule_on_an_array_of_steps_matches_a_literal_table():
    # flax compares the whole boundary list with `step` at once, so it cannot do this.
    # Boundaries: round(2 * 1.5) = 3 and round(4 * 1.5) = 6, each strictly passed.
    schedule = lr_schedule.create_stepped_learning_rate_schedule(1.0, 1.5, [[2, 0.5], [4, 0.25]])
    steps = jnp.asarray([[0, 3, 4], [6, 7, 100]])
    expected = np.asarray([[1.0, 1.0, 0.5], [0.5, 0.25, 0.25]], np.float32)
    np.testing.assert_array_equal(schedule(steps), expected)
    np.testing.assert_array_equal(jax.vmap(schedule)(steps), expected)
    np.testing.assert_array_equal(jax.jit(schedule)(steps), expected)


def test_schedule_drives_an_optax_optimiser():
    schedule = lr_schedule.create_cosine_learning_rate_schedule(0.1, 4, 2, warmup_length=0.5)
    tx = optax.sgd(schedule)
    params = jnp.ones(3)
    state = tx.init(params)
    updates, _ = tx.update(jnp.ones(3), state, params)
    np.testing.assert_allclose(np.asarray(updates), -float(np.asarray(schedule(0))) * np.ones(3))


@pytest.mark.parametrize(
    ("factory", "args", "message"),
    [
        ("create_constant_learning_rate_schedule", (0.1, 0), "steps_per_epoch must be > 0"),
        ("create_constant_learning_rate_schedule", (0.1, 10, -1.0), "warmup_length must be >= 0"),
        ("create_constant_learning_rate_schedule", ("0.1", 10), "base_learning_rate must be a"),
        ("create_cosine_learning_rate_schedule", (0.1, 10, 0), "halfcos_epochs must be > 0"),
        (
            "create_stepped_learning_rate_schedule",
            (0.1, 10, [[3, 0.1], [2, 0.01]]),
            "non-decreasing",
        ),
        ("create_stepped_learning_rate_schedule", (0.1, 10, [[3]]), r"\[epoch, lr_factor\] pair"),
        ("create_stepped_learning_rate_schedule", (0.1, 10, [[3, float("nan")]]), "must be finite"),
    ],
)
def test_invalid_arguments_are_rejected_at_creation(factory, args, message, without_type_checks):
    with pytest.raises((ValueError, TypeError), match=message):
        getattr(lr_schedule, factory)(*args)
