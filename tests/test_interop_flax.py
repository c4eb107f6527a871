"""load_flax_checkpoint: reads what flax.training.checkpoints.save_checkpoint wrote, exactly as
flax's restore_checkpoint(path, None) returns it, without importing flax."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from typing import Any, cast

import jax.numpy as jnp
import ml_dtypes
import msgpack
import numpy as np
import optax
import pytest

from eqx_train.checkpoints import CheckpointFormatError
from eqx_train.interop import load_flax_checkpoint
from tests.support.helpers import assert_identical


@pytest.fixture
def flax_checkpoints(monkeypatch):
    """flax.training.checkpoints writing legacy msgpack files: flax writes Orbax directories
    by default (flax_use_orbax_checkpointing=True), which are not this format."""
    import flax
    from flax.training import checkpoints

    before = flax.config.flax_use_orbax_checkpointing
    flax.config.update("flax_use_orbax_checkpointing", False)
    with warnings.catch_warnings():
        # flax's notice that its own msgpack checkpoints are on the way out.
        warnings.filterwarnings("ignore", "Flax Checkpointing will soon be deprecated")
        yield checkpoints
    flax.config.update("flax_use_orbax_checkpointing", before)


def save_and_compare(checkpoints, directory, tree, step=1) -> Any:
    path = checkpoints.save_checkpoint(directory, tree, step=step, keep=100)
    ours = load_flax_checkpoint(path)
    assert_identical(ours, checkpoints.restore_checkpoint(path, None))
    return ours


def test_nested_containers_and_python_scalars_match_flax(flax_checkpoints, tmp_path):
    tree = {
        "params": {"dense": {"kernel": np.ones((2, 3), np.float32), "bias": np.zeros(3)}},
        "layers": [np.arange(4), (np.int32(7), {"deep": {"deeper": np.float16(0.5)}})],
        "scalars": {"int": -3, "big": 2**63, "float": 0.1, "bool": True, "none": None},
        "complex": 3 - 4j,
        "text": "héllo",
        "raw": b"\x00\xff",
        "empty": {},
    }
    ours = save_and_compare(flax_checkpoints, tmp_path, tree)
    # Lists and tuples come back as dicts keyed '0', '1', ..., as flax saved them.
    assert set(ours["layers"]) == {"0", "1"}
    assert ours["layers"]["1"]["1"]["deep"]["deeper"].dtype == np.float16


@pytest.mark.parametrize(
    "dtype",
    [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32]
    + [np.uint64, np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
    + [np.complex64, np.complex128],
)
def test_every_flax_dtype_matches_flax_bit_for_bit(flax_checkpoints, tmp_path, dtype):
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 256, size=(3, 5 * np.dtype(dtype).itemsize), dtype=np.uint8)
    array = bits.view(np.uint8 if dtype is np.bool_ else dtype)  # NaNs, -0.0 and all
    if dtype is np.bool_:
        array = (bits % 2).astype(np.bool_)
    tree = {"array": array, "scalar": array.reshape(-1)[0], "empty": np.zeros((0, 2), dtype)}
    ours = save_and_compare(flax_checkpoints, tmp_path, tree)
    assert ours["array"].dtype == np.dtype(dtype)


def test_chunked_array_is_joined_as_flax_joins_it(flax_checkpoints, tmp_path, monkeypatch):
    from flax import serialization

    # flax chunks arrays over 1 GiB; a 64-byte chunk size makes that happen to small ones.
    monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 64)
    tree = {
        "big": np.arange(1001, dtype=np.float32).reshape(7, 11, 13),
        "bf16": np.arange(100).astype(jnp.bfloat16),
        "nested": {"also": np.arange(50, dtype=np.int64)},
        "small": np.arange(4, dtype=np.int8),
    }
    ours = save_and_compare(flax_checkpoints, tmp_path, tree)
    with open(flax_checkpoints.latest_checkpoint(tmp_path), "rb") as f:
        assert f.read().count(b"__msgpack_chunked_array__") == 3
    np.testing.assert_array_equal(ours["big"], tree["big"])


def test_train_state_params_and_opt_state_match_flax(flax_checkpoints, tmp_path):
    from flax.training.train_state import TrainState

    params = {"dense": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(2)}, "scale": jnp.ones(())}
    state = TrainState.create(apply_fn=lambda p, x: x, params=params, tx=optax.adam(1e-3))
    grads = {"dense": {"kernel": jnp.full((3, 2), 0.5), "bias": jnp.ones(2)}, "scale": jnp.ones(())}
    state = state.apply_gradients(grads=grads)
    ours = save_and_compare(flax_checkpoints, tmp_path, state, step=int(state.step))
    assert set(ours) == {"step", "params", "opt_state"}
    adam = ours["opt_state"]["0"]  # (ScaleByAdamState, EmptyState) as flax's state dict
    np.testing.assert_array_equal(
        adam["mu"]["dense"]["kernel"], cast(Any, state.opt_state)[0].mu["dense"]["kernel"]
    )


def test_directory_gives_the_latest_step_as_flax_picks_it(flax_checkpoints, tmp_path):
    for step in (2, 9, 10):  # "checkpoint_9" sorts after "checkpoint_10" as text
        flax_checkpoints.save_checkpoint(tmp_path, {"step": np.int64(step)}, step=step, keep=5)
    flax_checkpoints.save_checkpoint(tmp_path, {"step": np.int64(3)}, step=3, prefix="ema_")
    assert load_flax_checkpoint(tmp_path)["step"] == 10
    assert load_flax_checkpoint(os.fspath(tmp_path))["step"] == 10
    assert load_flax_checkpoint(tmp_path, prefix="ema_")["step"] == 3
    assert_identical(
        load_flax_checkpoint(tmp_path), flax_checkpoints.restore_checkpoint(tmp_path, None)
    )


def test_reading_never_imports_flax(flax_checkpoints, tmp_path, monkeypatch):
    from flax import serialization

    monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 64)
    tree = {"a": np.arange(100, dtype=np.float32), "b": {"c": np.float32(1.5), "d": 1 + 2j}}
    path = flax_checkpoints.save_checkpoint(tmp_path, tree, step=1)
    script = textwrap.dedent(
        f"""
        import sys
        import numpy as np
        from eqx_train.interop import load_flax_checkpoint
        tree = load_flax_checkpoint({str(path)!r})
        assert np.array_equal(tree["a"], np.arange(100, dtype=np.float32)), tree
        assert tree["b"]["d"] == 1 + 2j
        print(sorted(m for m in sys.modules if m == "flax" or m.startswith("flax.")))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_missing_path_raises_file_not_found_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_flax_checkpoint(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no checkpoint named 'checkpoint_<step>'"):
        load_flax_checkpoint(tmp_path)


def test_orbax_directory_is_refused_with_how_to_read_it(tmp_path):
    step = tmp_path / "checkpoint_5"
    step.mkdir()
    (step / "_METADATA").write_text("{}")
    for path in (tmp_path, step):
        with pytest.raises(CheckpointFormatError, match="Orbax checkpoint directory"):
            load_flax_checkpoint(path)


# ------------------------------------------------------------------------- hostile files


def _ndarray_ext(shape: Any, dtype: Any, data: bytes) -> msgpack.ExtType:
    return msgpack.ExtType(1, _pack((shape, dtype, data), use_bin_type=True))


def _write(tmp_path, raw: bytes) -> str:
    path = tmp_path / "checkpoint_1"
    path.write_bytes(raw)
    return str(path)


def _pack(value: Any, **options: Any) -> bytes:
    """`msgpack.packb`, whose stubs allow None (for a Packer without autoreset only)."""
    return cast(bytes, msgpack.packb(value, **options))


VALID = _pack(
    {
        "w": _ndarray_ext((2, 2), "float32", bytes(16)),
        "n": 3,
        "c": msgpack.ExtType(2, _pack((1.0, 2.0))),
    }
)

HOSTILE = {
    "empty": b"",
    "text": b"not a checkpoint at all \xc1",
    "trailing bytes": VALID + b"\x00",
    "unknown extension type": _pack({"x": msgpack.ExtType(42, b"abc")}),
    "timestamp extension": b"\x81\xa1x\xd6\xff" + b"\x00" * 4,  # fixext4 of type -1
    "nested 100000 deep": b"\x91" * 100_000 + b"\x00",
    "array of 2**32-1 entries": b"\xdd\xff\xff\xff\xff\x00",
    "map of 2**32-1 entries": b"\xdf\xff\xff\xff\xff\x00",
    "bin of 4 GiB": b"\xc6\xff\xff\xff\xff" + b"\x00" * 8,
    "ext of 4 GiB": b"\xc9\xff\xff\xff\xff\x01" + b"\x00" * 8,
    "shape larger than data": _pack({"w": _ndarray_ext((2**40, 2**20), "float32", bytes(16))}),
    "negative shape": _pack({"w": _ndarray_ext((-4,), "float32", bytes(16))}),
    "object dtype": _pack({"w": _ndarray_ext((2,), "O", bytes(16))}),
    "string dtype": _pack({"w": _ndarray_ext((2,), "U2", bytes(16))}),
    "structured dtype": _pack({"w": _ndarray_ext((2,), "f4,f4", bytes(16))}),
    "ndarray not a triple": _pack({"w": msgpack.ExtType(1, _pack((1, 2)))}),
    "complex not a pair": _pack({"c": msgpack.ExtType(2, _pack("x"))}),
    "list as map key": b"\x81\x91\x00\x00",
    "chunked without chunks": _pack({"a": {"__msgpack_chunked_array__": True, "shape": {"0": 4}}}),
    "chunks not making the shape": _pack(
        {
            "a": {
                "__msgpack_chunked_array__": True,
                "shape": {"0": 5},
                "chunks": {"0": _ndarray_ext((4,), "float32", bytes(16))},
            }
        }
    ),
    "invalid utf-8 key": b"\x81\xa2\xff\xfe\x00",
    "empty array with an impossible shape": _pack({"w": _ndarray_ext((0, 2**63), "float32", b"")}),
    "empty chunked array with an impossible shape": _pack(
        {
            "a": {
                "__msgpack_chunked_array__": True,
                "shape": {"0": 0, "1": 2**62},
                "chunks": {"0": _ndarray_ext((0,), "float32", b"")},
            }
        }
    ),
    "chunked shape keyed by a wrong index": _pack(
        {
            "a": {
                "__msgpack_chunked_array__": True,
                "shape": {"5": 3},
                "chunks": {"0": _ndarray_ext((3,), "float32", bytes(12))},
            }
        }
    ),
    "chunked shape not an int": _pack(
        {
            "a": {
                "__msgpack_chunked_array__": True,
                "shape": {"0": "x"},
                "chunks": {"0": _ndarray_ext((3,), "float32", bytes(12))},
            }
        }
    ),
    "chunked negative shape": _pack(
        {
            "a": {
                "__msgpack_chunked_array__": True,
                "shape": {"0": -7},
                "chunks": {"0": _ndarray_ext((3,), "float32", bytes(12))},
            }
        }
    ),
    "dtype name of a module attribute": _pack({"w": _ndarray_ext((2,), "_np", bytes(8))}),
    "dtype name __builtins__": _pack({"w": _ndarray_ext((2,), "__builtins__", bytes(8))}),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_inspect_of_a_hostile_file_fails_in_one_line_naming_it(tmp_path, case, capsys):
    from eqx_train._cli import main

    path = _write(tmp_path, HOSTILE[case])
    code = main(["inspect", path])
    err = capsys.readouterr().err
    assert code == 1 and path in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_file_raises_format_error_naming_it(tmp_path, case):
    path = _write(tmp_path, HOSTILE[case])
    with pytest.raises(CheckpointFormatError, match=f"{path} is not a flax msgpack checkpoint"):
        load_flax_checkpoint(path)


def test_a_file_of_more_containers_than_the_limit_is_refused(tmp_path, monkeypatch):
    """One byte of file can be a dict of hundreds of bytes: a crafted 1 MB file would take
    gigabytes. The limit (a million) is lowered here to keep the test fast."""
    from eqx_train.interop import _flax

    monkeypatch.setattr(_flax, "_MAX_OBJECTS", 1000)
    fine = _write(tmp_path, b"\xdc" + (999).to_bytes(2, "big") + b"\x80" * 999)
    assert load_flax_checkpoint(fine) == [{}] * 999
    path = _write(tmp_path, b"\xdc" + (1000).to_bytes(2, "big") + b"\x80" * 1000)
    with pytest.raises(CheckpointFormatError, match="more than 1000 containers and arrays"):
        load_flax_checkpoint(path)


@pytest.mark.parametrize("value", [5, None, "text", 2.5])
def test_a_bare_scalar_at_the_root_comes_back_as_flax_returns_it(flax_checkpoints, tmp_path, value):
    path = _write(tmp_path, _pack(value))
    assert load_flax_checkpoint(path) == flax_checkpoints.restore_checkpoint(path, None)


def test_every_truncation_of_a_valid_file_raises_format_error(tmp_path):
    assert load_flax_checkpoint(_write(tmp_path, VALID))["c"] == 1 + 2j
    for cut in range(len(VALID)):
        path = _write(tmp_path, VALID[:cut])
        with pytest.raises(CheckpointFormatError, match=str(path)):
            load_flax_checkpoint(path)


def test_multiprocess_array_placeholder_is_refused(tmp_path):
    path = _write(tmp_path, _pack({"w": "//GDAPlaceholder:w"}))
    with pytest.raises(CheckpointFormatError, match="multi-process array"):
        load_flax_checkpoint(path)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "checkpoint_1"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointFormatError, match="not a regular file"):
        load_flax_checkpoint(fifo)
