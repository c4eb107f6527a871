"""to_state_dict / from_state_dict with NumPy and JAX values (PyTorch: test_interop_torch.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_train.checkpoints import save_checkpoint
from eqx_train.checkpoints.format._reader import FileReader
from eqx_train.interop import LoadReport, from_state_dict, to_state_dict
from tests.support.helpers import assert_trees_equal


class Net(eqx.Module):
    conv: eqx.nn.Conv2d
    norm: eqx.nn.LayerNorm
    embed: eqx.nn.Embedding
    layers: list[eqx.nn.Linear]
    scale: np.ndarray
    rate: float = 0.1
    name: str = eqx.field(static=True, default="net")

    def __init__(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.conv = eqx.nn.Conv2d(2, 3, 3, key=k1)
        self.norm = eqx.nn.LayerNorm(4)
        self.embed = eqx.nn.Embedding(5, 4, key=k2)
        self.layers = [eqx.nn.Linear(4, 4, key=k3), eqx.nn.Linear(4, 2, use_bias=False, key=k4)]
        self.scale = np.array([2.0], np.float32)


NET_NAMES = {
    "conv.weight": (3, 2, 3, 3),
    "conv.bias": (3,),
    "norm.weight": (4,),
    "norm.bias": (4,),
    "embed.weight": (5, 4),
    "layers.0.weight": (4, 4),
    "layers.0.bias": (4,),
    "layers.1.weight": (2, 4),
    "scale": (1,),
}


def test_to_state_dict_names_every_weight_as_pytorch_does():
    state = to_state_dict(Net(jax.random.key(0)))
    assert {name: value.shape for name, value in state.items()} == NET_NAMES
    assert all(type(value) is np.ndarray for value in state.values())


def test_names_are_those_of_checkpoint_files(tmp_path):
    tree = {"params": {"dense": [jnp.ones(2), np.zeros((1, 2))]}, "step": np.int32(3)}
    path = save_checkpoint(tmp_path, tree, step=0)
    with FileReader(str(path)) as reader:
        assert set(to_state_dict(tree)) == set(reader.tensors)


def test_to_state_dict_leaves_out_what_is_not_a_weight():
    tree = {
        "w": jnp.ones(2),
        "none": None,
        "rate": 0.5,
        "count": 3,
        "fn": jax.nn.relu,
        "key": jax.random.key(0),
        "np_scalar": np.float16(1.5),
    }
    state = to_state_dict(tree)
    assert set(state) == {"w", "np_scalar"}
    assert state["np_scalar"].shape == () and state["np_scalar"].dtype == np.float16


def test_to_state_dict_exports_conv_bias_in_pytorch_shape_and_copies():
    conv = eqx.nn.Conv1d(2, 3, 1, key=jax.random.key(0))
    weights = np.ones(4, np.float32)
    state = to_state_dict({"conv": conv, "w": weights})
    assert state["conv.bias"].shape == (3,)
    assert conv.bias is not None
    np.testing.assert_array_equal(state["conv.bias"], conv.bias.reshape(-1))
    state["w"][0] = 5.0
    assert weights[0] == 1.0


def test_round_trip_restores_bit_for_bit_keeping_leaf_types():
    saved = Net(jax.random.key(0))
    loaded = from_state_dict(Net(jax.random.key(1)), to_state_dict(saved))
    assert_trees_equal(loaded, saved)
    assert loaded.conv.bias is not None
    assert isinstance(loaded.conv.weight, jax.Array) and loaded.conv.bias.shape == (3, 1, 1)
    assert type(loaded.scale) is np.ndarray


def test_abstract_target_from_filter_eval_shape_becomes_arrays():
    saved = Net(jax.random.key(0))
    abstract = eqx.filter_eval_shape(Net, jax.random.key(1))
    loaded = from_state_dict(abstract, to_state_dict(saved))
    assert isinstance(loaded.layers[0].weight, jax.Array)
    np.testing.assert_array_equal(loaded.layers[0].weight, saved.layers[0].weight)


def test_loaded_leaves_never_share_memory_with_the_state_dict():
    state = {"w": np.ones(3, np.float32)}
    loaded = from_state_dict({"w": np.zeros(3, np.float32)}, state)
    state["w"][:] = 7.0
    np.testing.assert_array_equal(loaded["w"], np.ones(3))


def test_key_map_renames_with_a_dict_or_a_function():
    target = {"encoder": {"weight": jnp.zeros(2)}, "head": jnp.zeros(1)}
    state = {"enc.weight": np.ones(2, np.float32), "head": np.ones(1, np.float32)}
    by_dict = from_state_dict(target, state, key_map={"enc.weight": "encoder.weight"})
    by_function = from_state_dict(target, state, key_map=lambda k: k.replace("enc.", "encoder."))
    for loaded in (by_dict, by_function):
        assert_trees_equal(loaded, {"encoder": {"weight": jnp.ones(2)}, "head": jnp.ones(1)})


def test_key_map_to_none_drops_an_entry():
    state = {"w": np.ones(2, np.float32), "num_batches_tracked": np.int64(0)}
    drop = lambda k: None if k.endswith("num_batches_tracked") else k
    loaded = from_state_dict({"w": jnp.zeros(2)}, state, key_map=drop)
    assert_trees_equal(loaded, {"w": jnp.ones(2)})


def test_key_map_sending_two_entries_to_one_name_is_refused():
    state = {"a": np.ones(2), "b": np.ones(2)}
    with pytest.raises(ValueError, match="maps both 'a' and 'b' to 'w'"):
        from_state_dict({"w": np.zeros(2)}, state, key_map=lambda k: "w")


BAD_TARGET = {"a": jnp.zeros(2), "b": jnp.zeros((2, 3)), "c": jnp.zeros(2), "d": jnp.zeros(1)}
BAD_STATE = {
    "b": np.ones((3, 2), np.float32),  # transposed: a shape mismatch
    "c": np.ones(2, np.float64),  # a dtype mismatch: never cast silently
    "d": np.ones(1, np.float32),
    "x": np.ones(1, np.float32),
    "y.z": np.ones(1, np.float32),
}


def test_strict_raises_one_error_listing_every_bad_key():
    with pytest.raises(ValueError) as error:
        from_state_dict(BAD_TARGET, BAD_STATE)
    message = str(error.value)
    assert "Missing (in the target, not in the state dict): a\n" in message
    assert "Unexpected (in the state dict, not in the target): x, y.z\n" in message
    assert "'b': the state dict has float32[3, 2], the target float32[2, 3]" in message
    assert "'c': the state dict has float64[2], the target float32[2]" in message


def test_non_strict_loads_what_fits_and_reports_the_rest():
    loaded, report = from_state_dict(BAD_TARGET, BAD_STATE, strict=False)
    assert report == LoadReport(missing=("a",), unexpected=("x", "y.z"), mismatched=("b", "c"))
    assert_trees_equal(loaded, {**BAD_TARGET, "d": jnp.ones(1)})


def test_non_strict_report_is_empty_when_everything_loads():
    _, report = from_state_dict({"w": np.zeros(2)}, {"w": np.ones(2)}, strict=False)
    assert report == LoadReport((), (), ())


def test_unexpected_entries_are_named_as_given_before_renaming():
    _, report = from_state_dict(
        {"w": np.zeros(2)},
        {"w": np.ones(2), "old": np.ones(1)},
        key_map={"old": "new"},
        strict=False,
    )
    assert report.unexpected == ("old",)


def test_shapes_may_differ_only_in_size_one_axes():
    target = {"bias": jnp.zeros((3, 1, 1)), "w": jnp.zeros((2, 3))}
    loaded = from_state_dict(
        target, {"bias": np.arange(3.0, dtype=np.float32), "w": np.ones((2, 3), np.float32)}
    )
    assert loaded["bias"].shape == (3, 1, 1)
    _, report = from_state_dict(
        target, {"bias": np.ones(3, np.float32), "w": np.ones(6, np.float32)}, strict=False
    )
    assert report.mismatched == ("w",)


def test_prng_keys_and_python_scalars_keep_the_target_values():
    target = {"key": jax.random.key(3), "rate": 0.5, "w": jnp.zeros(1)}
    loaded = from_state_dict(target, {"w": np.ones(1, np.float32)})
    assert loaded["rate"] == 0.5
    assert_trees_equal(jax.random.key_data(loaded["key"]), jax.random.key_data(target["key"]))


def test_a_value_of_another_type_is_refused_naming_its_key(without_type_checks):
    with pytest.raises(TypeError, match="state dict entry 'w' is a list"):
        from_state_dict({"w": np.zeros(2)}, {"w": [1.0, 2.0]})
    with pytest.raises(TypeError, match="keys must be str"):
        from_state_dict({"w": np.zeros(2)}, {0: np.zeros(2)})  # pyright: ignore[reportArgumentType]  # a wrong value on purpose


def test_colliding_names_in_the_tree_are_refused():
    with pytest.raises(ValueError, match="two leaves of the tree have the name 'a.b'"):
        to_state_dict({"a.b": np.zeros(1), "a": {"b": np.zeros(1)}})


def test_loading_numpy_weights_never_imports_torch():
    script = textwrap.dedent(
        """
        import sys
        import numpy as np
        from eqx_train.interop import from_state_dict, to_state_dict
        tree = from_state_dict({"w": np.zeros(2)}, to_state_dict({"w": np.ones(2)}))
        print("torch" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
