"""TrainState: flax's numbers, Equinox models, one compilation, subclassing."""

from collections.abc import Callable
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state as flax_train_state

from eqx_train import TrainState
from tests.support.helpers import assert_trees_equal, tree_allclose


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


# ---------------------------------------------------------------- for the flax hand


def test_replace_returns_a_new_state_and_leaves_the_old_one():
    state = TrainState.create(model=_params(jax.random.key(0)), tx=optax.sgd(0.1))
    new_model = jax.tree.map(jnp.zeros_like, state.model)
    replaced = state.replace(step=jnp.asarray(7, jnp.int32), model=new_model)
    assert type(replaced) is TrainState
    assert int(replaced.step) == 7 and int(state.step) == 0
    assert replaced.model is new_model and state.model is not new_model
    assert replaced.opt_state is state.opt_state and replaced.tx is state.tx


def test_replace_keeps_the_subclass_and_its_fields():
    class WithStats(TrainState):
        batch_stats: dict

    state = WithStats.create(model=_params(jax.random.key(0)), tx=optax.sgd(0.1), batch_stats={})
    replaced = state.replace(batch_stats={"mean": jnp.ones(2)})
    assert type(replaced) is WithStats
    assert_trees_equal(replaced.batch_stats, {"mean": jnp.ones(2)})
    assert state.batch_stats == {}


def test_replace_works_inside_jit():
    state = TrainState.create(model=_params(jax.random.key(0)), tx=optax.sgd(0.1))
    bumped = eqx.filter_jit(lambda s: s.replace(step=s.step + 5))(state)
    assert int(bumped.step) == 5


def test_replace_rejects_an_unknown_field_listing_the_fields():
    state = TrainState.create(model=_params(jax.random.key(0)), tx=optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"no field\(s\) \['batch_stats'\].*'opt_state'"):
        state.replace(batch_stats={})


def test_replace_of_flax_params_says_to_replace_model():
    state = TrainState.create(model=_params(jax.random.key(0)), tx=optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"replace\(model=\.\.\.\)"):
        state.replace(params=state.model)


def test_replace_checks_a_new_tx(without_type_checks):
    state = TrainState.create(model=_params(jax.random.key(0)), tx=optax.sgd(0.1))
    with pytest.raises(TypeError, match="optax.GradientTransformation"):
        state.replace(tx="adam")


def test_create_with_flax_keywords_explains_the_mapping():
    params = _params(jax.random.key(0))
    with pytest.raises(TypeError, match=r"flax's keyword\(s\) \['apply_fn', 'params'\].*model="):
        TrainState.create(apply_fn=lambda p, x: x, params=params, tx=optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"\['params'\].*`model=` takes what flax calls `params`"):
        TrainState.create(params=params, tx=optax.sgd(0.1))


def test_create_without_model_names_the_missing_keyword():
    with pytest.raises(TypeError, match=r"missing the keyword argument `model`"):
        TrainState.create(tx=optax.sgd(0.1))


def test_a_subclass_may_have_an_apply_fn_field():
    class FlaxLike(TrainState):
        apply_fn: Callable = eqx.field(static=True)

    state = FlaxLike.create(model=_params(jax.random.key(0)), tx=optax.sgd(0.1), apply_fn=_loss)
    assert state.apply_fn is _loss


def _mlp():
    return eqx.nn.MLP(2, 2, 4, 2, key=jax.random.key(0))


def _ones_grads(model):
    return jax.tree.map(jnp.ones_like, eqx.filter(model, eqx.is_array))


def test_a_filter_spec_built_with_tree_at_freezes_exactly_its_false_leaves():
    model = _mlp()
    spec = eqx.tree_at(lambda m: m.layers[0], jax.tree.map(lambda _: True, model), False)
    state = TrainState.create(model=model, tx=optax.sgd(0.1), trainable=spec)
    new = state.apply_gradients(grads=_ones_grads(model))
    assert_trees_equal(new.model.layers[0], model.layers[0])
    assert not np.allclose(new.model.layers[1].weight, model.layers[1].weight)


def test_frozen_leaves_get_no_optimiser_state():
    model = _mlp()
    spec = eqx.tree_at(lambda m: m.layers[0], jax.tree.map(lambda _: True, model), False)
    state = TrainState.create(model=model, tx=optax.adam(0.1), trainable=spec)
    adam = cast(Any, state.opt_state)[0]  # Adam's state, a namedtuple
    assert adam.mu.layers[0].weight is None and adam.nu.layers[0].bias is None
    assert adam.mu.layers[1].weight.shape == model.layers[1].weight.shape
    new = state.apply_gradients(grads=_ones_grads(model))
    assert cast(Any, new.opt_state)[0].mu.layers[0].weight is None


def test_a_filter_spec_prefix_may_hold_filter_functions():
    params = _params(jax.random.key(0))
    spec = {"dense": False, "out": lambda leaf: leaf.ndim == 2}  # train out's kernel only
    state = TrainState.create(model=params, tx=optax.sgd(1.0), trainable=spec)
    new = state.apply_gradients(grads=jax.grad(_loss)(params, jnp.ones((2, 3))))
    assert_trees_equal(new.model["dense"], params["dense"])
    assert_trees_equal(new.model["out"]["bias"], params["out"]["bias"])
    assert not np.allclose(new.model["out"]["kernel"], params["out"]["kernel"])


def test_a_filter_spec_that_is_not_a_prefix_of_the_model_is_refused():
    with pytest.raises(ValueError, match="filter_spec `trainable` is not a prefix of `model`"):
        TrainState.create(model=_params(jax.random.key(0)), tx=optax.sgd(1.0), trainable=[True])


def test_apply_gradients_with_an_opt_state_for_another_model_names_opt_state():
    model = _mlp()
    state = TrainState.create(model=model, tx=optax.adam(1e-3))
    wider = eqx.tree_at(lambda m: m.layers[0], model, eqx.nn.Sequential([model.layers[0]]))
    with pytest.raises(ValueError, match=r"`opt_state` is not what `tx` makes .*eqx.tree_at"):
        state.replace(model=wider).apply_gradients(grads=_ones_grads(wider))
