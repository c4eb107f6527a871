"""TrainState: flax's numbers, Equinox models, one compilation, subclassing."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state as flax_train_state

from eqx_train import TrainState
from tests.helpers import assert_trees_equal, tree_allclose


def _params(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "dense": {"kernel": jax.random.normal(k1, (3, 4)), "bias": jnp.zeros(4)},
        "out": {"kernel": jax.random.normal(k2, (4, 2)), "bias": jax.random.normal(k3, (2,))},
    }


def _loss(params, x):
    h = jnp.tanh(x @ params["dense"]["kernel"] + params["dense"]["bias"])
    return jnp.sum((h @ params["out"]["kernel"] + params["out"]["bias"]) ** 2)


def _chain():
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optax.cosine_decay_schedule(1e-2, 12), weight_decay=1e-3),
    )


def test_create_starts_at_step_zero_as_int32_scalar():
    state = TrainState.create(model=_params(jax.random.key(0)), tx=optax.sgd(0.1))
    assert state.step.dtype == jnp.int32 and state.step.shape == ()
    assert int(state.step) == 0


def test_params_is_the_model():
    params = _params(jax.random.key(0))
    state = TrainState.create(model=params, tx=optax.sgd(0.1))
    assert state.params is state.model is params


def test_twelve_steps_match_flax_train_state():
    tx = _chain()
    params = _params(jax.random.key(1))
    ours = TrainState.create(model=params, tx=tx)
    theirs = flax_train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    for i in range(12):
        x = jax.random.normal(jax.random.key(100 + i), (5, 3))
        ours = ours.apply_gradients(grads=jax.grad(_loss)(ours.params, x))
        theirs = theirs.apply_gradients(grads=jax.grad(_loss)(theirs.params, x))
    assert int(ours.step) == theirs.step == 12
    assert tree_allclose(ours.params, theirs.params, rtol=1e-6)
    assert tree_allclose(ours.opt_state, theirs.opt_state, rtol=1e-6)


def test_equinox_model_with_function_leaves_trains_with_filter_grad():
    model = eqx.nn.MLP(3, 2, 8, 2, activation=jax.nn.gelu, key=jax.random.key(0))
    state = TrainState.create(model=model, tx=optax.sgd(0.1))
    x = jnp.ones((4, 3))

    def loss(m):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    before = loss(state.model)
    for _ in range(3):
        state = state.apply_gradients(grads=eqx.filter_grad(loss)(state.model))
    assert loss(state.model) < before
    assert state.model.activation is jax.nn.gelu


def test_matches_manual_optax_loop_on_equinox_model():
    model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
    tx = optax.adam(1e-2)
    x = jnp.ones((4, 3))

    def loss(m):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    state = TrainState.create(model=model, tx=tx)
    ref_model, ref_opt = model, tx.init(eqx.filter(model, eqx.is_inexact_array))
    for _ in range(4):
        state = state.apply_gradients(grads=eqx.filter_grad(loss)(state.model))
        grads = eqx.filter_grad(loss)(ref_model)
        updates, ref_opt = tx.update(grads, ref_opt, eqx.filter(ref_model, eqx.is_inexact_array))
        ref_model = eqx.apply_updates(ref_model, updates)
    assert tree_allclose(eqx.filter(state.model, eqx.is_array), eqx.filter(ref_model, eqx.is_array))


def test_trainable_filter_freezes_other_leaves():
    params = _params(jax.random.key(0))

    frozen_ids = {id(leaf) for leaf in jax.tree.leaves(params["dense"])}

    def trainable(leaf):
        return eqx.is_inexact_array(leaf) and id(leaf) not in frozen_ids

    state = TrainState.create(model=params, tx=optax.sgd(1.0), trainable=trainable)
    grads = jax.grad(_loss)(params, jnp.ones((2, 3)))
    new = state.apply_gradients(grads=grads)
    assert_trees_equal(new.model["dense"], params["dense"])
    assert not np.allclose(new.model["out"]["kernel"], params["out"]["kernel"])


def test_filter_jit_step_compiles_once_over_many_steps():
    model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
    state = TrainState.create(model=model, tx=optax.adam(1e-3))
    traces = []

    @eqx.filter_jit
    def train_step(state, x):
        traces.append(1)
        grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(state.model)
        return state.apply_gradients(grads=grads)

    for i in range(10):
        state = train_step(state, jnp.full((4, 3), float(i)))
    assert int(state.step) == 10
    assert len(traces) == 1


def test_subclass_with_extra_fields():
    class EMATrainState(TrainState):
        ema_model: dict
        decay: float = eqx.field(static=True)

    params = _params(jax.random.key(0))
    state = EMATrainState.create(model=params, tx=optax.sgd(0.5), ema_model=params, decay=0.9)
    grads = jax.grad(_loss)(params, jnp.ones((2, 3)))
    stepped = state.apply_gradients(grads=grads)
    new_ema = jax.tree.map(
        lambda e, p: state.decay * e + (1 - state.decay) * p, stepped.ema_model, stepped.model
    )
    stepped = stepped.apply_gradients(grads=grads, ema_model=new_ema)
    assert type(stepped) is EMATrainState
    assert int(stepped.step) == 2
    assert_trees_equal(stepped.ema_model, new_ema)
    assert stepped.decay == 0.9


def test_apply_gradients_rejects_unknown_field():
    state = TrainState.create(model=_params(jax.random.key(0)), tx=optax.sgd(0.1))
    grads = jax.grad(_loss)(state.params, jnp.ones((2, 3)))
    with pytest.raises(TypeError, match=r"no field\(s\) \['batch_stats'\]"):
        state.apply_gradients(grads=grads, batch_stats={})


def test_apply_gradients_names_missing_gradient_leaves():
    state = TrainState.create(model=_params(jax.random.key(0)), tx=optax.sgd(0.1))
    grads = jax.grad(_loss)(state.params, jnp.ones((2, 3)))
    del grads["out"]["bias"]
    with pytest.raises(ValueError, match=r"out\.bias"):
        state.apply_gradients(grads=grads)


def test_create_rejects_non_optax_tx(without_type_checks):
    with pytest.raises(TypeError, match="optax.GradientTransformation"):
        TrainState.create(model=_params(jax.random.key(0)), tx="adam")  # type: ignore[arg-type]


def test_works_inside_lax_scan():
    params = _params(jax.random.key(0))
    state = TrainState.create(model=params, tx=optax.sgd(0.01))
    xs = jax.random.normal(jax.random.key(3), (6, 2, 3))

    def body(state, x):
        return state.apply_gradients(grads=jax.grad(_loss)(state.params, x)), None

    scanned, _ = jax.lax.scan(body, state, xs)
    looped = state
    for x in xs:
        looped, _ = body(looped, x)
    assert int(scanned.step) == 6
    assert tree_allclose(scanned.params, looped.params, rtol=1e-5)
