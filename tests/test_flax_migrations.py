"""Three flax training runs moved to Equinox, each checkpoint read in one call: the restored
model computes flax's eval outputs, and the next training steps give flax's losses.

(a) a Linen CNN with BatchNorm and a `flax.training.train_state.TrainState`, saved by an
    Orbax `CheckpointManager`;
(b) an NNX CNN with Dropout, `nnx.Rngs`, BatchNorm and `nnx.Optimizer`, saved with
    `ocp.StandardCheckpointer` of `nnx.state(...)` and with a `CheckpointManager` of two
    items;
(c) a Linen MLP with an `optax.chain(clip, adamw)` state, saved by the legacy msgpack
    `flax.training.checkpoints.save_checkpoint`.
"""

from __future__ import annotations

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from eqx_train import TrainState
from eqx_train.interop import flax_to_equinox, load_flax_checkpoint, load_orbax_checkpoint

flax = pytest.importorskip("flax")
ocp = pytest.importorskip("orbax.checkpoint")
nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

X = jax.random.normal(jax.random.key(1), (4, 6, 6, 3))  # NHWC, flax's layout
Y = jnp.arange(4) % 4
X_CHW = X.transpose(0, 3, 1, 2)  # Equinox's (C, H, W) per sample


def _xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# ------------------------------------------------------------------ (a) Linen + manager


class LinenCNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        # No bias before BatchNorm: its gradient is rounding noise, which Adam would
        # scale into updates that differ between any two implementations.
        x = nn.Conv(8, (3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x)
        x = nn.Conv(8, (3, 3))(x)
        x = x.reshape((x.shape[0], -1))  # flattens (H, W, C)
        x = nn.relu(nn.Dense(32)(x))
        x = nn.relu(nn.Dense(32)(x))  # a square kernel
        return nn.Dense(4)(x)


class EqxCNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    bn: eqx.nn.BatchNorm
    conv2: eqx.nn.Conv2d
    layers: list

    def __init__(self, key):
        k = jax.random.split(key, 5)
        self.conv1 = eqx.nn.Conv2d(3, 8, 3, padding=1, use_bias=False, key=k[0])
        self.bn = eqx.nn.BatchNorm(8, "batch", momentum=0.9, mode="batch")
        self.conv2 = eqx.nn.Conv2d(8, 8, 3, padding=1, key=k[1])
        self.layers = [
            eqx.nn.Linear(288, 32, key=k[2]),
            eqx.nn.Linear(32, 32, key=k[3]),
            eqx.nn.Linear(32, 4, key=k[4]),
        ]

    def __call__(self, x, state, inference):
        """A batch (N, C, H, W) -> logits, state."""
        x = jax.vmap(self.conv1)(x)
        bn = jax.vmap(
            lambda y, s: self.bn(y, s, inference=inference),
            axis_name="batch",
            in_axes=(0, None),
            out_axes=(0, None),
        )
        x, state = bn(x, state)
        x = jax.vmap(self.conv2)(jax.nn.relu(x))
        x = x.transpose(0, 2, 3, 1).reshape(x.shape[0], -1)  # flax's (H, W, C) order
        x = jax.nn.relu(jax.vmap(self.layers[0])(x))
        x = jax.nn.relu(jax.vmap(self.layers[1])(x))
        return jax.vmap(self.layers[2])(x), state


class CNNState(TrainState):
    bn_state: eqx.nn.State


def _eqx_cnn_state(tx):
    model, bn_state = eqx.nn.make_with_state(EqxCNN)(jax.random.key(0))
    return CNNState.create(model=model, tx=tx, bn_state=bn_state)


@eqx.filter_jit
def _eqx_cnn_step(state):
    def loss(model):
        logits, bn_state = model(X_CHW, state.bn_state, False)
        return _xent(logits, Y), bn_state

    (value, bn_state), grads = eqx.filter_value_and_grad(loss, has_aux=True)(state.model)
    return value, state.apply_gradients(grads=grads, bn_state=bn_state)


def _linen_run(steps):
    from flax.training import train_state

    class LinenState(train_state.TrainState):
        batch_stats: dict

    model = LinenCNN()
    variables = model.init(jax.random.key(0), X, train=False)
    state = LinenState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=optax.adam(1e-2),
        batch_stats=variables["batch_stats"],
    )

    @jax.jit
    def step(state):
        def loss(params):
            logits, updates = model.apply(
                {"params": params, "batch_stats": state.batch_stats},
                X,
                train=True,
                mutable=["batch_stats"],
            )
            return _xent(logits, Y), updates["batch_stats"]

        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
        return value, state.apply_gradients(grads=grads).replace(batch_stats=stats)

    losses = []
    for _ in range(steps):
        value, state = step(state)
        losses.append(float(value))

    def evaluate(state):
        return model.apply(
            {"params": state.params, "batch_stats": state.batch_stats}, X, train=False
        )

    return state, step, evaluate, losses


@pytest.fixture(scope="module")
def linen_run(tmp_path_factory):
    """A Linen run of 3 steps saved by a CheckpointManager, and flax's own continuation."""
    state, step, evaluate, _ = _linen_run(3)
    directory = tmp_path_factory.mktemp("linen") / "run"
    manager = ocp.CheckpointManager(directory)
    manager.save(3, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
    manager.close()
    later, losses = state, []
    for _ in range(3):
        value, later = step(later)
        losses.append(float(value))
    return directory, np.asarray(evaluate(state)), losses, np.asarray(evaluate(later))


def _restore_linen(directory):
    target = _eqx_cnn_state(optax.adam(1e-2))
    return load_orbax_checkpoint(directory, target, casting="same_kind", **flax_to_equinox(target))


def test_linen_manager_checkpoint_gives_flax_eval_outputs(linen_run):
    directory, expected, _, _ = linen_run
    state = _restore_linen(directory)
    logits, _ = state.model(X_CHW, state.bn_state, True)
    assert int(state.step) == 3
    np.testing.assert_allclose(np.asarray(logits), expected, rtol=0, atol=2e-6)


def test_linen_manager_checkpoint_resumes_with_flax_losses(linen_run):
    directory, _, expected_losses, expected_logits = linen_run
    state = _restore_linen(directory)
    losses = []
    for _ in range(3):
        value, state = _eqx_cnn_step(state)
        losses.append(float(value))
    np.testing.assert_allclose(losses, expected_losses, rtol=0, atol=2e-6)
    # After training, inference uses the running statistics: flax's, not debiased again.
    logits, _ = state.model(X_CHW, state.bn_state, True)
    np.testing.assert_allclose(np.asarray(logits), expected_logits, rtol=0, atol=5e-6)


def test_batch_norm_counter_left_at_zero_diverges_after_a_step(linen_run):
    """The specification the preset's counter meets: with Equinox's counter left at 0 the
    restored model is right in inference only until its first training step."""
    directory, _, _, expected_logits = linen_run
    state = _restore_linen(directory)
    counter = state.model.bn.batch_counter
    wrong = state.replace(bn_state=state.bn_state.set(counter, jnp.array(0)))
    for _ in range(3):
        _, wrong = _eqx_cnn_step(wrong)
    logits, _ = wrong.model(X_CHW, wrong.bn_state, True)
    assert np.abs(np.asarray(logits) - expected_logits).max() > 1e-3


# ------------------------------------------------------------------ (c) Linen + msgpack


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(16)(x))
        x = nn.relu(nn.Dense(16)(x))
        return nn.Dense(3)(x)


X_MLP = jax.random.normal(jax.random.key(2), (8, 5))
Y_MLP = jnp.arange(8) % 3
CHAINED = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1))


@pytest.fixture(scope="module")
def msgpack_run(tmp_path_factory):
    """A Linen MLP trained 3 steps with chain(clip, adamw), saved as flax's legacy msgpack
    file, and flax's own continuation."""
    from flax.training import checkpoints, train_state

    model = LinenMLP()
    params = model.init(jax.random.key(0), X_MLP)["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=CHAINED)

    @jax.jit
    def step(state):
        def loss(params):
            return _xent(model.apply({"params": params}, X_MLP), Y_MLP)

        value, grads = jax.value_and_grad(loss)(state.params)
        return value, state.apply_gradients(grads=grads)

    for _ in range(3):
        _, state = step(state)
    directory = tmp_path_factory.mktemp("msgpack")
    before = flax.config.flax_use_orbax_checkpointing
    flax.config.update("flax_use_orbax_checkpointing", False)
    try:
        with warnings.catch_warnings():
            # flax's notice that its own msgpack checkpoints are on the way out.
            warnings.filterwarnings("ignore", "Flax Checkpointing will soon be deprecated")
            checkpoints.save_checkpoint(directory, state, step=3)
    finally:
        flax.config.update("flax_use_orbax_checkpointing", before)
    expected = np.asarray(model.apply({"params": state.params}, X_MLP))
    losses = []
    for _ in range(3):
        value, state = step(state)
        losses.append(float(value))
    return directory, expected, losses


def _restore_msgpack(directory):
    mlp = eqx.nn.MLP(5, 3, 16, 2, activation=jax.nn.relu, key=jax.random.key(0))
    target = TrainState.create(model=mlp, tx=CHAINED)
    return load_flax_checkpoint(directory, target, casting="same_kind", **flax_to_equinox(target))


def test_msgpack_checkpoint_gives_flax_eval_outputs(msgpack_run):
    directory, expected, _ = msgpack_run
    state = _restore_msgpack(directory)
    assert int(state.step) == 3
    np.testing.assert_allclose(np.asarray(jax.vmap(state.model)(X_MLP)), expected, atol=1e-6)


def test_msgpack_checkpoint_resumes_chained_optimiser_with_flax_losses(msgpack_run):
    directory, _, expected_losses = msgpack_run
    state = _restore_msgpack(directory)

    @eqx.filter_jit
    def step(state):
        def loss(model):
            return _xent(jax.vmap(model)(X_MLP), Y_MLP)

        value, grads = eqx.filter_value_and_grad(loss)(state.model)
        return value, state.apply_gradients(grads=grads)

    losses = []
    for _ in range(3):
        value, state = step(state)
        losses.append(float(value))
    np.testing.assert_allclose(losses, expected_losses, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ (b) NNX


class NNXCNN(nnx.Module):
    def __init__(self, rngs):
        self.conv1 = nnx.Conv(3, 8, (3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
        self.conv2 = nnx.Conv(8, 8, (3, 3), rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.linear1 = nnx.Linear(288, 32, rngs=rngs)
        self.linear2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        x = self.conv2(nnx.relu(self.bn(self.conv1(x))))
        x = self.dropout(nnx.relu(self.linear1(x.reshape((x.shape[0], -1)))))
        return self.linear2(x)


class EqxNNXCNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    bn: eqx.nn.BatchNorm
    conv2: eqx.nn.Conv2d
    dropout: eqx.nn.Dropout
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.conv1 = eqx.nn.Conv2d(3, 8, 3, padding=1, use_bias=False, key=k[0])
        self.bn = eqx.nn.BatchNorm(8, "batch", momentum=0.9, mode="batch")
        self.conv2 = eqx.nn.Conv2d(8, 8, 3, padding=1, key=k[1])
        self.dropout = eqx.nn.Dropout(0.5)
        self.linear1 = eqx.nn.Linear(288, 32, key=k[2])
        self.linear2 = eqx.nn.Linear(32, 4, key=k[3])

    def __call__(self, x, state, key):
        """A batch (N, C, H, W) -> logits, state; `key` None: inference."""
        inference = key is None
        bn = jax.vmap(
            lambda y, s: self.bn(y, s, inference=inference),
            axis_name="batch",
            in_axes=(0, None),
            out_axes=(0, None),
        )
        x, state = bn(jax.vmap(self.conv1)(x), state)
        x = jax.vmap(self.conv2)(jax.nn.relu(x))
        x = jax.nn.relu(jax.vmap(self.linear1)(x.transpose(0, 2, 3, 1).reshape(x.shape[0], -1)))
        # On the whole batch with NNX's key, as nnx.Dropout draws its mask.
        x = self.dropout(x, key=key, inference=inference)
        return jax.vmap(self.linear2)(x), state


class NNXTrainState(TrainState):
    bn_state: eqx.nn.State
    rng_key: jax.Array  # a typed key: NNX's Rngs stream for dropout...
    rng_count: jax.Array  # ...and how many keys it has drawn


def _nnx_target():
    model, bn_state = eqx.nn.make_with_state(EqxNNXCNN)(jax.random.key(0))
    return NNXTrainState.create(
        model=model,
        tx=optax.adam(1e-2),
        bn_state=bn_state,
        rng_key=jax.random.key(0),
        rng_count=jnp.array(0, jnp.uint32),
    )


@eqx.filter_jit
def _eqx_nnx_step(state):
    key = jax.random.fold_in(state.rng_key, state.rng_count)  # as an NNX RngStream draws

    def loss(model):
        logits, bn_state = model(X_CHW, state.bn_state, key)
        return _xent(logits, Y), bn_state

    (value, bn_state), grads = eqx.filter_value_and_grad(loss, has_aux=True)(state.model)
    return value, state.apply_gradients(
        grads=grads, bn_state=bn_state, rng_count=state.rng_count + 1
    )


@pytest.fixture(scope="module")
def nnx_run(tmp_path_factory):
    """An NNX run of 3 steps saved both ways, NNX's eval outputs, its continuation's
    losses, and the dropout key NNX's own restore gives."""
    model = NNXCNN(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        def loss(model):
            return _xent(model(X), Y)

        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    for _ in range(3):
        step(model, optimizer)
    root = tmp_path_factory.mktemp("nnx")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(root / "state", nnx.state(model))
    checkpointer.save(root / "optimizer", nnx.state(optimizer))
    checkpointer.wait_until_finished()
    manager = ocp.CheckpointManager(root / "run", item_names=("model", "optimizer"))
    manager.save(
        3,
        args=ocp.args.Composite(
            model=ocp.args.StandardSave(nnx.state(model)),
            optimizer=ocp.args.StandardSave(nnx.state(optimizer)),
        ),
    )
    manager.wait_until_finished()
    manager.close()
    abstract = nnx.eval_shape(lambda: NNXCNN(nnx.Rngs(0, dropout=1)))
    restored = checkpointer.restore(root / "state", nnx.state(abstract))
    nnx_key = jax.random.key_data(restored["dropout"]["rngs"]["key"][...])
    model.eval()
    expected = np.asarray(model(X))
    model.train()
    losses = [float(step(model, optimizer)) for _ in range(3)]
    return root, expected, losses, np.asarray(nnx_key)


NNX_ROOTS = {
    "model": "model",
    "step": "optimizer.step",
    "opt_state": "optimizer.opt_state",
    "rng_key": "model.dropout.rngs.key",
    "rng_count": "model.dropout.rngs.count",
}


def _restore_nnx_two_items(root):
    target = _nnx_target()
    return load_orbax_checkpoint(
        root / "run",
        target,
        item=("model", "optimizer"),
        casting="same_kind",
        **flax_to_equinox(target, naming="nnx", roots=NNX_ROOTS),
    )


def _check_nnx(state, expected, losses, nnx_key):
    assert int(state.step) == 3
    assert np.array_equal(np.asarray(jax.random.key_data(state.rng_key)), nnx_key)
    logits, _ = state.model(X_CHW, state.bn_state, None)
    np.testing.assert_allclose(np.asarray(logits), expected, rtol=0, atol=2e-6)
    ours = []
    for _ in range(3):
        value, state = _eqx_nnx_step(state)
        ours.append(float(value))
    np.testing.assert_allclose(ours, losses, rtol=0, atol=2e-6)


def test_nnx_two_item_manager_checkpoint_matches_nnx(nnx_run):
    root, expected, losses, nnx_key = nnx_run
    _check_nnx(_restore_nnx_two_items(root), expected, losses, nnx_key)


def test_nnx_standard_checkpointer_checkpoints_match_nnx(nnx_run):
    root, expected, losses, nnx_key = nnx_run
    state = _nnx_target()
    # The model's state: the model, its BatchNorm statistics and the dropout stream.
    parts = (state.model, state.bn_state, state.rng_key, state.rng_count)
    roots = {"0": "", "2": "dropout.rngs.key", "3": "dropout.rngs.count"}
    model, bn_state, key, count = load_orbax_checkpoint(
        root / "state",
        parts,
        casting="same_kind",
        **flax_to_equinox(parts, naming="nnx", roots=roots),
    )
    # The optimizer's state: its step and the optax state.
    parts = (state.step, state.opt_state)
    step, opt_state = load_orbax_checkpoint(
        root / "optimizer",
        parts,
        casting="same_kind",
        **flax_to_equinox(parts, naming="nnx", roots={"0": "step", "1": "opt_state"}),
    )
    state = state.replace(
        step=step,
        model=model,
        opt_state=opt_state,
        bn_state=bn_state,
        rng_key=key,
        rng_count=count,
    )
    _check_nnx(state, expected, losses, nnx_key)
