"""Restoring into an abstract target (`eqx.filter_eval_shape`: `ShapeDtypeStruct` leaves, no
memory allocated): typed PRNG keys come back as keys of their implementation, and a
`filter_spec` is judged as it would be on the arrays the placeholders stand for."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_train.checkpoints import PartialRestoreWarning, restore_checkpoint, save_checkpoint


class Model(eqx.Module):
    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    count: jax.Array
    key: jax.Array  # a typed key, e.g. for dropout
    keys: jax.Array  # a batch of typed keys

    def __init__(self, key, impl="threefry2x32"):
        k1, k2 = jax.random.split(key)
        self.linear = eqx.nn.Linear(3, 2, key=k1)
        self.dropout = eqx.nn.Dropout(0.25)
        self.count = jnp.asarray(7, jnp.int32)
        self.key = jax.random.key(5, impl=impl)
        self.keys = jax.random.split(jax.random.key(6, impl=impl), 3)


def _same_keys(a, b):
    assert jax.random.key_impl(a) == jax.random.key_impl(b)
    np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(b))


@pytest.fixture
def saved(tmp_path):
    model = Model(jax.random.key(0))
    save_checkpoint(tmp_path, model, 1)
    return tmp_path, model


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_an_abstract_target_holding_typed_keys_restores_them(tmp_path, impl):
    model = Model(jax.random.key(0), impl)
    save_checkpoint(tmp_path, model, 1)
    abstract = eqx.filter_eval_shape(Model, jax.random.key(1), impl)
    assert isinstance(abstract.key, jax.ShapeDtypeStruct)
    restored = restore_checkpoint(tmp_path, abstract)
    _same_keys(restored.key, model.key)
    _same_keys(restored.keys, model.keys)
    np.testing.assert_array_equal(restored.linear.weight, model.linear.weight)
    assert restored.dropout.p == 0.25


def test_an_abstract_key_of_another_implementation_is_refused_naming_the_leaf(saved):
    directory, _ = saved
    abstract = eqx.filter_eval_shape(Model, jax.random.key(1), "rbg")
    # Named by both implementations, not by their data's shapes (4 words vs 2).
    with pytest.raises(
        ValueError, match=r"'key': file has a threefry2x32 PRNG key, target expects rbg"
    ):
        restore_checkpoint(directory, abstract)


def test_filter_spec_is_array_on_an_abstract_target_restores_every_array(saved):
    directory, model = saved
    abstract = eqx.filter_eval_shape(Model, jax.random.key(1))
    restored = restore_checkpoint(directory, abstract, filter_spec=eqx.is_array)
    placeholders = [x for x in jax.tree.leaves(restored) if isinstance(x, jax.ShapeDtypeStruct)]
    assert placeholders == []
    np.testing.assert_array_equal(restored.linear.weight, model.linear.weight)
    np.testing.assert_array_equal(restored.count, model.count)
    _same_keys(restored.keys, model.keys)


def test_filter_spec_on_an_abstract_target_selects_as_on_the_arrays_it_stands_for(saved):
    directory, model = saved
    abstract = eqx.filter_eval_shape(Model, jax.random.key(1))
    # Left out, as they would be of a concrete target: the target's own values stay, and
    # for an abstract target those are placeholders, which a warning names (never silent).
    with pytest.warns(
        PartialRestoreWarning, match=r"3 leaves .* placeholders: 'count', 'key', 'keys'"
    ):
        restored = restore_checkpoint(directory, abstract, filter_spec=eqx.is_inexact_array)
    np.testing.assert_array_equal(restored.linear.weight, model.linear.weight)
    np.testing.assert_array_equal(restored.linear.bias, model.linear.bias)
    assert restored.count is abstract.count and restored.key is abstract.key
