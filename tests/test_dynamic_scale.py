"""DynamicScale: flax's loss-scaling numbers, step by step, as a jit-safe Equinox module."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.training import dynamic_scale as flax_dynamic_scale

from eqx_train import DynamicScale
from tests.support.helpers import assert_trees_equal

# Finite (True) and overflowing (False) steps: runs long enough to grow the scale with
# growth_interval=2, and overflows back to back to shrink it twice in a row.
PATTERN = [True, True, True, False, True, True, True, True, False, False, True, True, True]


def _loss(params, factor):
    # float16 arithmetic, as in mixed precision: with a large scale the backward pass
    # overflows float16 naturally; `factor=inf` forces an overflow whatever the scale.
    w = jnp.asarray(params["w"], jnp.float16)
    return jnp.sum((w * factor) ** 2) + jnp.sum(params["b"])


PARAMS = {"w": jnp.array([0.5, -1.25, 2.0], jnp.float32), "b": jnp.array([0.1], jnp.float32)}


def test_matches_flax_over_finite_and_non_finite_steps():
    ours = DynamicScale(growth_interval=2, scale=2.0**14)
    theirs = flax_dynamic_scale.DynamicScale(growth_interval=2, scale=2.0**14)
    our_step = jax.jit(lambda ds, f: ds.value_and_grad(_loss)(PARAMS, f))
    their_step = jax.jit(lambda ds, f: ds.value_and_grad(_loss)(PARAMS, f))
    scales, finites = [], []
    for finite in PATTERN:
        factor = jnp.float16(1.0 if finite else jnp.inf)
        ours, our_fin, our_loss, our_grads = our_step(ours, factor)
        theirs, their_fin, their_loss, their_grads = their_step(theirs, factor)
        assert bool(our_fin) == bool(their_fin)
        np.testing.assert_array_equal(ours.scale, np.float32(theirs.scale))
        np.testing.assert_array_equal(ours.fin_steps, theirs.fin_steps)
        np.testing.assert_array_equal(our_loss, their_loss)
        assert_trees_equal(our_grads, their_grads)
        scales.append(float(ours.scale))
        finites.append(bool(our_fin))
    # The run grew and shrank the scale, and at least one step with factor 1 overflowed
    # float16 by itself because the scale was too large.
    assert max(scales) > min(scales) and len(set(scales)) >= 3
    assert any(p and not f for p, f in zip(PATTERN, finites, strict=True))


def test_scale_and_step_count_follow_the_rule_by_hand():
    # growth_interval=1: grow on the second finite step in a row; back off on overflow.
    ds = DynamicScale(scale=8.0, growth_interval=1)
    expected = [  # (finite, scale after, fin_steps after)
        (True, 8.0, 1),
        (True, 16.0, 0),
        (True, 16.0, 1),
        (False, 8.0, 0),
        (False, 4.0, 0),
        (True, 4.0, 1),
        (True, 8.0, 0),
    ]
    step = jax.jit(lambda ds, f: ds.value_and_grad(_loss)(PARAMS, f))
    for finite, scale, fin_steps in expected:
        ds, is_finite, _, _ = step(ds, jnp.float16(1.0 if finite else jnp.inf))
        assert (bool(is_finite), float(ds.scale), int(ds.fin_steps)) == (finite, scale, fin_steps)


def test_gradients_are_unscaled_float32_and_equal_plain_gradients():
    ds = DynamicScale(scale=1024.0)
    params = {"w": jnp.array([0.5, -1.5], jnp.float32), "b": jnp.array([2.0], jnp.float32)}
    _, is_finite, loss, grads = ds.value_and_grad(_loss)(params, jnp.float16(1.0))
    assert bool(is_finite)
    # d/dw sum(w^2) = 2w, d/db sum(b) = 1, computed by hand.
    np.testing.assert_array_equal(grads["w"], np.array([1.0, -3.0], np.float32))
    np.testing.assert_array_equal(grads["b"], np.array([1.0], np.float32))
    assert grads["w"].dtype == jnp.float32
    np.testing.assert_allclose(loss, 0.25 + 2.25 + 2.0, rtol=1e-6)


def test_has_aux_returns_loss_and_aux_like_flax():
    def loss_with_aux(params, factor):
        return _loss(params, factor), {"norm": jnp.linalg.norm(params["w"])}

    ours = DynamicScale(growth_interval=3)
    theirs = flax_dynamic_scale.DynamicScale(growth_interval=3)
    ours, our_fin, (our_loss, our_aux), our_grads = ours.value_and_grad(
        loss_with_aux, has_aux=True
    )(PARAMS, jnp.float16(1.0))
    theirs, their_fin, (their_loss, their_aux), their_grads = theirs.value_and_grad(
        loss_with_aux, has_aux=True
    )(PARAMS, jnp.float16(1.0))
    assert bool(our_fin) == bool(their_fin)
    np.testing.assert_array_equal(our_loss, their_loss)
    assert_trees_equal(our_aux, their_aux)
    assert_trees_equal(our_grads, their_grads)


def test_filters_an_equinox_model_like_filter_value_and_grad():
    model = eqx.nn.MLP(3, 2, 4, 1, activation=jax.nn.gelu, key=jax.random.key(0))
    x = jnp.ones((5, 3))

    def loss(model, x):
        return jnp.mean(jax.vmap(model)(x) ** 2)

    _, is_finite, value, grads = DynamicScale(scale=256.0).value_and_grad(loss)(model, x)
    plain_value, plain_grads = eqx.filter_value_and_grad(loss)(model, x)
    assert bool(is_finite)
    assert grads.activation is None  # non-array leaves get no gradient, as in Equinox
    np.testing.assert_allclose(value, plain_value, rtol=1e-6)
    for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(plain_grads), strict=True):
        np.testing.assert_allclose(g, p, rtol=1e-6, atol=1e-7)


def _sum_of_b(params: dict[str, jax.Array]) -> jax.Array:
    return jnp.sum(params["b"])


def test_backoff_stops_at_minimum_scale_and_growth_at_float32_max():
    floor = DynamicScale(scale=3.0, minimum_scale=2.0)
    floor, *_ = floor.value_and_grad(_loss)(PARAMS, jnp.float16(jnp.inf))
    assert float(floor.scale) == 2.0
    top = DynamicScale(scale=float(jnp.finfo(jnp.float32).max), growth_interval=0)
    top, is_finite, _, _ = top.value_and_grad(_sum_of_b)(PARAMS)
    assert bool(is_finite) and float(top.scale) == float(jnp.finfo(jnp.float32).max)


def test_jit_compiles_once_across_finite_and_non_finite_steps_and_scan_carries_it():
    traces = []

    @jax.jit
    def step(ds, factor):
        traces.append(None)
        return ds.value_and_grad(_loss)(PARAMS, factor)[0]

    ds = DynamicScale(growth_interval=2)
    factors = jnp.array([1.0 if f else jnp.inf for f in PATTERN], jnp.float16)
    for factor in factors:
        ds = step(ds, factor)
    assert len(traces) == 1

    def body(ds, factor):
        return ds.value_and_grad(_loss)(PARAMS, factor)[0], None

    scanned, _ = jax.lax.scan(body, DynamicScale(growth_interval=2), factors)
    assert_trees_equal(scanned, ds)


def test_fields_are_float32_and_int32_arrays():
    ds = DynamicScale(scale=4, fin_steps=3)
    assert ds.scale.dtype == jnp.float32 and ds.scale.shape == ()
    assert ds.fin_steps.dtype == jnp.int32 and ds.fin_steps.shape == ()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"growth_factor": 0.5}, r"growth_factor must be >= 1, got 0\.5"),
        ({"backoff_factor": 0.0}, r"backoff_factor must be in \(0, 1\], got 0\.0"),
        ({"growth_interval": -1}, r"growth_interval must be >= 0, got -1"),
        ({"minimum_scale": 0.0}, r"minimum_scale must be > 0 or None, got 0\.0"),
    ],
)
def test_rejects_bad_configuration_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicScale(**kwargs)


def test_rejects_a_non_integer_growth_interval_naming_it():
    # A TypeError: ours, or jaxtyping's when its runtime type checking is on (both name it).
    with pytest.raises(TypeError, match=r"growth_interval"):
        DynamicScale(growth_interval=2.5)  # pyright: ignore[reportArgumentType]  # a wrong value on purpose


def test_accepts_integers_for_the_numeric_configuration():
    ds = DynamicScale(scale=8, growth_factor=4, backoff_factor=1, minimum_scale=1)
    ds, *_ = ds.value_and_grad(_loss)(PARAMS, jnp.float16(jnp.inf))
    assert float(ds.scale) == 8.0  # backoff_factor 1 keeps the scale
