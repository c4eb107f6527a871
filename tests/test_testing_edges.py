"""eqx_train.testing at the edges: assert_trees_equal's tolerance keeps its promises at the
edges (infinities equal only themselves, integers compared exactly, object arrays and
Python complex numbers compared without crashing)."""

from __future__ import annotations

import numpy as np
import pytest

from eqx_train.testing import assert_trees_equal


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (np.array([np.inf]), np.array([-np.inf])),
        (np.array([1e308]), np.array([np.inf])),
        (np.array([np.inf]), np.array([1.0])),
        (np.array([np.inf + 0j]), np.array([-np.inf + 0j])),
    ],
)
def test_with_a_tolerance_an_infinity_equals_only_itself(a, b):
    with pytest.raises(AssertionError, match=r"values \(rtol=0\.1, atol=0\) differ in 1 of 1"):
        assert_trees_equal(a, b, rtol=0.1)


@pytest.mark.parametrize(("a", "b"), [(float("inf"), float("-inf")), (1e308, float("inf"))])
def test_with_a_tolerance_a_python_infinity_equals_only_itself(a, b):
    with pytest.raises(AssertionError, match="value differs"):
        assert_trees_equal({"x": a}, {"x": b}, rtol=0.1)
    assert_trees_equal({"x": b}, {"x": b}, rtol=0.1)


def test_with_a_tolerance_large_integers_are_compared_exactly():
    a, b = np.array([2**62], np.int64), np.array([2**62 + 1], np.int64)
    with pytest.raises(AssertionError, match=r"differ in 1 of 1 elements"):
        assert_trees_equal(a, b, rtol=1e-30)
    assert_trees_equal(a, b, atol=1)
    big = np.array([2**64 - 1], np.uint64)
    with pytest.raises(AssertionError, match=r"differ in 1 of 1 elements"):
        assert_trees_equal(big, big - np.uint64(1), rtol=1e-30)


def test_object_arrays_are_compared_element_by_element_with_equality():
    assert_trees_equal(np.array(["a", 1], dtype=object), np.array(["a", 1], dtype=object))
    with pytest.raises(AssertionError, match=r"\['w'\]: .*differ in 1 of 2 elements"):
        assert_trees_equal(
            {"w": np.array(["a", 1], dtype=object)}, {"w": np.array(["a", 2], dtype=object)}
        )


def test_python_complex_numbers_compare_bit_for_bit_nan_included():
    nan = complex(float("nan"), 1.0)
    assert_trees_equal({"z": nan}, {"z": complex(float("nan"), 1.0)})
    with pytest.raises(AssertionError, match="value differs"):
        assert_trees_equal({"z": complex(-0.0, 0.0)}, {"z": complex(0.0, 0.0)})


def test_modules_keep_the_weak_type_of_batchnorms_counter_as_make_with_state_does():
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from hypothesis import HealthCheck, Phase, find, settings

    from eqx_train.testing import strategies as ets

    _, real = eqx.nn.make_with_state(eqx.nn.BatchNorm)(2, "batch", mode="batch")
    assert [x.weak_type for x in jax.tree.leaves(real) if x.dtype == jnp.int32] == [True]
    bounded = settings(
        max_examples=300,
        database=None,
        derandomize=True,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),  # pyright: ignore[reportArgumentType]  # hypothesis's enum metaclass hides its members
    )
    _, state = find(
        ets.modules(),
        lambda pair: any(x.dtype == jnp.int32 for x in jax.tree.leaves(pair[1])),
        settings=bounded,
    )
    assert [x.weak_type for x in jax.tree.leaves(state) if x.dtype == jnp.int32] == [True]


def test_checkpoint_roundtrip_fails_when_target_none_loses_the_weak_type(monkeypatch):
    # Planted: a target=None restore that gives back a weakly typed array as NumPy (as
    # before the file recorded weak types); the restore into the tree stays correct.
    import jax
    import jax.numpy as jnp

    from eqx_train import checkpoints
    from eqx_train.testing import assert_checkpoint_roundtrip

    restore = checkpoints.restore_checkpoint

    def strong_when_untargeted(path, target, **options):
        restored = restore(path, target, **options)
        if target is not None:
            return restored
        return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, restored)

    tree = {"lr": jnp.asarray(0.1), "w": jnp.ones(2)}
    assert_checkpoint_roundtrip(tree)
    monkeypatch.setattr(checkpoints, "restore_checkpoint", strong_when_untargeted)
    with pytest.raises(AssertionError, match=r"target=None: leaf 'lr' .*weak type"):
        assert_checkpoint_roundtrip(tree)


def test_a_difference_in_an_eqx_nn_state_is_named_by_the_layers_marker():
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    class Two(eqx.Module):
        a: eqx.nn.BatchNorm
        b: eqx.nn.BatchNorm

        def __init__(self):
            self.a = eqx.nn.BatchNorm(2, "batch", mode="batch")
            self.b = eqx.nn.BatchNorm(2, "batch", mode="batch")

    model, state = eqx.nn.make_with_state(Two)()
    clone = jax.tree.unflatten(jax.tree.structure(state), jax.tree.leaves(state))
    changed = clone.set(model.b.batch_state_index, (jnp.full(2, 5.0, jnp.float32), jnp.ones(2)))
    with pytest.raises(AssertionError) as raised:
        assert_trees_equal({"bn_state": state}, {"bn_state": changed})
    assert "differ at ['bn_state']['Two.b.batch_state_index'][0]: bits" in str(raised.value)


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16", np.dtype(np.int8)])
def test_arrays_accept_a_single_dtype_as_hypothesis_does(dtype):
    from hypothesis import HealthCheck, Phase, find, settings

    from eqx_train.testing import strategies as ets

    bounded = settings(
        max_examples=20,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),  # pyright: ignore[reportArgumentType]  # hypothesis's enum metaclass hides its members
    )
    drawn = find(ets.arrays(dtypes=dtype), lambda a: True, settings=bounded)
    assert drawn.dtype == np.dtype(dtype)


def test_keys_accept_a_single_implementation_name():
    import jax
    from hypothesis import HealthCheck, Phase, find, settings

    from eqx_train.testing import strategies as ets

    bounded = settings(
        max_examples=20,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),  # pyright: ignore[reportArgumentType]  # hypothesis's enum metaclass hides its members
    )
    key = find(ets.keys(impls="rbg"), lambda k: True, settings=bounded)
    assert str(jax.random.key_impl(key)) == "rbg"


def test_a_differing_static_field_is_named_not_dumped_as_a_treedef():
    import equinox as eqx
    import jax
    import optax

    from eqx_train import TrainState

    model = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))
    a = TrainState.create(model=model, tx=optax.adam(1e-3))
    b = TrainState.create(model=model, tx=optax.adam(1e-3))  # another tx object
    with pytest.raises(AssertionError) as raised:
        assert_trees_equal({"state": a}, {"state": b})
    message = str(raised.value)
    assert "['state']: node metadata (static fields) differs: static field 'tx'" in message
    assert "another GradientTransformationExtraArgs object" in message
    assert "PyTreeDef" not in message
