"""Every layout `eqx-train inspect` recognises restores through one matcher: a Hugging Face
`model.safetensors` or sharded index (as the directory or the file) goes into a changed
model with the same `strict`, `rename`, `casting` and plan as our own files; weights of
another kind are refused naming what they are and the call that reads them; no call
returns the target unchanged from a path holding weights."""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import zipfile
from typing import cast

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import msgpack
import numpy as np
import pytest
import safetensors.numpy

from eqx_train.checkpoints import (
    CheckpointFormatError,
    CheckpointManager,
    PartialRestoreWarning,
    plan_restore,
    restore_checkpoint,
    save_checkpoint,
)
from eqx_train.interop import (
    load_flax_checkpoint,
    load_orbax_checkpoint,
    load_sharded,
    save_sharded,
)

RNG = np.random.default_rng(0)
SAVED = {  # Hugging Face-style names, float32, as a pretrained encoder ships
    "encoder.fc1.weight": RNG.standard_normal((8, 4)).astype(np.float32),
    "encoder.fc1.bias": RNG.standard_normal(8).astype(np.float32),
    "encoder.fc2.weight": RNG.standard_normal((3, 8)).astype(np.float32),
    "encoder.fc2.bias": RNG.standard_normal(3).astype(np.float32),
}
RENAME = {"mlp.layers.0": "encoder.fc1", "mlp.layers.1": "encoder.fc2"}
NEW_HEAD = ["head.weight", "head.bias"]


class Model(eqx.Module):
    mlp: eqx.nn.MLP
    head: eqx.nn.Linear  # new: not in the pretrained weights


def _target() -> Model:
    k1, k2 = jax.random.split(jax.random.key(1))
    model = Model(eqx.nn.MLP(4, 3, 8, 1, key=k1), eqx.nn.Linear(3, 2, key=k2))
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, model)


def _write(tmp_path, layout: str) -> tuple[str, str]:
    """(the directory, its file: model.safetensors or the index) of the pretrained weights."""
    directory = tmp_path / "pretrained"
    if layout == "single":
        directory.mkdir()
        safetensors.numpy.save_file(SAVED, str(directory / "model.safetensors"), {"format": "pt"})
        return str(directory), str(directory / "model.safetensors")
    nested = {
        "encoder": {
            fc: {p: SAVED[f"encoder.{fc}.{p}"] for p in ("weight", "bias")} for fc in ("fc1", "fc2")
        }
    }
    save_sharded(directory, nested, max_shard_size=100)
    assert os.path.exists(directory / "model.safetensors.index.json")
    return str(directory), str(directory / "model.safetensors.index.json")


def _check_restored(restored: Model, target: Model) -> None:
    """The encoder from the file, cast to bfloat16 as NumPy casts; the new head untouched."""
    for i, fc in enumerate(("fc1", "fc2")):
        for part in ("weight", "bias"):
            leaf = getattr(restored.mlp.layers[i], part)
            assert leaf.dtype == jnp.bfloat16
            expected = SAVED[f"encoder.{fc}.{part}"].astype(ml_dtypes.bfloat16)
            np.testing.assert_array_equal(
                np.asarray(leaf).view(np.uint16), expected.view(np.uint16)
            )
    assert eqx.tree_equal(restored.head, target.head)


def _restore_quietly(call, *args, **kwargs):
    with pytest.warns(PartialRestoreWarning, match="2 target leaves kept"):
        return call(*args, **kwargs)


OPTIONS = {"rename": RENAME, "casting": "same_kind", "strict": False}


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("given", ["directory", "file"])
def test_hugging_face_weights_restore_into_a_renamed_bfloat16_bigger_model(tmp_path, layout, given):
    directory, file = _write(tmp_path, layout)
    path = directory if given == "directory" else file
    target = _target()
    plan = plan_restore(path, target, **OPTIONS)
    assert plan.ok and plan.kept == NEW_HEAD
    assert plan.taken == {
        f"mlp.layers.{i}.{p}": f"encoder.fc{i + 1}.{p}" for i in (0, 1) for p in ("weight", "bias")
    }
    assert all(after == jnp.bfloat16 for _, after in plan.cast.values()) and len(plan.cast) == 4
    _check_restored(_restore_quietly(restore_checkpoint, path, target, **OPTIONS), target)


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("given", ["directory", "file"])
def test_load_sharded_takes_the_same_options_and_match(tmp_path, layout, given):
    directory, file = _write(tmp_path, layout)
    target = _target()
    path = directory if given == "directory" else file
    _check_restored(_restore_quietly(load_sharded, path, target, **OPTIONS), target)


def test_load_sharded_refuses_a_mismatch_as_restore_checkpoint_does(tmp_path):
    directory, _ = _write(tmp_path, "sharded")
    with pytest.raises(
        ValueError,
        match=r"'mlp.layers.0.weight' \(from saved 'encoder.fc1.weight'.*"
        r"casting='same_kind' would allow it",
    ):
        load_sharded(directory, _target(), rename=RENAME, strict=False)


def test_checkpoint_manager_restores_a_hugging_face_directory_with_no_checkpoint_yet(tmp_path):
    directory, _ = _write(tmp_path, "sharded")
    target = _target()
    manager = CheckpointManager(directory)
    _check_restored(_restore_quietly(manager.restore, target, **OPTIONS), target)


def test_an_index_file_is_never_blamed_as_a_corrupt_header(tmp_path):
    _, index = _write(tmp_path, "sharded")
    renamed = tmp_path / "weights.json"  # an index under a name that says nothing
    renamed.write_bytes(pathlib.Path(index).read_bytes())
    with pytest.raises(CheckpointFormatError, match="is a JSON file") as caught:
        restore_checkpoint(str(renamed), _target(), **OPTIONS)
    assert "header" not in str(caught.value)
    assert "index.json" in str(caught.value)


def test_a_directory_of_hugging_face_weights_and_checkpoints_is_refused_as_ambiguous(tmp_path):
    directory, _ = _write(tmp_path, "single")
    save_checkpoint(directory, {"x": np.zeros(2)}, step=1)
    with pytest.raises(ValueError, match="holds both Hugging Face weights.*checkpoint_1"):
        restore_checkpoint(directory, _target(), **OPTIONS)


def test_an_empty_directory_still_returns_the_target_as_flax_does(tmp_path):
    target = _target()
    assert restore_checkpoint(str(tmp_path), target) is target


# ------------------------------------------------------------------ foreign weights refused


def _flax_bytes() -> bytes:
    kernel = SAVED["encoder.fc1.weight"]
    array = msgpack.ExtType(
        1, msgpack.packb(((8, 4), "float32", kernel.tobytes()), use_bin_type=True)
    )
    return cast(bytes, msgpack.packb({"params": {"Dense_0": {"kernel": array}}}, use_bin_type=True))


def _torch_zip(path) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps({}))


FOREIGN_FILES = {
    "flax": (lambda p: p.write_bytes(_flax_bytes()), "flax msgpack.*load_flax_checkpoint"),
    "pickle": (
        lambda p: p.write_bytes(pickle.dumps({"w": [1.0]}, protocol=2)),
        "Python pickle.*torch.load.*from_state_dict",
    ),
    "zip": (_torch_zip, "zip archive.*torch.load.*from_state_dict"),
}


@pytest.mark.parametrize("kind", sorted(FOREIGN_FILES))
def test_a_foreign_file_is_refused_naming_what_it_is_and_the_call_that_reads_it(tmp_path, kind):
    write, message = FOREIGN_FILES[kind]
    path = tmp_path / "checkpoint_1"
    write(path)
    for call in (restore_checkpoint, plan_restore) if kind != "flax" else (restore_checkpoint,):
        with pytest.raises(CheckpointFormatError, match=message):
            call(str(path), _target())


@pytest.mark.parametrize("first_byte", [0x80, 0x81, 0x8F, 0xDE])
def test_a_safetensors_header_error_is_not_blamed_on_a_pickle_or_msgpack(tmp_path, first_byte):
    # The length field's first byte is the header length's low byte: padded to that, a
    # safetensors file starts like a pickle or msgpack. Its header error is what is wrong.
    header = json.dumps({"w": {"dtype": "Q99", "shape": [1], "data_offsets": [0, 4]}}).encode()
    header += b" " * ((first_byte - len(header)) % 256)
    path = tmp_path / "weights.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    assert path.read_bytes()[0] == first_byte
    with pytest.raises(CheckpointFormatError, match="unsupported dtype") as caught:
        restore_checkpoint(path, None)
    assert type(caught.value) is CheckpointFormatError


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("checkpoint_7", _flax_bytes(), "flax msgpack checkpoints.*load_flax_checkpoint"),
        ("pytorch_model.bin", pickle.dumps({}, protocol=2), "PyTorch pickles.*torch.load"),
        ("ckpt_3.safetensors", None, "none of which is named 'checkpoint_<step>.safetensors'"),
    ],
    ids=["flax", "torch", "other-prefix"],
)
def test_a_directory_of_foreign_weights_never_returns_the_target_unchanged(
    tmp_path, name, content, message
):
    if content is None:
        save_checkpoint(str(tmp_path), {"x": np.zeros(2)}, step=3, prefix="ckpt_")
    else:
        (tmp_path / name).write_bytes(content)
    with pytest.raises(CheckpointFormatError, match=message):
        restore_checkpoint(str(tmp_path), _target())


FOREIGN_DIRECTORIES = [
    ("checkpoint_7", _flax_bytes(), "flax msgpack checkpoints.*load_flax_checkpoint"),
    ("flax_model.msgpack", _flax_bytes(), "flax msgpack checkpoints.*load_flax_checkpoint"),
    ("pytorch_model.bin", pickle.dumps({}, protocol=2), "PyTorch pickles.*torch.load"),
]


@pytest.mark.parametrize(
    "name, content, message", FOREIGN_DIRECTORIES, ids=["flax", "hf-flax", "torch"]
)
def test_a_foreign_directory_on_an_object_store_never_returns_the_target_unchanged(
    name, content, message
):
    import fsspec

    directory = f"memory://foreign-{name}"
    fsspec.filesystem("memory").pipe(f"{directory}/{name}", content)
    try:
        with pytest.raises(CheckpointFormatError, match=message):
            restore_checkpoint(directory, _target())
    finally:
        fsspec.filesystem("memory").rm(directory, recursive=True)


def test_a_hugging_face_flax_msgpack_is_refused_naming_load_flax_checkpoint(tmp_path):
    # What a Hugging Face repository holds beside (or instead of) model.safetensors.
    (tmp_path / "flax_model.msgpack").write_bytes(_flax_bytes())
    with pytest.raises(CheckpointFormatError, match="flax msgpack.*load_flax_checkpoint"):
        restore_checkpoint(str(tmp_path), _target())


def test_an_index_of_pytorch_shards_is_refused_naming_torch_load(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"metadata": {}, "weight_map": {"w": "pytorch_model-00001-of-00001.bin"}}'
    )
    with pytest.raises(CheckpointFormatError, match="PyTorch pickle shards.*torch.load"):
        restore_checkpoint(str(tmp_path), _target())


# ------------------------------------------------------------------ flax and Orbax, planned


def test_a_flax_file_loads_into_a_renamed_bfloat16_target_as_planned(tmp_path):
    path = tmp_path / "checkpoint_1"
    path.write_bytes(_flax_bytes())
    target = {"dense": {"weight": jnp.zeros((8, 4), jnp.bfloat16)}, "new": jnp.ones(2)}
    options = {"rename": {"dense.weight": "params.Dense_0.kernel"}, "casting": "same_kind"}
    plan = plan_restore(str(tmp_path), target, strict=False, **options)
    assert plan.call == "load_flax_checkpoint" and plan.ok and plan.kept == ["new"]
    assert str(plan).startswith("load_flax_checkpoint from")
    restored = _restore_quietly_one(load_flax_checkpoint, str(tmp_path), target, **options)
    expected = SAVED["encoder.fc1.weight"].astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(
        np.asarray(restored["dense"]["weight"]).view(np.uint16), expected.view(np.uint16)
    )
    assert restored["new"] is target["new"]


def _restore_quietly_one(call, *args, **kwargs):
    with pytest.warns(PartialRestoreWarning, match="1 target leaves kept"):
        return call(*args, strict=False, **kwargs)


def test_an_orbax_checkpoint_loads_into_a_renamed_bfloat16_target_as_planned(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    path = tmp_path / "orbax"
    ocp.PyTreeCheckpointer().save(path, {"params": {"kernel": SAVED["encoder.fc2.weight"]}})
    target = {"w": jnp.zeros((3, 8), jnp.bfloat16), "new": jnp.ones(2)}
    options = {"rename": {"w": "params.kernel"}, "casting": "same_kind"}
    with pytest.raises(CheckpointFormatError, match="load_orbax_checkpoint"):
        restore_checkpoint(str(path), target, strict=False, **options)
    plan = plan_restore(str(path), target, strict=False, **options)
    assert plan.call == "load_orbax_checkpoint" and plan.ok and plan.kept == ["new"]
    restored = _restore_quietly_one(load_orbax_checkpoint, str(path), target, **options)
    expected = SAVED["encoder.fc2.weight"].astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(
        np.asarray(restored["w"]).view(np.uint16), expected.view(np.uint16)
    )


# ------------------------------------------------------------------ transform= in every reader

KERNEL_IN_OUT = SAVED["encoder.fc1.weight"].T.copy()  # (4, 8): stored (in, out), as flax does


def _write_transposed(tmp_path, layout: str) -> str:
    """A path holding only KERNEL_IN_OUT, named `kernel`, in `layout`."""
    if layout == "hf-single":
        tmp_path.joinpath("hf").mkdir()
        path = tmp_path / "hf" / "model.safetensors"
        safetensors.numpy.save_file({"kernel": KERNEL_IN_OUT}, str(path), {"format": "pt"})
        return str(path)
    if layout == "hf-sharded":
        save_sharded(tmp_path / "hf", {"kernel": KERNEL_IN_OUT}, max_shard_size=64)
        return str(tmp_path / "hf")
    if layout == "flax":
        array = msgpack.ExtType(
            1, msgpack.packb(((4, 8), "float32", KERNEL_IN_OUT.tobytes()), use_bin_type=True)
        )
        (tmp_path / "checkpoint_1").write_bytes(msgpack.packb({"kernel": array}))
        return str(tmp_path)
    ocp = pytest.importorskip("orbax.checkpoint")
    ocp.PyTreeCheckpointer().save(tmp_path / "orbax", {"kernel": KERNEL_IN_OUT})
    return str(tmp_path / "orbax")


_LOADERS = {
    "hf-single": load_sharded,
    "hf-sharded": load_sharded,
    "flax": load_flax_checkpoint,
    "orbax": load_orbax_checkpoint,
}


@pytest.mark.parametrize("layout", list(_LOADERS))
def test_every_reader_applies_transform_before_the_cast_as_planned(tmp_path, layout):
    path = _write_transposed(tmp_path, layout)
    target = {"weight": jnp.zeros((8, 4), jnp.bfloat16)}
    options = {"rename": {"weight": "kernel"}, "casting": "same_kind"}
    plan = plan_restore(path, target, **options)
    assert not plan.ok and "permutation" in plan.problems[0]
    options["transform"] = {"weight": lambda a: a.T}
    plan = plan_restore(path, target, **options)
    assert plan.ok and plan.transformed == {"weight": ((4, 8), (8, 4))}
    restored = _LOADERS[layout](path, target, **options)
    expected = SAVED["encoder.fc1.weight"].astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(
        np.asarray(restored["weight"]).view(np.uint16), expected.view(np.uint16)
    )
    if layout.startswith("hf"):  # restore_checkpoint reads the same paths
        again = restore_checkpoint(path, target, **options)
        np.testing.assert_array_equal(np.asarray(again["weight"]), np.asarray(restored["weight"]))


def test_a_dangling_model_safetensors_link_is_an_error_not_the_target(tmp_path):
    # A Hugging Face cache snapshot whose blob never finished downloading.
    (tmp_path / "model.safetensors").symlink_to(tmp_path / "blobs" / "missing")
    for call in (restore_checkpoint, plan_restore):
        with pytest.raises(FileNotFoundError, match="model.safetensors"):
            call(str(tmp_path), _target())
