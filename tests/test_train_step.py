"""jit_step and pmap_step: partition once, donate, same result as an eager loop, one compilation."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_train
from eqx_train import TrainState, jit_step, pmap_step
from tests.support.helpers import assert_trees_equal, tree_allclose

TX = optax.adam(1e-2)


def _state():
    model = eqx.nn.MLP(3, 2, 16, 2, activation=jax.nn.gelu, key=jax.random.key(0))
    return TrainState.create(model=model, tx=TX)


def _train_step(state, x):
    def loss_fn(model):
        return jnp.mean(jax.vmap(model)(x) ** 2)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(state.model)
    return state.apply_gradients(grads=grads), loss


def test_jit_step_matches_eager_apply_gradients():
    xs = [jax.random.normal(jax.random.key(i), (8, 3)) for i in range(5)]
    eager = _state()
    for x in xs:
        eager, _ = _train_step(eager, x)
    arrays, static = eqx.partition(_state(), eqx.is_array)
    step = jit_step(_train_step, static, has_aux=True)
    losses = []
    for x in xs:
        arrays, loss = step(arrays, x)
        losses.append(float(loss))
    state = eqx.combine(arrays, static)
    assert int(state.step) == 5
    assert state.model.activation is jax.nn.gelu
    assert tree_allclose(state, eager, rtol=1e-5, atol=1e-7)
    assert losses[-1] < losses[0]


def test_jit_step_compiles_once():
    traces = []

    def counted(state, x):
        traces.append(1)
        return _train_step(state, x)[0]

    arrays, static = eqx.partition(_state(), eqx.is_array)
    step = jit_step(counted, static)
    for i in range(6):
        arrays = step(arrays, jnp.full((8, 3), float(i)))
    assert len(traces) == 1


def test_jit_step_donates_incoming_arrays():
    arrays, static = eqx.partition(_state(), eqx.is_array)
    step = jit_step(lambda s, x: _train_step(s, x)[0], static)
    old = arrays
    arrays = step(arrays, jnp.ones((8, 3)))
    with pytest.raises(RuntimeError, match="deleted"):
        jnp.sum(old.model.layers[0].weight).block_until_ready()


def test_jit_step_rejects_changing_static_part():
    arrays, static = eqx.partition(_state(), eqx.is_array)

    def swaps_activation(state, x):
        return eqx.tree_at(lambda s: s.model.activation, state, jax.nn.relu)

    with pytest.raises(ValueError, match="changed the non-array part"):
        jit_step(swaps_activation, static, donate=False)(arrays, jnp.ones((8, 3)))


# ---------------------------------------------------------------- pmap_step


def _pmap_train_step(state, x):
    def loss_fn(model):
        return jnp.mean(jax.vmap(model)(x) ** 2)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(state.model)
    return state.apply_gradients(grads=eqx_train.pmean(grads, "batch")), loss


def _batches(steps):
    n = jax.local_device_count()
    return [np.asarray(jax.random.normal(jax.random.key(i), (4 * n, 3))) for i in range(steps)]


def test_pmap_step_matches_an_eager_full_batch_loop_on_every_replica():
    # Equal shards: the mean of the per-device gradients is the full-batch gradient.
    eager = _state()
    for x in _batches(4):
        eager, _ = _train_step(eager, x)
    arrays, static = eqx.partition(_state(), eqx.is_array)
    step = pmap_step(_pmap_train_step, static, has_aux=True)
    arrays = eqx_train.replicate(arrays)
    loss = None
    for x in _batches(4):
        arrays, loss = step(arrays, eqx_train.shard(x))
    assert loss is not None
    assert loss.shape == (jax.local_device_count(),)
    for replica in range(jax.local_device_count()):
        one = jax.tree.map(lambda a, i=replica: np.asarray(a)[i], arrays)
        state = eqx.combine(one, static)
        assert state.model.activation is jax.nn.gelu
        assert tree_allclose(state, eager, rtol=1e-5, atol=1e-7)
    assert int(eqx.combine(eqx_train.unreplicate(arrays), static).step) == 4


def test_pmap_step_stops_tracing_after_the_second_step():
    # jax.pmap (0.10 to 0.12) traces again once when fed its own output's layout, after
    # flax's replicate as after ours; from then on every step reuses the compiled program.
    traces = []

    def counted(state, x):
        traces.append(1)
        return _pmap_train_step(state, x)[0]

    arrays, static = eqx.partition(_state(), eqx.is_array)
    step = pmap_step(counted, static)
    arrays = eqx_train.replicate(arrays)
    counts = []
    for x in _batches(6):
        arrays = step(arrays, eqx_train.shard(x))
        counts.append(len(traces))
    assert counts[0] == 1 and counts[1] <= 2 and counts[1:] == [counts[1]] * 5


def test_pmap_step_donates_incoming_arrays():
    arrays, static = eqx.partition(_state(), eqx.is_array)
    step = pmap_step(lambda s, x: _pmap_train_step(s, x)[0], static)
    old = eqx_train.replicate(arrays)
    step(old, eqx_train.shard(_batches(1)[0]))
    with pytest.raises(RuntimeError, match="deleted"):
        jnp.sum(old.model.layers[0].weight).block_until_ready()


def test_pmap_step_rejects_changing_static_part():
    arrays, static = eqx.partition(_state(), eqx.is_array)

    def swaps_activation(state, x):
        return eqx.tree_at(lambda s: s.model.activation, state, jax.nn.relu)

    step = pmap_step(swaps_activation, static, donate=False)
    with pytest.raises(ValueError, match="pmap_step: the step function changed"):
        step(eqx_train.replicate(arrays), eqx_train.shard(_batches(1)[0]))


def test_whole_train_state_goes_replicate_filter_pmap_unreplicate():
    # The call the docs show for a whole state; same numbers as pmap_step.
    step = eqx.filter_pmap(_pmap_train_step, axis_name="batch")
    replicated = eqx_train.replicate(_state())
    arrays, static = eqx.partition(_state(), eqx.is_array)
    by_pmap_step = pmap_step(_pmap_train_step, static, has_aux=True)
    arrays = eqx_train.replicate(arrays)
    for x in _batches(3):
        replicated, loss = step(replicated, eqx_train.shard(x))
        arrays, loss_too = by_pmap_step(arrays, eqx_train.shard(x))
        assert_trees_equal(loss, loss_too)
    state = eqx_train.unreplicate(replicated)
    assert type(state) is TrainState and int(state.step) == 3
    assert state.model.activation is jax.nn.gelu and state.tx is TX
    assert_trees_equal(state, eqx.combine(eqx_train.unreplicate(arrays), static))


def _count_step(state: TrainState) -> TrainState:
    return state.replace(step=state.step + 1)


def test_jit_step_on_a_state_with_another_tx_names_tx():
    model = eqx.nn.MLP(2, 1, 4, 1, key=jax.random.key(0))
    running = TrainState.create(model=model, tx=optax.adam(1e-3))
    restored = TrainState.create(model=model, tx=optax.adam(1e-3))  # another adam
    static = eqx.partition(running, eqx.is_array)[1]
    step = jit_step(_count_step, static, donate=False)
    with pytest.raises(ValueError, match=r"static field 'tx' differs.*build the optimiser once"):
        step(eqx.partition(restored, eqx.is_array)[0])
