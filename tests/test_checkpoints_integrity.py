"""checkpoints: what you restore is what you saved, or a clear error; nothing good is lost.

One test (or more) per defect of issue 11, each stating the promise it keeps.
"""

import enum
import fractions
import json
import os
import subprocess
import sys
import threading
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints import CheckpointFormatError, CheckpointManager
from eqx_train.checkpoints.format import _format, _reader
from eqx_train.checkpoints.pipeline import _restore
from tests.support.helpers import assert_trees_equal, latest_path, xla_flags

# ---------------------------------------------------------------- helpers


def open_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def save_bytes(path, data):
    with open(path, "wb") as f:
        f.write(bytes(data))


def read_header(path):
    with open(path, "rb") as f:
        data = f.read()
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def write_header(path, header, body):
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + body)


def edit_header(path, edit):
    header, body = read_header(path)
    edit(header)
    write_header(path, header, body)


def reseal(meta):
    """Recomputes the metadata checksums, as a crafted (not a corrupted) file would."""
    import xxhash

    sums = json.loads(meta["eqx_train.checksums"])
    sums["metadata"] = {
        k: xxhash.xxh3_64_hexdigest(v.encode())
        for k, v in meta.items()
        if k != "eqx_train.checksums"
    }
    meta["eqx_train.checksums"] = json.dumps(sums)


def edit_description(path, edit, *, fix_checksum=True):
    """Edits the tree description in place; by default re-seals its checksum (so only the
    description's own validation can catch the edit)."""

    def change(header):
        meta = header["__metadata__"]
        tree = json.loads(meta["eqx_train.tree"])
        tree = edit(tree)
        meta["eqx_train.tree"] = json.dumps(tree)
        if fix_checksum:
            reseal(meta)

    edit_header(path, change)


TREE = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(4, dtype=np.int64)}

# ---------------------------------------------------------------- 1. one file handle


def test_restore_racing_an_overwrite_of_the_same_step_returns_one_version(tmp_path, monkeypatch):
    old = {"a": np.full((4,), 1.0, np.float32), "b": np.full((8,), 2, np.int32)}
    new = {"a": np.full((64,), 3.0, np.float32), "b": np.full((2,), 4, np.int32)}
    checkpoints.save_checkpoint(tmp_path, old, 1)
    parse = _reader.FileReader._parse
    raced = []

    def parse_then_overwrite(self):
        parse(self)  # the header of the old file is read...
        if not raced:  # ...then a save replaces the file before the tensors are read
            raced.append(True)
            checkpoints.save_checkpoint(tmp_path, new, 1, overwrite=True)

    monkeypatch.setattr(_reader.FileReader, "_parse", parse_then_overwrite)
    restored = checkpoints.restore_checkpoint(tmp_path, None)
    assert raced
    assert_trees_equal(restored, old)
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, None), new)


# ---------------------------------------------------------------- 2. one step, one name


@pytest.mark.parametrize(
    ("first", "second", "name"),
    [
        (1.0, 1, "checkpoint_1.safetensors"),
        (-0.0, 0, "checkpoint_0.safetensors"),
        (1e16, 10**16, "checkpoint_10000000000000000.safetensors"),
        (np.int64(7), 7.0, "checkpoint_7.safetensors"),
    ],
)
def test_equal_steps_share_one_name_and_overwrite_keeps_the_new_save(tmp_path, first, second, name):
    checkpoints.save_checkpoint(tmp_path, {"v": np.asarray(1)}, first)
    with pytest.raises(ValueError, match="not newer"):
        checkpoints.save_checkpoint(tmp_path, {"v": np.asarray(2)}, second)
    path = checkpoints.save_checkpoint(tmp_path, {"v": np.asarray(2)}, second, overwrite=True)
    assert os.listdir(tmp_path) == [name] and path.endswith(name)
    assert checkpoints.restore_checkpoint(tmp_path, None)["v"] == 2


def test_an_old_spelling_of_the_step_is_replaced_not_preferred(tmp_path):
    # Earlier versions wrote step 1.0 as "checkpoint_1.0.safetensors".
    checkpoints.save_checkpoint(tmp_path, {"v": np.asarray(1)}, 1)
    os.rename(tmp_path / "checkpoint_1.safetensors", tmp_path / "checkpoint_1.0.safetensors")
    assert checkpoints.available_steps(tmp_path) == [1]
    checkpoints.save_checkpoint(tmp_path, {"v": np.asarray(2)}, 1, overwrite=True)
    assert os.listdir(tmp_path) == ["checkpoint_1.safetensors"]
    assert checkpoints.restore_checkpoint(tmp_path, None)["v"] == 2


def test_manager_latest_is_the_overwriting_save(tmp_path):
    manager = CheckpointManager(tmp_path, keep_latest=2)
    manager.save(0.5, {"v": np.asarray(0)})
    manager.save(1.0, {"v": np.asarray(1)})
    manager.save(1, {"v": np.asarray(2)}, overwrite=True)
    assert manager.all_steps() == [0.5, 1]
    restored: Any = manager.restore(None)  # the tree as saved
    assert restored["v"] == 2


def test_a_concurrent_save_of_the_same_step_is_never_clobbered(tmp_path, monkeypatch):
    write_file = _format.write_file
    raced = []

    def write_while_another_process_saves(fd, tensors, metadata):
        if not raced:  # another save of step 2 commits while ours is writing
            raced.append(True)
            checkpoints.save_checkpoint(tmp_path, {"v": np.asarray(-2)}, 2)
        write_file(fd, tensors, metadata)

    monkeypatch.setattr(_format, "write_file", write_while_another_process_saves)
    with pytest.raises(ValueError, match="appeared .* while this save was writing"):
        checkpoints.save_checkpoint(tmp_path, {"v": np.asarray(2)}, 2)
    assert os.listdir(tmp_path) == ["checkpoint_2.safetensors"]  # no temporary left either
    assert checkpoints.restore_checkpoint(tmp_path, None)["v"] == -2


# ---------------------------------------------------------------- 3. reserved names


def test_reserved_metadata_key_is_refused_before_anything_is_written_or_deleted(tmp_path):
    checkpoints.save_checkpoint(tmp_path, TREE, 1, keep=1)
    with pytest.raises(ValueError, match="'__metadata__' is reserved"):
        checkpoints.save_checkpoint(tmp_path, {"__metadata__": np.ones(2)}, 2, keep=1)
    assert os.listdir(tmp_path) == ["checkpoint_1.safetensors"]
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, None), TREE)


def test_a_key_that_is_not_valid_utf8_is_refused_by_name_before_anything_is_written(tmp_path):
    # os.listdir and friends decode undecodable file names to lone surrogates; a safetensors
    # header is UTF-8, so such a key cannot be stored, and the error says which and why.
    checkpoints.save_checkpoint(tmp_path, TREE, 1, keep=1)
    with pytest.raises(ValueError, match=r"tensor name 'run_\\udcff\.w' is not valid UTF-8"):
        checkpoints.save_checkpoint(tmp_path, {"run_\udcff": {"w": np.ones(2)}}, 2, keep=1)
    assert os.listdir(tmp_path) == ["checkpoint_1.safetensors"]


def test_errors_through_the_manager_name_the_manager(tmp_path):
    manager = CheckpointManager(tmp_path)
    with pytest.raises(ValueError, match=r"^CheckpointManager\.save: the tensor name"):
        manager.save(1, {"__metadata__": np.ones(2)})
    with pytest.raises(TypeError, match=r"^CheckpointManager\.save: leaf 'c'"):
        manager.save(1, {"c": np.zeros(2, "datetime64[s]")})
    with pytest.raises(ValueError, match=r"^CheckpointManager\.save: step must be >= 0"):
        manager.save(-1, TREE)


# ---------------------------------------------------------------- 4. empty containers


def test_empty_containers_come_back_as_empty_containers(tmp_path):
    w = np.ones(3, np.float32)
    params = {"w": w}
    opt_state = optax.sgd(0.1).init(params)
    tree = {"w": w, "empty": {}, "nothing": [], "unit": (), "opt": opt_state}
    checkpoints.save_checkpoint(tmp_path, tree, 1)
    restored = checkpoints.restore_checkpoint(tmp_path, None)
    assert restored["empty"] == {} and restored["nothing"] == [] and restored["unit"] == ()
    assert restored["opt"] == ({}, {})  # optax EmptyState()s, as flax gives {}
    np.testing.assert_array_equal(restored["w"], w)
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, tree), tree)


# ---------------------------------------------------------------- 5, 6. Python scalars


@pytest.mark.parametrize(
    ("saved", "target"),
    [(0.9, 0), (2**62 + 1, 0.0), (2, True), (float("nan"), 0), (np.float32(0.5), 1)],
    ids=["float-into-int", "big-int-into-float", "int-into-bool", "nan-into-int", "f32-int"],
)
def test_python_scalar_target_gets_the_exact_value_or_an_error_naming_the_leaf(
    tmp_path, saved, target
):
    checkpoints.save_checkpoint(tmp_path, {"x": saved}, 1)
    for strict in (True, False):
        with pytest.raises(ValueError, match=r"'x': the file holds"):
            checkpoints.restore_checkpoint(tmp_path, {"x": target}, strict=strict)


@pytest.mark.parametrize(
    ("saved", "target", "expected"),
    [(3, 0.0, 3.0), (3.0, 0, 3), (True, False, True), (np.int8(-4), 0, -4), (1e300, 0.0, 1e300)],
)
def test_python_scalar_target_takes_values_that_convert_exactly(tmp_path, saved, target, expected):
    checkpoints.save_checkpoint(tmp_path, {"x": saved}, 1)
    restored = checkpoints.restore_checkpoint(tmp_path, {"x": target})["x"]
    assert restored == expected and type(restored) is type(target)


class Color(enum.IntEnum):
    RED = 3


def test_int_subclass_leaf_is_saved_as_an_integer(tmp_path):
    checkpoints.save_checkpoint(tmp_path, {"c": Color.RED, "big": 2**62 + 1}, 1)
    header, _ = read_header(latest_path(tmp_path))
    assert header["c"]["dtype"] == "I64"
    as_saved = checkpoints.restore_checkpoint(tmp_path, None)
    assert as_saved == {"c": 3, "big": 2**62 + 1} and type(as_saved["c"]) is int
    restored = checkpoints.restore_checkpoint(tmp_path, {"c": Color.RED, "big": 0})
    assert restored["c"] is Color.RED and restored["big"] == 2**62 + 1


# ---------------------------------------------------------------- 7. .shards indexes


def _sharded(tmp_path):
    path = checkpoints.save_checkpoint_multiprocess(tmp_path, TREE, 1)
    return path, os.path.join(path, "index.safetensors")


def _edit_arrays(index_path, edit, *, fix_checksum=True):
    def change(header):
        meta = header["__metadata__"]
        arrays = json.loads(meta["eqx_train.arrays"])
        edit(arrays)
        meta["eqx_train.arrays"] = json.dumps(arrays)
        if fix_checksum:
            reseal(meta)

    edit_header(index_path, change)


def test_a_corrupted_shards_index_fails_its_checksum(tmp_path):
    path, index = _sharded(tmp_path)
    _edit_arrays(index, lambda a: _piece(a).update(tensor="b#0.0"), fix_checksum=False)
    with pytest.raises(CheckpointFormatError, match="'eqx_train.arrays' fails its checksum"):
        checkpoints.restore_checkpoint(path, None)


def _piece(arrays, name="a"):
    return arrays[name]["pieces"][0]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda a: _piece(a).update(file="/etc/passwd"), "not a piece file name"),
        (lambda a: _piece(a).update(file="../checkpoint_1.safetensors"), "not a piece file name"),
        (lambda a: _piece(a).update(file="process_00000.safetensors"), "is missing"),
        (lambda a: _piece(a).update(index=[[0, 1], [0, 3]]), "pieces hold 3 of its 6"),
        (lambda a: _piece(a).update(index=[[0, 2], [0, 4]]), "invalid bounds"),
        (lambda a: a["a"].update(shape=[10**12, 3]), "pieces hold 6 of its 3000000000000"),
        (lambda a: a["a"].update(shape=[4, 3]), "pieces hold 6 of its 12"),
        (lambda a: a["a"]["pieces"].append(dict(_piece(a))), "pieces hold 12 of its 6"),
        (lambda a: a["a"].update(dtype="F64"), "is not in process_00000"),
        (lambda a: _piece(a).update(tensor="b#0.0"), "cites one piece for two places"),
        (lambda a: _piece(a).update(tensor="zz#0.0"), "is not in process_00000"),
        (lambda a: a["a"].update(pieces="x"), "no pieces"),
        (lambda a: a.update(a=[1]), "malformed entry"),
    ],
    ids=[
        "absolute-file",
        "dotdot-file",
        "missing-file",
        "gap",
        "piece-outside-array",
        "huge-shape",
        "shape-not-tiled",
        "overlap",
        "dtype",
        "piece-cited-twice",
        "no-such-tensor",
        "pieces-not-list",
        "entry-not-dict",
    ],
)
def test_a_crafted_shards_index_is_refused_before_reading_or_allocating(tmp_path, edit, message):
    path, index = _sharded(tmp_path)
    _edit_arrays(index, edit)
    with pytest.raises(CheckpointFormatError, match=message):
        checkpoints.restore_checkpoint(path, None)
    with pytest.raises(CheckpointFormatError, match=message):
        checkpoints.restore_checkpoint(path, TREE)


def test_overlapping_pieces_that_still_sum_to_the_volume_are_refused(tmp_path):
    tree = {"a": np.arange(8, dtype=np.float32)}
    path = checkpoints.save_checkpoint_multiprocess(tmp_path, tree, 1)

    def split_badly(arrays):
        whole = arrays["a"]["pieces"][0]
        arrays["a"]["pieces"] = [
            dict(whole, index=[[0, 4]]),
            dict(whole, index=[[2, 6]]),  # overlaps [2, 4) and leaves [6, 8) uncovered
        ]

    _edit_arrays(os.path.join(path, "index.safetensors"), split_badly)
    with pytest.raises(CheckpointFormatError):
        checkpoints.restore_checkpoint(path, None)


# ---------------------------------------------------------------- 8. crafted single files


def _crafted(tmp_path, header, body=b""):
    path = tmp_path / "checkpoint_1.safetensors"
    write_header(path, header, body)
    return path


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"a": ["F32", [1], [0, 4]]}, "malformed entry"),
        ({"a": {"dtype": "F32", "shape": [1]}}, "malformed entry"),
        ({"a": {"dtype": "F32", "shape": [10**30], "data_offsets": [0, 4]}}, "invalid shape"),
        ({"a": {"dtype": "F32", "shape": [0, 2**70], "data_offsets": [0, 0]}}, "invalid shape"),
        ({"a": {"dtype": "F32", "shape": [0, 2**61], "data_offsets": [0, 0]}}, "invalid shape"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, "claims bytes"),
        ({"a": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}}, "invalid shape"),
        ({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, "invalid shape"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 1e400]}}, "data offsets"),
        ({"a": {"dtype": 5, "shape": [1], "data_offsets": [0, 4]}}, "unsupported dtype"),
        ({"a": {"dtype": "C128", "shape": [1], "data_offsets": [0, 4]}}, "unsupported dtype"),
        ({"__metadata__": {"k": 1}}, "map strings to strings"),
        ({"__metadata__": []}, "map strings to strings"),
        ([1, 2], "not a JSON object"),
    ],
)
def test_crafted_headers_raise_a_short_format_error(tmp_path, header, message):
    path = _crafted(tmp_path, header, b"\0" * 4)
    with pytest.raises(CheckpointFormatError, match=message) as info:
        checkpoints.restore_checkpoint(path, None)
    assert str(path) in str(info.value) and len(str(info.value)) < 400


def test_deeply_nested_header_json_is_a_format_error_not_a_recursion_error(tmp_path):
    path = tmp_path / "checkpoint_1.safetensors"
    raw = b"[" * 100_000 + b" " * 800_000 + b"]" * 100_000  # padded: not merely dense
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)
    with pytest.raises(CheckpointFormatError, match="nested too deeply"):
        checkpoints.restore_checkpoint(path, None)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: {"list": [t, t]}, "twice"),
        (lambda t: {"dict": [["a", {"tensor": "zz", "kind": "array"}]]}, "lacks"),
        (lambda t: {"dict": [["a", {"tensor": "a", "kind": "mystery"}]]}, "invalid tensor"),
        (lambda t: {"weird": 1}, "invalid entry"),
        (lambda t: {"dict": [[["k"], None]]}, "invalid dict item"),
        (lambda t: {"dict": [["a", None], ["a", None]]}, "repeated key"),
        (lambda t: {"dict": [["x", {"tensor": "a", "kind": "int"}], ["b", None]]}, "int leaf"),
        (lambda t: _nest(t, 250), "nested more than"),
    ],
    ids=[
        "named-twice",
        "names-missing",
        "unknown-kind",
        "unknown-entry",
        "bad-key",
        "dup-key",
        "scalar-kind-shape",
        "deep",
    ],
)
def test_a_bad_tree_description_is_a_format_error(tmp_path, edit, message):
    checkpoints.save_checkpoint(tmp_path, TREE, 1)
    path = latest_path(tmp_path)
    edit_description(path, edit)
    with pytest.raises(CheckpointFormatError, match=message):
        checkpoints.restore_checkpoint(path, None)


def _nest(tree, depth):
    for _ in range(depth):
        tree = {"list": [tree]}
    return tree


# ---------------------------------------------------------------- 9. non-regular files


def _within(seconds, fn):
    result = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as error:
            result["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "hung"
    if "error" in result:
        raise result["error"]
    return result["value"]


def test_a_fifo_under_a_checkpoint_name_never_hangs_restore(tmp_path):
    checkpoints.save_checkpoint(tmp_path, TREE, 1)
    fifo = tmp_path / "checkpoint_2.safetensors"
    os.mkfifo(fifo)
    assert latest_path(tmp_path).endswith("checkpoint_1.safetensors")
    assert_trees_equal(_within(10, lambda: checkpoints.restore_checkpoint(tmp_path, None)), TREE)
    with pytest.raises(CheckpointFormatError, match="not a regular file"):
        _within(10, lambda: checkpoints.restore_checkpoint(fifo, None))


def test_a_directory_under_a_checkpoint_name_is_not_a_checkpoint(tmp_path):
    (tmp_path / "checkpoint_5.safetensors").mkdir()
    (tmp_path / "checkpoint_6.shards").mkdir()
    assert checkpoints.latest_checkpoint(tmp_path) is None
    assert checkpoints.restore_checkpoint(tmp_path, "target") == "target"
    checkpoints.save_checkpoint(tmp_path, TREE, 1, keep=1)
    assert (tmp_path / "checkpoint_5.safetensors").is_dir()  # not counted, not deleted


# ---------------------------------------------------------------- 10, 11. names and litter


@pytest.mark.parametrize("prefix", ["../up_", "a/b_", "/abs_", ".hidden_", "ck1", "x\0"])
def test_a_prefix_that_could_leave_the_directory_or_be_misread_is_refused(tmp_path, prefix):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(ValueError, match="invalid prefix"):
        checkpoints.save_checkpoint(tmp_path / "ckpt", TREE, 1, prefix=prefix)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"] and os.listdir(tmp_path / "ckpt") == []


def test_a_shorter_prefix_never_reads_a_longer_prefix_files_as_signed_steps(tmp_path):
    checkpoints.save_checkpoint(tmp_path, TREE, 5, prefix="ck-")
    assert checkpoints.latest_checkpoint(tmp_path, prefix="ck") is None
    checkpoints.save_checkpoint(tmp_path, TREE, 1, prefix="ck", keep=1)
    checkpoints.save_checkpoint(tmp_path, TREE, 2, prefix="ck", keep=1)
    assert sorted(os.listdir(tmp_path)) == ["ck-5.safetensors", "ck2.safetensors"]
    assert checkpoints.available_steps(tmp_path, prefix="ck-") == [5]


def test_negative_steps_are_refused(tmp_path):
    with pytest.raises(ValueError, match="step must be >= 0"):
        checkpoints.save_checkpoint(tmp_path, TREE, -5)
    assert os.listdir(tmp_path) == []


def test_retention_never_deletes_directories_it_did_not_write(tmp_path):
    for name in ("checkpoint_1.shards", "checkpoint_2.safetensors"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "my_notes.txt").write_text("precious")
    for step in (3, 4, 5):
        checkpoints.save_checkpoint(tmp_path, TREE, step, keep=1)
    for name in ("checkpoint_1.shards", "checkpoint_2.safetensors"):
        assert (tmp_path / name / "my_notes.txt").read_text() == "precious"
    assert checkpoints.available_steps(tmp_path) == [5]


def test_retention_of_a_shards_checkpoint_leaves_foreign_files_alone(tmp_path):
    path = checkpoints.save_checkpoint_multiprocess(tmp_path, TREE, 1)
    with open(os.path.join(path, "README"), "w") as f:
        f.write("mine")
    checkpoints.save_checkpoint(tmp_path, TREE, 2, keep=1)
    assert os.listdir(path) == ["README"]  # ours removed (index first), the user's kept
    assert checkpoints.available_steps(tmp_path) == [2]


# ---------------------------------------------------------------- 12. leftovers of dead writers


def _dead_pid():
    return 2**22 + 12345  # above the kernel's default pid_max: no such process


def test_every_save_removes_dead_writers_temporaries_of_its_prefix_only(tmp_path):
    from eqx_train.checkpoints.format import _names

    host = _names.host_id()
    dead = f".checkpoint_3.safetensors.tmp-{host}-{_dead_pid()}-{'a' * 16}"
    old_style = f".checkpoint_3.safetensors.tmp-{_dead_pid()}-{'b' * 32}"
    live = f".checkpoint_4.safetensors.tmp-{host}-{os.getpid()}-{'c' * 16}"
    other_host = f".checkpoint_4.safetensors.tmp-{'0' * 8}-{_dead_pid()}-{'d' * 16}"
    other_prefix = f".run_3.safetensors.tmp-{host}-{_dead_pid()}-{'e' * 16}"
    for name in (dead, old_style, live, other_host, other_prefix):
        (tmp_path / name).write_bytes(b"x" * 100)
    checkpoints.save_checkpoint(tmp_path, TREE, 1)
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["checkpoint_1.safetensors", live, other_host, other_prefix]
    )


def test_async_saves_remove_dead_writers_temporaries_too(tmp_path):
    from eqx_train.checkpoints.format import _names

    dead = f".checkpoint_3.safetensors.tmp-{_names.host_id()}-{_dead_pid()}-{'a' * 16}"
    (tmp_path / dead).write_bytes(b"x")
    manager = checkpoints.AsyncManager()
    checkpoints.save_checkpoint(tmp_path, TREE, 1, async_manager=manager)
    manager.wait_previous_save()
    assert os.listdir(tmp_path) == ["checkpoint_1.safetensors"]


def test_uncommitted_shards_directories_of_dead_writers_are_removed(tmp_path):
    from eqx_train.checkpoints.format import _names

    token = f"{_names.host_id()}-{_dead_pid()}-{'f' * 16}"
    stale = tmp_path / "checkpoint_9.shards"
    stale.mkdir()
    (stale / _names.piece_file(0, token)).write_bytes(b"x")
    (stale / _names.done_marker(0, token)).write_bytes(b"")
    checkpoints.save_checkpoint(tmp_path, TREE, 1)
    assert os.listdir(tmp_path) == ["checkpoint_1.safetensors"]


# ---------------------------------------------------------------- 14. unreadable checkpoints


def test_an_unreadable_checkpoint_never_blocks_the_manager(tmp_path):
    manager = CheckpointManager(tmp_path, keep_latest=1, keep_best=1, best_metric="loss")
    manager.save(1, TREE, metrics={"loss": 0.5})
    manager.save(2, TREE, metrics={"loss": 0.9})
    (tmp_path / "checkpoint_2.safetensors").write_bytes(b"garbage")
    with pytest.warns(UserWarning, match=r"checkpoint_2\.safetensors"):
        manager.save(3, TREE, metrics={"loss": 0.7})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager.save(4, TREE, metrics={"loss": 0.8})
    assert manager.all_steps() == [1, 4]  # the best (1) and the latest; 2 and 3 pruned
    assert manager.best_step() == 1


# ---------------------------------------------------------------- 15. restore racing retention


def test_restore_racing_a_keep_1_save_retries_on_the_newer_checkpoint(tmp_path, monkeypatch):
    checkpoints.save_checkpoint(tmp_path, {"v": np.asarray(1)}, 1, keep=1)
    resolve = _restore._resolve
    calls = []

    def resolve_then_save(*args):
        found = resolve(*args)
        if not calls:  # between listing and opening, a keep=1 save replaces step 1 by 2
            checkpoints.save_checkpoint(tmp_path, {"v": np.asarray(2)}, 2, keep=1)
        calls.append(found)
        return found

    monkeypatch.setattr(_restore, "_resolve", resolve_then_save)
    assert checkpoints.restore_checkpoint(tmp_path, None)["v"] == 2
    assert len(calls) == 2


# ---------------------------------------------------------------- 16. flax's AsyncManager


def test_async_manager_exposes_save_future_as_flax_does(tmp_path):
    from concurrent.futures import Future

    manager = checkpoints.AsyncManager()
    assert manager.save_future is None
    checkpoints.save_checkpoint(tmp_path, TREE, 1, async_manager=manager)
    assert isinstance(manager.save_future, Future)
    manager.save_future.result(timeout=60)
    assert checkpoints.available_steps(tmp_path) == [1]
    manager.wait_previous_save()
    assert manager.save_future.done()


# ---------------------------------------------------------------- integrity checks


def test_a_flipped_byte_in_tensor_data_is_caught_and_verify_false_opts_out(tmp_path):
    checkpoints.save_checkpoint(tmp_path, TREE, 1)
    path = latest_path(tmp_path)
    data = bytearray(open_bytes(path))
    data[-1] ^= 0x01  # the last byte of tensor 'b'
    save_bytes(path, data)
    for target in (None, TREE):
        with pytest.raises(CheckpointFormatError, match="tensor 'b' fails its checksum"):
            checkpoints.restore_checkpoint(tmp_path, target)
    unchecked = checkpoints.restore_checkpoint(tmp_path, None, verify=False)
    assert unchecked["b"][-1] != TREE["b"][-1]
    # Restoring only the intact leaf still works with verification on.
    with pytest.warns(checkpoints.PartialRestoreWarning, match="'b'"):
        partial = checkpoints.restore_checkpoint(tmp_path, {"a": TREE["a"]}, strict=False)
    np.testing.assert_array_equal(partial["a"], TREE["a"])


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: h.update(c=h.pop("b")),  # a typo'd tensor name
        lambda h: h["a"].update(dtype="I32"),  # same bytes, another dtype
        lambda h: h["a"].update(shape=[3, 2]),  # same bytes, another shape
        lambda h: h["a"].update(data_offsets=h["b"]["data_offsets"], dtype="I64", shape=[3]),
    ],
    ids=["renamed", "dtype", "shape", "offsets"],
)
def test_header_edits_are_caught(tmp_path, edit):
    tree = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(3, dtype=np.int64)}
    checkpoints.save_checkpoint(tmp_path, tree, 1)
    path = latest_path(tmp_path)
    edit_header(path, edit)
    with pytest.raises(CheckpointFormatError):
        checkpoints.restore_checkpoint(path, None)
    with pytest.raises((CheckpointFormatError, ValueError)):
        checkpoints.restore_checkpoint(path, tree)


def test_an_edited_tree_description_fails_its_checksum(tmp_path):
    checkpoints.save_checkpoint(tmp_path, TREE, 1)
    path = latest_path(tmp_path)
    edit_description(path, lambda t: {"tuple": t["dict"]}, fix_checksum=False)
    with pytest.raises(CheckpointFormatError, match="tree description fails its checksum"):
        checkpoints.restore_checkpoint(path, None)


def test_files_without_checksums_still_restore(tmp_path):
    checkpoints.save_checkpoint(tmp_path, TREE, 1)
    path = latest_path(tmp_path)
    edit_header(path, lambda h: h["__metadata__"].pop("eqx_train.checksums"))
    assert_trees_equal(checkpoints.restore_checkpoint(path, None), TREE)


def test_old_files_that_recorded_empty_containers_as_skipped_restore_them_empty(tmp_path):
    checkpoints.save_checkpoint(tmp_path, {"w": TREE["a"], "e": {}}, 1)
    path = latest_path(tmp_path)
    edit_description(
        path, lambda t: {"dict": [["w", dict(t["dict"])["w"]], ["e", {"skipped": "dict"}]]}
    )
    assert checkpoints.restore_checkpoint(path, None)["e"] == {}


def test_plain_safetensors_readers_open_new_files(tmp_path):
    from safetensors.numpy import load_file

    checkpoints.save_checkpoint(tmp_path, TREE, 1)
    loaded = load_file(latest_path(tmp_path))
    assert_trees_equal(loaded, TREE)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=["e4m3fn", "e5m2"])
def test_float8_round_trips_bit_exactly(tmp_path, dtype):
    raw = np.arange(256, dtype=np.uint8)
    tree = {"x": raw.view(dtype).reshape(16, 16), "j": jnp.asarray(raw.view(dtype)[:8])}
    checkpoints.save_checkpoint(tmp_path, tree, 1)
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, None)["x"], tree["x"])
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, tree), tree)


def test_the_package_never_imports_safetensors():
    code = (
        "import sys, eqx_train, eqx_train.checkpoints, eqx_train.checkpoints._api\n"
        "assert 'safetensors' not in sys.modules, 'safetensors imported'\n"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, env={**os.environ, "XLA_FLAGS": xla_flags()}
    )


def test_sharded_checkpoint_pieces_are_verified(tmp_path):
    tree = {"a": np.ones((2, 3), np.float32), "b": np.arange(8, dtype=np.int32)}
    path = checkpoints.save_checkpoint_multiprocess(tmp_path, tree, 1)
    (piece,) = [n for n in os.listdir(path) if n.startswith("process_")]
    data = bytearray(open_bytes(os.path.join(path, piece)))
    data[-1] ^= 0x80
    save_bytes(os.path.join(path, piece), data)
    with pytest.raises(CheckpointFormatError, match="fails its checksum"):
        checkpoints.restore_checkpoint(path, None)
    mesh = jax.make_mesh((8,), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    target = {
        "a": jax.ShapeDtypeStruct((2, 3), np.float32),
        "b": jax.ShapeDtypeStruct((8,), np.int32, sharding=sharding),
    }
    with pytest.raises(CheckpointFormatError, match="fails its checksum"):
        checkpoints.restore_checkpoint(path, target)


# ---------------------------------------------------------------- found by red-teaming


def test_two_interleaved_overwrites_of_a_shards_step_leave_one_readable_version(tmp_path):
    from eqx_train.checkpoints.pipeline import _multiprocess

    save = checkpoints.save_checkpoint_multiprocess
    save(tmp_path, {"w": np.full(2, 0.0)}, 5)
    collect = _multiprocess._collect_index

    def another_overwrite_commits_meanwhile(*args, **kwargs):
        _multiprocess._collect_index = collect
        out = collect(*args, **kwargs)
        save(tmp_path, {"w": np.full(2, 1.0)}, 5, overwrite=True)
        return out

    _multiprocess._collect_index = another_overwrite_commits_meanwhile
    try:
        save(tmp_path, {"w": np.full(2, 2.0)}, 5, overwrite=True)
    finally:
        _multiprocess._collect_index = collect
    assert checkpoints.restore_checkpoint(tmp_path, None)["w"].tolist() == [2.0, 2.0]


def test_restore_racing_a_shards_overwrite_returns_one_version(tmp_path, monkeypatch):
    from eqx_train.checkpoints.format import _shards

    save = checkpoints.save_checkpoint_multiprocess
    save(tmp_path, {"w": np.full(2, 1.0)}, 1)
    open_piece = _shards.ShardedReader._file
    raced = []

    def overwrite_before_the_pieces_are_opened(self, name):
        if not raced:
            raced.append(True)
            save(tmp_path, {"w": np.full(2, 9.0)}, 1, overwrite=True)
        return open_piece(self, name)

    monkeypatch.setattr(_shards.ShardedReader, "_file", overwrite_before_the_pieces_are_opened)
    assert checkpoints.restore_checkpoint(tmp_path, None)["w"].tolist() == [9.0, 9.0]
    assert raced


def test_restore_racing_retention_of_a_shards_step_retries_on_the_newer(tmp_path, monkeypatch):
    save = checkpoints.save_checkpoint_multiprocess
    save(tmp_path, {"v": np.asarray(1)}, 1)
    resolve = _restore._resolve
    calls = []

    def resolve_then_save(*args):
        found = resolve(*args)
        if not calls:
            save(tmp_path, {"v": np.asarray(2)}, 2, keep=1)
        calls.append(found)
        return found

    monkeypatch.setattr(_restore, "_resolve", resolve_then_save)
    assert checkpoints.restore_checkpoint(tmp_path, None)["v"] == 2


def test_an_index_of_many_pieces_is_checked_quickly(tmp_path):
    import time

    path, index = _sharded(tmp_path)
    n = 20_000

    def many(arrays):
        arrays["a"] = {
            "shape": [1, n],
            "dtype": "F32",
            "pieces": [
                {"file": _piece(arrays)["file"], "tensor": f"t{i}", "index": [[0, 1], [i, i + 1]]}
                for i in range(n)
            ],
        }

    _edit_arrays(index, many)
    start = time.perf_counter()
    with pytest.raises(CheckpointFormatError):
        checkpoints.restore_checkpoint(path, None)
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize("prefix", ["ema_1.", "run_1e", "run_1e+", "v2-"])
def test_a_prefix_ending_like_a_number_is_refused(tmp_path, prefix):
    with pytest.raises(ValueError, match="invalid prefix"):
        checkpoints.save_checkpoint(tmp_path, TREE, 5, prefix=prefix)


def test_odd_names_in_the_way_of_cleanup_never_block_a_save(tmp_path):
    from eqx_train.checkpoints.format import _names

    host = _names.host_id()
    (tmp_path / f".checkpoint_5.safetensors.tmp-{host}-{_dead_pid()}-{'0' * 16}").mkdir()
    (tmp_path / f".checkpoint_5.safetensors.tmp-{host}-{10**20}-{'1' * 16}").write_text("x")
    checkpoints.save_checkpoint(tmp_path, TREE, 10)
    CheckpointManager(tmp_path)
    assert checkpoints.available_steps(tmp_path) == [10]


def test_crafted_trees_that_cannot_be_rebuilt_are_format_errors(tmp_path):
    checkpoints.save_checkpoint(tmp_path, {"k": jax.random.key(0)}, 1)
    path = latest_path(tmp_path)
    edit_description(path, lambda t: {"dict": [["k", dict(dict(t["dict"])["k"], impl="bogus")]]})
    with pytest.raises(CheckpointFormatError, match="cannot be rebuilt"):
        checkpoints.restore_checkpoint(path, None)
    edit_description(path, lambda t: {"dict": [["\ud800", dict(t["dict"])["k"]]]})
    with pytest.raises(CheckpointFormatError):
        checkpoints.restore_checkpoint(path, None)


@pytest.mark.parametrize(
    "leaf",
    [fractions.Fraction(1, 3), np.ma.array([1.0, 2.0], mask=[False, True])],
    ids=["fraction", "masked"],
)
def test_leaves_that_cannot_be_saved_faithfully_are_refused_naming_them(tmp_path, leaf):
    with pytest.raises(TypeError, match="leaf 'x'"):
        checkpoints.save_checkpoint(tmp_path, {"x": leaf}, 1)
    assert os.listdir(tmp_path) == []


def test_str_enum_keys_stay_strings(tmp_path):
    class Name(enum.StrEnum):
        ONE = "1"
        NAME = "name"

    tree = {Name.ONE: np.ones(1), Name.NAME: np.zeros(1)}
    checkpoints.save_checkpoint(tmp_path, tree, 1)
    assert sorted(checkpoints.restore_checkpoint(tmp_path, None)) == ["1", "name"]


def test_a_prng_key_of_another_implementation_is_a_mismatch(tmp_path):
    checkpoints.save_checkpoint(tmp_path, {"k": jax.random.key(0, impl="rbg")}, 1)
    with pytest.raises(ValueError, match="'k': file has a rbg PRNG key"):
        checkpoints.restore_checkpoint(tmp_path, {"k": jax.random.key(0, impl="unsafe_rbg")})


def test_an_implausibly_dense_header_is_refused_before_parsing(tmp_path):
    raw = b'{"x":[' + b"{}," * 400_000 + b"{}]}"
    raw += b" " * (-(8 + len(raw)) % 8)
    path = tmp_path / "checkpoint_1.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)
    with pytest.raises(CheckpointFormatError, match="far denser than any checkpoint"):
        checkpoints.restore_checkpoint(path, None)
