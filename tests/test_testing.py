"""eqx_train.testing, the toolkit for users' test suites, tested as a user meets it: each
assertion passes on equal trees and correct code and fails, naming the path, on a planted
difference; the strategies reach what they promise within a bounded search and shrink to
the simplest example; the pytest plugin does what its options say and nothing otherwise."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys
import textwrap
import tomllib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, Phase, find, given, settings, strategies as st

from eqx_train import TrainState, checkpoints
from eqx_train.checkpoints.format import _description
from eqx_train.testing import (
    assert_checkpoint_roundtrip,
    assert_resumes_exactly,
    assert_trees_equal,
    strategies as ets,
)

pytest_plugins = ["pytester"]

ROOT = pathlib.Path(__file__).resolve().parent.parent
# hypothesis.find: a bounded search, the same every run.
BOUNDED = settings(
    max_examples=300,
    database=None,
    derandomize=True,
    phases=[Phase.generate, Phase.shrink],
    # hypothesis's enum metaclass hides from pyright that iterating gives its members
    suppress_health_check=list(HealthCheck),  # pyright: ignore[reportArgumentType]
)


class Block(eqx.Module):
    weight: jax.Array
    scale: float
    name: str = eqx.field(static=True)


def _every_kind():
    """A tree holding every leaf kind assert_trees_equal distinguishes, and Equinox objects."""
    bn, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", mode="batch")
    return {
        "jax": jnp.arange(3.0),
        "bf16": jnp.asarray([1.5, -0.0, jnp.nan], jnp.bfloat16),
        "numpy": np.array([[1, 2]], np.int8),
        "numpy_scalar": np.float32(np.nan),
        "python": [1, 2.5, True, -0.0],
        "key": jax.random.key(3),
        "none": None,
        "text": "config",
        "function": jax.nn.relu,
        "block": Block(jnp.ones(2), 0.5, "dense"),
        "bn": (bn, state),
    }


# ------------------------------------------------------------------- assert_trees_equal


def test_assert_trees_equal_passes_on_equal_trees_of_every_leaf_kind():
    assert_trees_equal(_every_kind(), _every_kind())


def _replace(tree, path, value):
    """`tree` with the leaf at `path` (a tuple of keys) replaced."""
    if len(path) == 1:
        return {**tree, path[0]: value}
    return {**tree, path[0]: _replace(tree[path[0]], path[1:], value)}


_SHARDED = jax.sharding.NamedSharding(
    jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",)), jax.sharding.PartitionSpec("d")
)

PLANTED = {
    "value": (("jax",), jnp.asarray([0.0, 1.0, 2.5]), "['jax']: bits differ in 1 of 3"),
    "dtype": (("jax",), jnp.arange(3.0, dtype=jnp.bfloat16), "['jax']: dtype differs"),
    "shape": (("numpy",), np.array([1, 2], np.int8), "['numpy']: shape differs"),
    "sharding": (("block",), None, "['block'].weight: sharding differs"),
    "structure": (("python",), [1, 2.5, True], "['python']: children differ"),
    "kind": (("numpy_scalar",), np.array(np.nan, np.float32), "leaf kind differs"),
    "negative_zero": (("python",), [1, 2.5, True, 0.0], "['python'][3]: value differs"),
    "nan_payload": (("bf16",), None, "['bf16']: bits differ in 1 of 3"),
    "python_type": (("python",), [1.0, 2.5, True, -0.0], "['python'][0]: type differs: int vs"),
    "static_field": (("block",), Block(jnp.ones(2), 0.5, "conv"), "['block']: node metadata"),
    "configuration": (("block",), Block(jnp.ones(2), 0.25, "dense"), "['block'].scale: value"),
    "key_data": (("key",), jax.random.key(4), "['key']: bits differ"),
    "key_impl": (("key",), jax.random.key(3, impl="rbg"), "key implementation differs"),
    "batchnorm_state": (("bn",), None, "['bn'][1]"),
}


def _planted(name):
    tree = _every_kind()
    path, value, expected = PLANTED[name]
    if name == "sharding":
        value = Block(jax.device_put(jnp.ones(2), _SHARDED), 0.5, "dense")
    if name == "nan_payload":
        bits = np.asarray(tree["bf16"]).view(np.uint16).copy()
        bits[2] ^= 1  # another NaN: same value to ==, other bits
        value = jnp.asarray(bits.view(jnp.bfloat16))
    if name == "batchnorm_state":
        bn, state = tree["bn"]
        value = (bn, jax.tree.map(lambda x: x + 1 if x.dtype != bool else x, state))
    return tree, _replace(tree, path, value), expected


@pytest.mark.parametrize("name", list(PLANTED))
def test_assert_trees_equal_names_the_path_and_what_differs(name):
    tree, planted, expected = _planted(name)
    with pytest.raises(AssertionError, match="differ") as raised:
        assert_trees_equal(tree, planted)
    assert expected in str(raised.value)


def test_assert_trees_equal_compares_weak_types():
    weak, strong = jnp.asarray(1.0), jnp.asarray(1.0, jnp.float32)
    assert weak.weak_type and not strong.weak_type
    with pytest.raises(AssertionError, match=r"\['w'\]: weak type differs"):
        assert_trees_equal({"w": weak}, {"w": strong})


def test_assert_trees_equal_shows_both_sides_and_counts_every_differing_leaf():
    a = {"a": np.zeros(2, np.float32), "b": 1, "c": {"d": np.ones(3), "e": "same"}}
    b = {"a": np.ones(2, np.float32), "b": 2, "c": {"d": np.zeros(3), "e": "same"}}
    with pytest.raises(AssertionError) as raised:
        assert_trees_equal(a, b)
    message = str(raised.value)
    assert "at ['a']: bits differ in 2 of 2 elements" in message  # the first, in tree order
    assert "(3 of 4 leaves differ" in message
    assert "first: NumPy array float32[2] [0. 0.]" in message
    assert "second: NumPy array float32[2] [1. 1.]" in message


def test_assert_trees_equal_is_bitwise_by_default_and_tolerant_on_request():
    a = {"x": np.array([1.0, np.nan], np.float32), "y": 1.0}
    b = {"x": np.array([1.0 + 1e-6, np.nan], np.float32), "y": 1.0 + 1e-9}
    with pytest.raises(AssertionError, match=r"\['x'\]: bits differ in 1 of 2"):
        assert_trees_equal(a, b)
    assert_trees_equal(a, b, rtol=1e-5)
    assert_trees_equal(a, b, atol=1e-5)
    with pytest.raises(AssertionError, match=r"values \(rtol=1e-08"):
        assert_trees_equal(a, b, rtol=1e-8)


def test_assert_trees_equal_treats_equivalent_shardings_as_equal():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    one_device = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    placed = jax.device_put(jnp.ones(3), one_device)
    assert_trees_equal(placed, jax.device_put(jnp.ones(3), jax.devices()[0]))


# ------------------------------------------------------------ assert_checkpoint_roundtrip


def test_checkpoint_roundtrip_passes_and_returns_a_new_tree(tmp_path):
    tree = _every_kind()
    restored = assert_checkpoint_roundtrip(tree, tmp_path)
    assert restored is not tree
    # Nothing in the directory was replaced: a second round trip writes the next step.
    assert_checkpoint_roundtrip(tree, tmp_path)
    assert checkpoints.available_steps(tmp_path) == [0, 1]


def _corrupting(restore, name, *, into_target):
    """`restore_checkpoint` with the planted difference `name` applied to its result, when
    restoring into a target (`into_target`) or with target=None."""
    planted_tree = _planted(name)[1]

    def corrupted(path, target, **options):
        restored = restore(path, target, **options)
        if (target is not None) != into_target:
            return restored
        if target is None:  # as saved: plain dicts of NumPy arrays
            return _replace(restored, ("numpy",), np.array([7, 7], np.int8))
        return planted_tree

    return corrupted


@pytest.mark.parametrize("name", ["value", "dtype", "shape", "sharding", "structure"])
def test_checkpoint_roundtrip_names_the_path_of_a_difference(name, monkeypatch):
    monkeypatch.setattr(
        checkpoints,
        "restore_checkpoint",
        _corrupting(checkpoints.restore_checkpoint, name, into_target=True),
    )
    tree = _every_kind()
    with pytest.raises(AssertionError, match="into the tree: the trees differ at") as raised:
        assert_checkpoint_roundtrip(tree)
    assert PLANTED[name][2] in str(raised.value)


def test_checkpoint_roundtrip_checks_the_saved_leaves_by_name(monkeypatch):
    monkeypatch.setattr(
        checkpoints,
        "restore_checkpoint",
        _corrupting(checkpoints.restore_checkpoint, "shape", into_target=False),
    )
    with pytest.raises(AssertionError, match=r"target=None: leaf 'numpy' dtype, shape or bits"):
        assert_checkpoint_roundtrip(_every_kind())


def test_checkpoint_roundtrip_fails_on_a_restore_that_loses_the_weak_type(monkeypatch):
    # Planted: a restore that makes every weakly typed array strongly typed.
    restore = checkpoints.restore_checkpoint

    def strengthening(path, target, **options):
        return jax.tree.map(
            lambda x: x * np.float32(1) if isinstance(x, jax.Array) and x.weak_type else x,
            restore(path, target, **options),
        )

    tree = {"lr": jnp.asarray(0.1)}
    assert_checkpoint_roundtrip(tree)
    monkeypatch.setattr(checkpoints, "restore_checkpoint", strengthening)
    with pytest.raises(AssertionError, match=r"\['lr'\]: weak type differs"):
        assert_checkpoint_roundtrip(tree)


def _complex_tree():
    c128 = (np.arange(6) * (1 - 2j)).astype(np.complex128)
    c128[0] = complex(-0.0, np.nan)
    return {
        "c128": c128,
        "c128_scalar": np.complex128(complex(np.nan, -0.0)),
        "c64": jnp.asarray(c128.astype(np.complex64)),
        "weak": jnp.asarray(1j),
        "block": Block(jnp.ones(2), 0.5, "dense"),
        "python": 1 - 1j,
    }


def test_checkpoint_roundtrip_passes_on_complex_leaves_of_both_widths(tmp_path):
    tree = _complex_tree()
    assert_trees_equal(assert_checkpoint_roundtrip(tree, tmp_path), tree)


def test_checkpoint_roundtrip_fails_on_a_restore_that_leaves_a_complex128_leaf_unfilled(
    monkeypatch,
):
    # Planted: a restore that keeps the target's own complex128 array instead of the file's.
    restore = checkpoints.restore_checkpoint

    def keeping_the_target(path, target, **options):
        restored = restore(path, target, **options)
        if target is None or isinstance(target["c128"], jax.ShapeDtypeStruct):
            return restored
        return {**restored, "c128": target["c128"]}

    monkeypatch.setattr(checkpoints, "restore_checkpoint", keeping_the_target)
    with pytest.raises(AssertionError, match=r"into the tree: the trees differ at \['c128'\]"):
        assert_checkpoint_roundtrip(_complex_tree())


def test_checkpoint_roundtrip_expects_back_only_what_filter_spec_saved():
    model = eqx.nn.Dropout(0.3)
    restored = assert_checkpoint_roundtrip(
        {"w": jnp.ones(2), "dropout": model}, filter_spec=eqx.is_array
    )
    assert restored["dropout"].p == 0.3


# ---------------------------------------------------------------- assert_resumes_exactly


def _train_setup():
    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    state = TrainState.create(model=model, tx=optax.adam(1e-2))
    batches = [jnp.full((4, 2), float(i)) for i in range(4)]

    @eqx.filter_jit
    def step(state, x):
        def loss_fn(model):
            return jnp.mean(jax.vmap(model)(x) ** 2)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(state.model)
        return state.apply_gradients(grads=grads), {"loss": loss}

    return step, state, batches


def test_resumes_exactly_passes_for_a_pure_training_step(tmp_path):
    step, state, batches = _train_setup()
    assert_resumes_exactly(step, state, batches, split_at=2, directory=tmp_path)
    assert checkpoints.available_steps(tmp_path) == [0]  # the save after two steps
    assert int(state.step) == 0  # the caller's state is untouched


def test_resumes_exactly_names_the_step_and_path_when_a_step_reads_a_counter_outside_its_state():
    calls = []

    def step(state, batch):
        calls.append(None)  # a counter the checkpoint does not hold
        return {"w": state["w"] + batch * len(calls)}

    state = {"w": jnp.zeros(2)}
    with pytest.raises(AssertionError) as raised:
        assert_resumes_exactly(step, state, [jnp.ones(2)] * 3, split_at=1)
    message = str(raised.value)
    assert "step 0, before the save" in message and "outside its arguments" in message
    assert "the states differ: the trees differ at ['w']" in message


def test_resumes_exactly_names_the_first_step_after_a_restore_that_loses_something(
    monkeypatch,
):
    restore = checkpoints.restore_checkpoint

    def lossy(path, target, **options):  # loses the optimiser's step count
        restored = restore(path, target, **options)
        return restored.replace(step=restored.step * 0)

    monkeypatch.setattr(checkpoints, "restore_checkpoint", lossy)
    step, state, batches = _train_setup()
    with pytest.raises(
        AssertionError,
        match=r"after 2 steps is not the state saved: the "
        r"trees differ at \.step: bits differ",
    ):
        assert_resumes_exactly(step, state, batches, split_at=2)


def test_resumes_exactly_compares_every_steps_outputs():
    calls = []

    def step(state, batch):
        calls.append(None)
        return {"w": state["w"] + batch}, {"seen": len(calls)}  # aux from outside the state

    with pytest.raises(AssertionError, match=r"step 0.*the outputs differ.*\['seen'\]"):
        assert_resumes_exactly(step, {"w": jnp.zeros(2)}, [jnp.ones(2)] * 2, split_at=1)


def test_resumes_exactly_accepts_a_step_that_donates_its_state():
    step = jax.jit(lambda s, b: {"w": s["w"] * 2 + b}, donate_argnums=0)
    state = {"w": jnp.ones(3)}
    assert_resumes_exactly(step, state, [jnp.ones(3)] * 3, split_at=0)
    assert_resumes_exactly(step, state, [jnp.ones(3)] * 3, split_at=3)
    assert not state["w"].is_deleted()


def test_resumes_exactly_rejects_split_at_outside_the_batches():
    with pytest.raises(ValueError, match=r"split_at=4 is outside 0\.\.3"):
        assert_resumes_exactly(lambda s, b: s, {"w": jnp.zeros(1)}, [1, 2, 3], split_at=4)


# ----------------------------------------------------------------------------- strategies


def test_arrays_cover_every_dtype_a_checkpoint_stores():
    assert set(ets.DTYPES) == set(_description.CODE_TO_DTYPE.values())


def test_strategies_reach_bfloat16_typed_keys_static_fields_and_batchnorm_state():
    def leaves(tree):
        return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, eqx.Module))

    bf16 = find(
        ets.pytrees(max_leaves=3),
        lambda t: any(getattr(x, "dtype", None) == jnp.bfloat16 for x in jax.tree.leaves(t)),
        settings=BOUNDED,
    )
    assert isinstance(bf16, np.ndarray) and bf16.dtype == jnp.bfloat16  # shrunk to the leaf
    key = find(
        ets.pytrees(st.one_of(ets.arrays(), ets.keys())),
        lambda t: any(jnp.issubdtype(x.dtype, jax.dtypes.prng_key) for x in jax.tree.leaves(t)),
        settings=BOUNDED,
    )
    assert str(jax.random.key_impl(key)) == "threefry2x32"
    found = find(
        ets.pytrees(),
        lambda t: any(isinstance(x, ets.RandomModule) for x in leaves(t)),
        settings=BOUNDED,
    )
    # The module itself, wherever the search left it (how far a tree shrinks depends on the
    # draws, which every dtype added to DTYPES changes).
    module = next(x for x in leaves(found) if isinstance(x, ets.RandomModule))
    assert [f.name for f in dataclasses.fields(module) if f.metadata.get("static")] == ["label"]
    model, state = find(
        ets.modules(),
        lambda pair: any(isinstance(x, eqx.nn.BatchNorm) for x in leaves(pair[0])),
        settings=BOUNDED,
    )
    assert isinstance(model, eqx.nn.BatchNorm) and jax.tree.leaves(state)  # running statistics


def test_strategies_shrink_to_the_simplest_example():
    array = find(ets.arrays(), lambda a: True, settings=BOUNDED)
    assert array.dtype == np.float32 and array.shape == () and array == 0
    empty = find(ets.arrays(), lambda a: a.size == 0, settings=BOUNDED)
    assert empty.dtype == np.float32 and empty.shape == (0,)
    two = find(ets.pytrees(), lambda t: len(jax.tree.leaves(t)) >= 2, settings=BOUNDED)
    assert len(jax.tree.leaves(two)) == 2
    model, state = find(ets.modules(), lambda pair: True, settings=BOUNDED)
    assert isinstance(model, eqx.nn.Linear) and model.weight.shape == (1, 1)
    assert model.weight.dtype == jnp.float32 and jax.tree.leaves(state) == []
    train_state = find(ets.train_states(), lambda s: True, settings=BOUNDED)
    assert int(train_state.step) == 0 and isinstance(train_state.model, eqx.nn.Linear)
    # ...and they compose with st.builds like any strategy.
    built = find(st.builds(lambda pair: pair[0], ets.modules()), lambda m: True, settings=BOUNDED)
    assert isinstance(built, eqx.nn.Linear)


@settings(max_examples=20, deadline=None)
@given(tree=ets.pytrees(max_leaves=3, max_depth=2))
def test_pytrees_respect_max_leaves_and_max_depth(tree):
    def depth(node):
        children = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)[0]
        if node is None or (len(children) == 1 and children[0] is node):
            return 0
        return 1 + max((depth(c) for c in children), default=0)

    drawn = jax.tree.leaves(tree, is_leaf=lambda x: x is None)  # a module's function and
    drawn = [x for x in drawn if x is None or isinstance(x, np.ndarray)]  # config aside
    assert len(drawn) <= 3
    assert depth(tree) <= 2


# --------------------------------------------------- optional dependency and pytest plugin


def _run_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


_BLOCK_HYPOTHESIS = """
    import sys

    class Block:  # as if hypothesis were not installed
        def find_spec(self, name, path=None, target=None):
            if name == "hypothesis" or name.startswith("hypothesis."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, Block())
"""


def test_importing_eqx_train_testing_without_hypothesis_names_the_extra():
    result = _run_python(
        _BLOCK_HYPOTHESIS
        + """
    try:
        import eqx_train.testing
    except ImportError as error:
        print(error)
    """
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'eqx_train[testing]'" in result.stdout
    assert "missing: hypothesis" in result.stdout


def test_the_entry_point_plugin_loads_without_eqx_train_hypothesis_or_jax():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert scripts["pytest11"] == {"eqx_train.testing": "eqx_train_pytest"}
    result = _run_python(
        _BLOCK_HYPOTHESIS
        + """
    import eqx_train_pytest
    print(sorted(m for m in ("eqx_train", "jax", "hypothesis") if m in sys.modules))
    """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


_PLUGIN_TEST = """
    import jax


    def test_fixtures(checkpoint_dir, cpu_mesh):
        assert checkpoint_dir.is_dir() and not any(checkpoint_dir.iterdir())
        assert cpu_mesh.axis_names == ("data",)
        assert cpu_mesh.devices.size == len(jax.devices("cpu")) == {devices}
"""


def test_plugin_fixtures_work_and_leave_the_devices_alone_without_cpu_devices(pytester):
    pytester.makepyfile(_PLUGIN_TEST.format(devices=len(jax.devices("cpu"))))
    result = pytester.runpytest_inprocess("-p", "eqx_train.testing", "-q")
    result.assert_outcomes(passed=1)


def test_cpu_devices_when_jax_already_started_is_a_usage_error(pytester):
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "eqx_train.testing", "--cpu-devices", "2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--cpu-devices 2: JAX has already started*"])


@pytest.mark.slow
def test_cpu_devices_sets_the_device_count_over_a_conftest_that_sets_its_own(pytester, monkeypatch):
    pytester.makeconftest(
        "import jax\n\njax.config.update('jax_num_cpu_devices', 8)  # as this suite's own\n"
    )
    pytester.makepyfile(_PLUGIN_TEST.format(devices=3))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    result = pytester.runpytest_subprocess("-p", "eqx_train.testing", "--cpu-devices", "3")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["eqx_train.testing: 3 CPU devices (--cpu-devices)"])
