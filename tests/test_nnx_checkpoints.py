"""NNX checkpoints as the Orbax reader sees them: `nnx.state(...)` saved with
`ocp.StandardCheckpointer` is read without its `.value` wrappers (by
`load_orbax_checkpoint`, `plan_restore` and `convert-orbax`), an `nnx.Optimizer`'s state
fills an optax state, `Rngs` key data fills a typed key, NNX's uint32 step casts to a
`TrainState`'s int32 under the casting rules, and a two-item `CheckpointManager` step is
read in one call."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from eqx_train import TrainState
from eqx_train._cli import main
from eqx_train.checkpoints import PartialRestoreWarning, plan_restore, restore_checkpoint
from eqx_train.interop import flax_to_equinox, load_orbax_checkpoint

ocp = pytest.importorskip("orbax.checkpoint")
nnx = pytest.importorskip("flax.nnx")


class Tiny(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 2, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.linear(x))


class EqxTiny(eqx.Module):
    linear: eqx.nn.Linear


class TinyState(TrainState):
    key: jax.Array
    count: jax.Array


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A trained NNX model and optimizer: saved by StandardCheckpointer each, and as a
    two-item CheckpointManager step; and the states themselves."""
    model = Tiny(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
    x = jnp.ones((4, 3))
    for _ in range(2):
        grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
        optimizer.update(model, grads)
    root = tmp_path_factory.mktemp("nnx")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(root / "state", nnx.state(model))
    checkpointer.save(root / "optimizer", nnx.state(optimizer))
    checkpointer.wait_until_finished()
    manager = ocp.CheckpointManager(root / "run", item_names=("model", "optimizer"))
    manager.save(
        2,
        args=ocp.args.Composite(
            model=ocp.args.StandardSave(nnx.state(model)),
            optimizer=ocp.args.StandardSave(nnx.state(optimizer)),
        ),
    )
    manager.wait_until_finished()
    manager.close()
    return root, model, optimizer


def _target():
    model = EqxTiny(eqx.nn.Linear(3, 2, key=jax.random.key(5)))
    return TinyState.create(
        model=model,
        tx=optax.adam(0.1),
        key=jax.random.key(9),
        count=jnp.array(0, jnp.uint32),
    )


ROOTS = {
    "model": "model",
    "step": "optimizer.step",
    "opt_state": "optimizer.opt_state",
    "key": "model.dropout.rngs.key",
    "count": "model.dropout.rngs.count",
}


def test_nnx_state_is_read_without_value_wrappers(saved):
    root, model, _ = saved
    tree = load_orbax_checkpoint(root / "state")
    assert set(tree) == {"linear", "dropout"}
    np.testing.assert_array_equal(tree["linear"]["kernel"], model.linear.kernel[...])
    assert tree["dropout"]["rngs"]["count"] == model.dropout.rngs.count[...]


def test_plan_restore_names_nnx_tensors_without_value(saved):
    root, _, _ = saved
    plan = plan_restore(root / "state", None)
    assert "linear.kernel" in plan.taken and not any(n.endswith(".value") for n in plan.taken)


def test_convert_orbax_writes_nnx_tensors_without_value(saved, tmp_path):
    root, model, _ = saved
    # NNX's guide saves to state/: no step in its name, so the command is told one.
    assert main(["convert-orbax", str(root / "state"), str(tmp_path / "eqx"), "--step", "5"]) == 0
    converted = restore_checkpoint(tmp_path / "eqx", None, step=5)
    np.testing.assert_array_equal(converted["linear"]["kernel"], model.linear.kernel[...])


def test_two_items_of_a_step_are_read_as_one_tree(saved):
    root, _, optimizer = saved
    tree = load_orbax_checkpoint(root / "run", item=("model", "optimizer"))
    assert set(tree) == {"model", "optimizer"}
    assert tree["optimizer"]["step"] == optimizer.step[...]


def test_unknown_item_among_several_is_refused_listing_the_items(saved):
    root, _, _ = saved
    with pytest.raises(ValueError, match="no item 'ema'.*model, optimizer"):
        load_orbax_checkpoint(root / "run", item=("model", "ema"))


def test_nnx_uint32_step_casts_to_int32_only_under_same_kind(saved):
    root, _, _ = saved
    target = _target()
    layout = flax_to_equinox(target, naming="nnx", roots=ROOTS)
    plan = plan_restore(root / "run" / "2" / "optimizer", target, **layout)
    assert not plan.ok  # the other item's tensors are not there; the step is refused too
    with pytest.raises(ValueError, match=r"'step'.*uint32.*casting='same_kind'"):
        load_orbax_checkpoint(root / "run", target, item=("model", "optimizer"), **layout)
    state = load_orbax_checkpoint(
        root / "run", target, item=("model", "optimizer"), casting="same_kind", **layout
    )
    assert state.step.dtype == jnp.int32 and int(state.step) == 2


def test_optimizer_moments_and_rngs_fill_a_train_state(saved):
    root, model, optimizer = saved
    state = load_orbax_checkpoint(
        root / "run",
        _target(),
        item=("model", "optimizer"),
        casting="same_kind",
        **flax_to_equinox(_target(), naming="nnx", roots=ROOTS),
    )
    np.testing.assert_array_equal(state.model.linear.weight, model.linear.kernel[...].T)
    adam = state.opt_state[0]
    nnx_adam = optimizer.opt_state[0]
    assert int(adam.count) == int(nnx_adam.count[...])
    np.testing.assert_array_equal(adam.mu.linear.weight, nnx_adam.mu["linear"]["kernel"][...].T)
    np.testing.assert_array_equal(adam.nu.linear.bias, nnx_adam.nu["linear"]["bias"][...])
    # Rngs: the raw key data as a typed key, equal to NNX's own; the count as it was.
    assert jnp.issubdtype(state.key.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(
        jax.random.key_data(state.key), jax.random.key_data(model.dropout.rngs.key[...])
    )
    assert int(state.count) == int(model.dropout.rngs.count[...])


def test_target_naming_the_value_wrappers_reads_them_as_saved(saved):
    root, model, _ = saved
    target = {"linear": {"kernel": {"value": jnp.zeros((3, 2))}}}
    with pytest.warns(PartialRestoreWarning, match="'linear.bias.value'"):
        loaded = load_orbax_checkpoint(root / "state", target, strict=False)
    np.testing.assert_array_equal(loaded["linear"]["kernel"]["value"], model.linear.kernel[...])
