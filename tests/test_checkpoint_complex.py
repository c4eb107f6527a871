"""Complex numbers in checkpoints: complex64 and complex128 arrays (NumPy and JAX) and Python
`complex` scalars come back bit for bit (NaN payloads and -0.0 in either part) in every
layout; the official safetensors reader reads the files (complex64 as C64, complex128 as F64
pairs named in the metadata); casting follows `numpy.can_cast`; the comparison helpers and
the command line see each part."""

import json
import os
import subprocess
import sys
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from eqx_train import checkpoints
from eqx_train.checkpoints import CheckpointFormatError
from eqx_train.interop import load_sharded, save_sharded
from eqx_train.testing import assert_trees_equal
from tests.support.helpers import latest_path


def _float64(bits: int) -> float:
    return float(np.array([bits], np.uint64).view(np.float64)[0])


NAN_PAYLOAD = _float64(0x7FF8_0000_0000_0123)  # a quiet NaN with a payload
NAN_NEGATIVE = _float64(0xFFF8_0000_0000_0456)
NAN32 = np.array([0x7FC0_0042], np.uint32).view(np.float32)[0]


def _c128():
    """complex128 values with odd parts: -0.0, NaN payloads, infinities, subnormals."""
    real = np.array([1.5, -0.0, NAN_PAYLOAD, np.inf, 5e-324, 0.0], np.float64)
    imag = np.array([-0.0, NAN_NEGATIVE, 2.0, -np.inf, 0.0, NAN_PAYLOAD], np.float64)
    return np.stack([real, imag], axis=-1).reshape(-1).view(np.complex128).reshape(2, 3)


def _c64():
    real = np.array([1.5, -0.0, NAN32, np.inf], np.float32)
    imag = np.array([NAN32, -0.0, 2.0, -1e-45], np.float32)
    return np.stack([real, imag], axis=-1).reshape(-1).view(np.complex64)


def _bits(x):
    return np.ascontiguousarray(np.asarray(x)).tobytes()


def _tree():
    return {
        "np128": _c128(),
        "np64": _c64(),
        "jax64": jnp.asarray(_c64()),
        "weak": jnp.asarray(1 - 2j),  # weakly typed complex64, as JAX makes it
        "scalars": (True, 1, 1.0, 1 + 1j, complex(-0.0, NAN_PAYLOAD)),
        "np_scalar": np.complex128(complex(NAN_NEGATIVE, -0.0)),
    }


# ------------------------------------------------------------------ round trips, single file


def test_complex_leaves_round_trip_bit_for_bit_onto_a_target(tmp_path):
    tree = _tree()
    checkpoints.save_checkpoint(tmp_path, tree, 1)
    like = jax.tree.map(
        lambda x: type(x)(0) if isinstance(x, bool | int | float | complex) else x, tree
    )
    like = jax.tree.map(lambda x: np.zeros_like(x) if isinstance(x, np.ndarray) else x, like)
    like = {**like, "jax64": jnp.zeros(4, jnp.complex64), "weak": jnp.asarray(0j)}
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, like), tree)


def test_complex_leaves_round_trip_bit_for_bit_without_a_target(tmp_path):
    tree = _tree()
    checkpoints.save_checkpoint(tmp_path, tree, 1)
    restored = checkpoints.restore_checkpoint(tmp_path, None)
    # Without a target a JAX array comes back as NumPy, unless it was weakly typed.
    assert_trees_equal(restored, {**tree, "jax64": np.asarray(tree["jax64"])})
    assert restored["weak"].weak_type and restored["weak"].dtype == jnp.complex64


def test_a_weakly_typed_complex_restores_weakly_typed_like_a_weak_float(tmp_path):
    tree = {"c": jnp.asarray(2 + 3j), "f": jnp.asarray(2.0)}
    checkpoints.save_checkpoint(tmp_path, tree, 1)
    restored = checkpoints.restore_checkpoint(
        tmp_path, {"c": jnp.asarray(0j), "f": jnp.asarray(0.0)}
    )
    assert restored["c"].weak_type and restored["f"].weak_type
    assert jnp.result_type(restored["c"], jnp.bfloat16) == jnp.complex64


def test_complex_leaves_restore_onto_abstract_targets(tmp_path):
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    tree = {"a": jax.device_put(jnp.asarray(_c64()), sharding), "b": _c128()}
    checkpoints.save_checkpoint(tmp_path, tree, 1)
    abstract = {
        "a": jax.ShapeDtypeStruct((4,), jnp.complex64, sharding=sharding),
        "b": jax.ShapeDtypeStruct((2, 3), np.complex128),
    }
    restored = checkpoints.restore_checkpoint(tmp_path, abstract)
    assert restored["a"].sharding == sharding and _bits(restored["a"]) == _bits(_c64())
    if jax.config.jax_enable_x64:  # pyright: ignore[reportAttributeAccessIssue]  # set at run time
        assert _bits(restored["b"]) == _bits(_c128())
    else:  # JAX without x64 holds complex64: the abstract target asks for a cast
        assert restored["b"].dtype == jnp.complex64


def test_complex_leaves_round_trip_through_object_storage():
    tree = _tree()
    checkpoints.save_checkpoint("memory://complex_checkpoints/run", tree, 3)
    restored = checkpoints.restore_checkpoint("memory://complex_checkpoints/run", tree)
    assert_trees_equal(restored, tree)


# ------------------------------------------------------------------ what the file holds


def test_the_official_reader_reads_complex64_as_c64_and_complex128_as_float64_pairs(tmp_path):
    checkpoints.save_checkpoint(tmp_path, {"a": _c64(), "b": _c128(), "s": 1 + 2j}, 1)
    path = latest_path(tmp_path)
    loaded = safetensors.numpy.load_file(path)
    assert loaded["a"].dtype == np.complex64 and _bits(loaded["a"]) == _bits(_c64())
    assert loaded["b"].dtype == np.float64 and loaded["b"].shape == (2, 3, 2)
    assert _bits(loaded["b"]) == _bits(_c128())  # (real, imaginary) pairs, the same bytes
    np.testing.assert_array_equal(loaded["s"], [1.0, 2.0])
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["a"]["dtype"] == "C64"
    assert sorted(json.loads(header["__metadata__"]["eqx_train.complex128"])) == ["b", "s"]


def test_a_file_without_complex128_has_no_complex128_list(tmp_path):
    checkpoints.save_checkpoint(tmp_path, {"a": _c64(), "f": np.ones(2)}, 1)
    with open(latest_path(tmp_path), "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert "eqx_train.complex128" not in header["__metadata__"]


def _format_version(path) -> str:
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return header["__metadata__"]["eqx_train.format_version"]


@pytest.mark.parametrize(
    ("tree", "version"),
    [
        ({"f": np.ones(2), "i": np.arange(3)}, "1"),
        ({"a": _c64(), "f": np.ones(2)}, "2"),
        ({"b": _c128()}, "2"),
        ({"s": 1 + 2j}, "2"),
    ],
    ids=["no-complex", "complex64", "complex128", "python-complex"],
)
def test_only_a_file_holding_a_complex_tensor_is_written_as_format_version_2(
    tmp_path, tree, version
):
    checkpoints.save_checkpoint(tmp_path, tree, 1)
    assert _format_version(latest_path(tmp_path)) == version


def test_a_shards_index_of_complex_arrays_is_format_version_2(tmp_path):
    checkpoints.save_checkpoint_multiprocess(tmp_path / "c", {"a": _c64(), "f": np.ones(2)}, 1)
    checkpoints.save_checkpoint_multiprocess(tmp_path / "f", {"f": np.ones(2)}, 1)
    for name, version in (("c", "2"), ("f", "1")):
        index = os.path.join(latest_path(tmp_path / name), "index.safetensors")
        assert _format_version(index) == version


@pytest.mark.parametrize("layout", ["file", "shards"])
@pytest.mark.parametrize("leaf", [_c64, _c128], ids=["complex64", "complex128"])
def test_a_reader_of_version_1_refuses_complex_as_newer_and_its_manager_keeps_it(
    tmp_path, monkeypatch, layout, leaf
):
    # An eqx_train that reads version 1 only (every release before complex numbers) must
    # neither return complex128's (real, imaginary) float64 pairs as the saved values nor
    # take a complex code for corruption, which would make its manager move the file aside.
    from eqx_train.checkpoints.format import _header_codes

    save = {"file": checkpoints.save_checkpoint, "shards": checkpoints.save_checkpoint_multiprocess}
    save[layout](tmp_path, {"b": leaf()}, 1)
    monkeypatch.setattr(_header_codes, "FORMAT_VERSION", 1)
    monkeypatch.setattr(_header_codes, "READABLE_VERSIONS", frozenset({"1"}))
    with pytest.raises(checkpoints.NewerFormatError, match="newer eqx_train"):
        checkpoints.restore_checkpoint(tmp_path, None)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(checkpoints.NewerFormatError):
        checkpoints.CheckpointManager(tmp_path).restore(None)
    assert sorted(os.listdir(tmp_path)) == before


def test_a_flipped_bit_in_a_complex128_tensor_fails_its_checksum_naming_it(tmp_path):
    checkpoints.save_checkpoint(tmp_path, {"b": np.full(4, 1 + 1j, np.complex128)}, 1)
    path = latest_path(tmp_path)
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CheckpointFormatError, match="tensor 'b' fails its checksum"):
        checkpoints.restore_checkpoint(path, None)


def _rewrite_header(path, edit):
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header, data = json.loads(f.read(length)), f.read()
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + data)


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: h["__metadata__"].update({"eqx_train.complex128": '["b", "b"]'}),
        lambda h: h["__metadata__"].update({"eqx_train.complex128": '["missing"]'}),
        lambda h: h["__metadata__"].update({"eqx_train.complex128": '["f"]'}),
        lambda h: h["__metadata__"].update({"eqx_train.complex128": '{"b": 1}'}),
        lambda h: h["__metadata__"].update({"eqx_train.complex128": "not json"}),
        lambda h: h["__metadata__"].pop("eqx_train.complex128"),
        lambda h: h["b"].update({"dtype": "C128", "shape": [2]}),
    ],
    ids=["twice", "missing", "not-pairs", "not-a-list", "not-json", "dropped", "c128-code"],
)
def test_a_hostile_complex128_list_or_code_is_refused_naming_the_file(tmp_path, edit):
    checkpoints.save_checkpoint(tmp_path, {"b": np.ones(2, np.complex128), "f": np.ones(3)}, 1)
    path = latest_path(tmp_path)
    _rewrite_header(path, edit)
    with pytest.raises(CheckpointFormatError, match="checkpoint_1.safetensors"):
        checkpoints.restore_checkpoint(path, None)


# ------------------------------------------------------------------ casting


@pytest.mark.parametrize("casting", ["no", "equiv", "safe", "same_kind", "unsafe"])
@pytest.mark.parametrize(
    "saved, target",
    [
        (np.complex64, np.complex128),
        (np.complex128, np.complex64),
        (np.complex64, np.float32),
        (np.complex128, np.float64),
        (np.float32, np.complex64),
        (np.float64, np.complex64),
        (np.int32, np.complex128),
    ],
)
def test_complex_casts_are_allowed_exactly_when_numpy_can_cast_them(
    tmp_path, saved, target, casting
):
    values = np.array([1.5, -2.0], saved)
    checkpoints.save_checkpoint(tmp_path, {"x": values}, 1)
    like = {"x": np.zeros(2, target)}
    plan = checkpoints.plan_restore(tmp_path, like, casting=casting)
    allowed = np.can_cast(saved, target, casting)
    assert plan.ok is allowed, str(plan)
    if allowed:
        restored = checkpoints.restore_checkpoint(tmp_path, like, casting=casting)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", np.exceptions.ComplexWarning)
            reference = np.array([1.5, -2.0], saved).astype(target)
        assert restored["x"].dtype == target and _bits(restored["x"]) == _bits(reference)
    else:
        with pytest.raises(ValueError, match="'x': file has"):
            checkpoints.restore_checkpoint(tmp_path, like, casting=casting)


def test_an_unsafe_cast_of_a_complex_to_a_float_keeps_the_real_part_without_a_warning(tmp_path):
    checkpoints.save_checkpoint(tmp_path, {"x": np.array([1.5 + 9j, -0.0 - 1j], np.complex128)}, 1)
    restored = checkpoints.restore_checkpoint(tmp_path, {"x": np.zeros(2)}, casting="unsafe")
    assert _bits(restored["x"]) == _bits(np.array([1.5, -0.0]))


def test_a_python_complex_takes_a_saved_float_and_a_python_float_refuses_a_saved_complex(
    tmp_path,
):
    checkpoints.save_checkpoint(tmp_path, {"c": 2.5, "f": 1 + 0j}, 1)
    plan = checkpoints.plan_restore(tmp_path, {"c": 0j, "f": 0.0})
    assert plan.taken == {"c": "c"} and len(plan.problems) == 1
    assert "'f': file has () complex128, target expects () float" in plan.problems[0]
    with pytest.raises(ValueError, match=r"'f': file has \(\) complex128"):
        checkpoints.restore_checkpoint(tmp_path, {"c": 0j, "f": 0.0})
    restored = checkpoints.restore_checkpoint(tmp_path, {"c": 0j, "f": 0j})
    assert restored == {"c": 2.5 + 0j, "f": 1 + 0j} and type(restored["c"]) is complex


# ------------------------------------------------------------------ other layouts


def test_complex_leaves_round_trip_through_a_shards_checkpoint(tmp_path):
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    c64 = (np.arange(48).reshape(8, 6) * (1 - 0.5j)).astype(np.complex64)
    c64[0, 0] = complex(-0.0, float(NAN32))
    tree = {
        "sharded": jax.device_put(c64, NamedSharding(mesh, P("x", "y"))),
        "replicated": jax.device_put(c64, NamedSharding(mesh, P())),
        "np128": _c128(),
        "scalar": complex(NAN_PAYLOAD, -0.0),
    }
    checkpoints.save_checkpoint_multiprocess(tmp_path, tree, 2, timeout_s=60)
    assert os.listdir(tmp_path) == ["checkpoint_2.shards"]
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, tree), tree)
    as_saved = checkpoints.restore_checkpoint(tmp_path, None)
    assert _bits(as_saved["sharded"]) == _bits(c64) and _bits(as_saved["np128"]) == _bits(_c128())
    assert _bits(as_saved["scalar"]) == _bits(tree["scalar"])
    assert checkpoints.plan_restore(tmp_path, tree).ok


def test_complex_leaves_round_trip_through_hugging_face_shards(tmp_path):
    tree = {"a": jnp.asarray(_c64()), "b": _c128(), "s": 1 - 1j, "w": jnp.asarray(1j)}
    save_sharded(tmp_path, tree, max_shard_size=64)
    shard_files = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    assert len(shard_files) > 1
    for name in shard_files:  # every shard is readable by the official reader
        safetensors.numpy.load_file(tmp_path / name)
    assert_trees_equal(load_sharded(tmp_path, tree), tree)
    assert _bits(load_sharded(tmp_path)["b"]) == _bits(_c128())


# ------------------------------------------------------------------ Equinox's cases, adapted


def _equinox_example():
    """Equinox's serialisation example: arrays, the four Python scalar types (a complex
    among them), a function and an object, which are kept from the target."""
    tree = (
        jnp.array(1),
        jnp.array([1.0, 2.0]),
        np.array(1),
        np.array([1.0, 2.0]),
        (True, 1, 1.0, 1 + 1j),
        lambda x: x,
        object(),
    )
    like = (
        jnp.array(5),
        jnp.array([6.0, 7.0]),
        np.array(5),
        np.array([6.0, 7.0]),
        (False, 6, 6.0, 6 + 6j),
        lambda x: x,
        object(),
    )
    return tree, like


@pytest.mark.parametrize("where", ["directory", "file"])
def test_equinox_example_with_a_complex_scalar_round_trips(tmp_path, where):
    tree, like = _equinox_example()
    checkpoints.save_checkpoint(tmp_path, tree, 1)
    path = tmp_path if where == "directory" else latest_path(tmp_path)
    loaded = checkpoints.restore_checkpoint(path, like)
    assert eqx.tree_equal(loaded[:-2], tree[:-2])
    assert loaded[4] == (True, 1, 1.0, 1 + 1j) and type(loaded[4][3]) is complex
    assert loaded[-2] is like[-2] and loaded[-1] is like[-1]


def test_equinox_example_restores_only_what_the_filter_spec_selects(tmp_path):
    tree, like = _equinox_example()
    checkpoints.save_checkpoint(tmp_path, tree, 1)
    not_jax = lambda x: not isinstance(x, jax.Array)  # noqa: E731
    loaded = checkpoints.restore_checkpoint(tmp_path, like, filter_spec=not_jax)
    assert eqx.tree_equal(loaded[:2], like[:2])  # kept from the target
    assert eqx.tree_equal(loaded[2:5], tree[2:5]) and loaded[4][3] == 1 + 1j


def test_a_module_with_complex_parameters_round_trips(tmp_path):
    class Diagonal(eqx.Module):  # a linear recurrence's complex diagonal, as in S4D / LRU
        lam: jax.Array
        scale: complex = eqx.field(static=True, default=0.5 + 0.5j)

    model = Diagonal(jnp.exp(jnp.linspace(-1, 0, 5) * (1 + 2j)).astype(jnp.complex64))
    checkpoints.save_checkpoint(tmp_path, model, 1)
    like = Diagonal(jnp.zeros(5, jnp.complex64))
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, like), model)


# ------------------------------------------------------------------ comparison and the CLI


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_assert_trees_equal_sees_each_part_of_a_complex_bit_for_bit(dtype):
    part = np.float32 if dtype == np.complex64 else np.float64
    nan_a = np.array([0x7FC0_0001], np.uint32).view(np.float32)[0]
    nan_b = np.array([0x7FC0_0002], np.uint32).view(np.float32)[0]

    def make(real, imag):
        return np.array([real, imag], part).view(dtype)

    assert_trees_equal({"z": make(1.0, nan_a)}, {"z": make(1.0, nan_a)})
    for a, b in [
        (make(1.0, -0.0), make(1.0, 0.0)),
        (make(-0.0, 1.0), make(0.0, 1.0)),
        (make(1.0, nan_a), make(1.0, nan_b)),
        (make(nan_a, 1.0), make(nan_b, 1.0)),
    ]:
        with pytest.raises(AssertionError, match="'z'|z"):
            assert_trees_equal({"z": a}, {"z": b})
        with pytest.raises(AssertionError):
            assert_trees_equal({"z": jnp.asarray(a)}, {"z": jnp.asarray(b)})


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "eqx_train", *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def test_the_cli_inspects_verifies_and_diffs_complex_tensors_part_by_part(tmp_path):
    left = np.array([1 + 2j, complex(-0.0, NAN_PAYLOAD)], np.complex128)
    right = np.array([1 + 2j, complex(0.0, NAN_PAYLOAD)], np.complex128)  # only -0.0 differs
    checkpoints.save_checkpoint(tmp_path / "a", {"z": left, "y": _c64()}, 1)
    checkpoints.save_checkpoint(tmp_path / "b", {"z": right, "y": _c64()}, 1)
    a = latest_path(tmp_path / "a")
    inspected = _cli("inspect", a)
    assert inspected.returncode == 0 and "complex128[2]" in inspected.stdout
    assert "complex64[4]" in inspected.stdout
    assert _cli("verify", a).returncode == 0
    same = _cli("diff", tmp_path / "a", tmp_path / "a")
    assert same.returncode == 0, same.stdout + same.stderr
    differs = _cli("diff", tmp_path / "a", tmp_path / "b")
    assert differs.returncode == 1
    assert "differs: z complex128[2]: 1 of 2 elements" in differs.stdout


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_assert_trees_equal_within_a_tolerance_compares_each_part_of_a_complex(dtype):
    """NaN equals NaN part by part: a NaN in one part neither hides the other part's
    difference nor equals a NaN in the other part."""
    part = np.float32 if dtype == np.complex64 else np.float64

    def make(real, imag):
        return np.array([real, imag], part).view(dtype)

    tolerance = {"atol": 0.5}
    for a, b in [
        (make(np.nan, 1.0), make(np.nan, 1.0)),
        (make(np.nan, 1.0), make(np.nan, 1.25)),  # the other part within the tolerance
        (make(2.0, np.nan), make(2.25, np.nan)),
    ]:
        assert_trees_equal({"z": a}, {"z": b}, **tolerance)
        assert_trees_equal({"z": jnp.asarray(a)}, {"z": jnp.asarray(b)}, **tolerance)
        assert_trees_equal(complex(a[0]), complex(b[0]), **tolerance)
    for a, b in [
        (make(np.nan, 1.0), make(np.nan, 100.0)),  # the other part far apart
        (make(np.nan, 1.0), make(1.0, np.nan)),  # NaN in different parts
        (make(5.0, np.nan), make(-5.0, np.nan)),
    ]:
        with pytest.raises(AssertionError, match="'z'"):
            assert_trees_equal({"z": a}, {"z": b}, **tolerance)
        with pytest.raises(AssertionError, match="'z'"):
            assert_trees_equal({"z": jnp.asarray(a)}, {"z": jnp.asarray(b)}, **tolerance)
        with pytest.raises(AssertionError, match="value differs"):
            assert_trees_equal(complex(a[0]), complex(b[0]), **tolerance)
