"""Multi-process checkpoints on `jax.distributed`: every process writes its own shards,
process 0 writes the index and commits; restore reads only the pieces each process needs.

Layout of a committed checkpoint (a directory, renamed into place atomically):

    {prefix}{step}.shards/
        index.safetensors          no tensors; metadata: tree, step, and for every array its
                                   global shape, dtype and pieces (file, tensor, slice)
        process_00000.safetensors  the pieces process 0 owns (plain safetensors)
        process_00001.safetensors  ...
"""

from __future__ import annotations

import json
import math
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from . import _files, _format
from ._async import AsyncManager

INDEX_NAME = "index.safetensors"
_PIECES_KEY = "eqx_train.pieces"
_ARRAYS_KEY = "eqx_train.arrays"
_POLL_S = 0.02


class BarrierTimeoutError(TimeoutError):
    """A multi-process checkpoint step waited longer than `timeout_s` for its peers."""


def _process_file(pid: int) -> str:
    return f"process_{pid:05d}{_files.SUFFIX}"


def _broadcast_token(timeout_s: float) -> str:
    """A random token chosen by process 0, the same on every process."""
    if jax.process_count() == 1:
        return secrets.token_hex(8)
    from jax.experimental import multihost_utils

    mine = np.frombuffer(secrets.token_bytes(8), dtype=np.uint32).copy()
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["token"] = np.asarray(multihost_utils.broadcast_one_to_all(mine))
        except BaseException as error:  # re-raised in the caller's thread
            result["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise BarrierTimeoutError(
            f"save_checkpoint_multiprocess: process {jax.process_index()} waited {timeout_s}s "
            "for the other processes to start the save; every process must call "
            "save_checkpoint_multiprocess with the same step."
        )
    if "error" in result:
        raise result["error"]
    return "".join(f"{int(v):08x}" for v in result["token"])


def _wait_until(pending: Callable[[], list[str]], timeout_s: float, what: str) -> None:
    """Polls until `pending()` (the paths still in the way) is empty, or raises
    BarrierTimeoutError naming them."""
    deadline = time.monotonic() + timeout_s
    while remaining := pending():
        if time.monotonic() > deadline:
            raise BarrierTimeoutError(
                f"save_checkpoint_multiprocess: waited {timeout_s}s for {what}; still waiting "
                f"on: {[os.path.basename(p) for p in remaining]}. A peer process probably "
                "died or never called save; the previous checkpoint is still the latest."
            )
        time.sleep(_POLL_S)


def _pieces_of(tensor: _format.TensorLeaf, pid: int) -> list[tuple[list[list[int]], Any]]:
    """The (index ranges, getter) pieces of one leaf that process `pid` writes."""
    source = tensor.source
    full = [[0, d] for d in tensor.shape]
    if isinstance(source, jax.Array) and not source.is_fully_addressable:
        pieces = []
        for shard in source.addressable_shards:
            if shard.replica_id != 0:
                continue  # another device holds the copy that gets written
            ranges = [
                [sl.start or 0, d if sl.stop is None else sl.stop]
                for sl, d in zip(shard.index, tensor.shape, strict=True)
            ]
            pieces.append((ranges, lambda data=shard.data: np.asarray(data)))
        return pieces
    return [(full, tensor.get)] if pid == 0 else []  # host-local leaves: process 0 writes


def save_checkpoint_multiprocess(
    ckpt_dir: str | os.PathLike[str],
    target: Any,
    step: int | float,
    prefix: str = "checkpoint_",
    keep: int = 1,
    overwrite: bool = False,
    keep_every_n_steps: int | float | None = None,
    async_manager: AsyncManager | None = None,
    *,
    timeout_s: float = 300.0,
) -> str:
    """Saves a checkpoint of arrays sharded over several processes; call it on every process.

    Each process writes only the shards it owns (a shard replicated on several devices is
    written once, by the device with `replica_id == 0`) into its own safetensors file, so
    no array is ever gathered. Host-local leaves (NumPy arrays, scalars, fully addressable
    arrays) are written by process 0. When every process's file is durable, process 0 writes
    the index (global shapes, dtypes, which file holds which slice, the tree description),
    renames the directory into place atomically, and applies retention. A process dying
    mid-save leaves the previous checkpoint as the latest; the others raise
    `BarrierTimeoutError` after `timeout_s` seconds instead of hanging.

    **Arguments:** as `save_checkpoint`, plus

    - `timeout_s`: how long a process waits for its peers at each synchronisation point.

    `ckpt_dir` must be the same shared directory on every process. Returns the path of the
    checkpoint directory, `{ckpt_dir}/{prefix}{step}.shards`.
    """
    return save_multiprocess_with_policy(
        ckpt_dir,
        target,
        step,
        prefix=prefix,
        overwrite=overwrite,
        retention=_files.flax_retention(keep, keep_every_n_steps, "save_checkpoint_multiprocess"),
        async_manager=async_manager,
        timeout_s=timeout_s,
        caller="save_checkpoint_multiprocess",
    )


def save_multiprocess_with_policy(
    ckpt_dir: str | os.PathLike[str],
    target: Any,
    step: int | float,
    *,
    prefix: str,
    overwrite: bool,
    retention: _files.Retention,
    async_manager: AsyncManager | None,
    timeout_s: float,
    caller: str,
    extra_metadata: dict[str, str] | None = None,
) -> str:
    """The multi-process save shared by `save_checkpoint_multiprocess` and
    `CheckpointManager`; `retention` runs on process 0 after the commit."""
    _files.check_step(step, caller)
    ckpt_dir = os.fspath(ckpt_dir)
    pid, count = jax.process_index(), jax.process_count()
    if async_manager is not None:
        async_manager.wait_previous_save()
    new_value = _files.check_newer(ckpt_dir, prefix, step, overwrite, caller)
    description, tensors = _format.describe(target, allow_global=True)
    token = _broadcast_token(timeout_s)
    os.makedirs(ckpt_dir, exist_ok=True)
    name = f"{prefix}{step}{_files.SHARDED_SUFFIX}"
    final_dir = os.path.join(ckpt_dir, name)
    temp_dir = os.path.join(ckpt_dir, f".{name}{_files.TEMP_MARK}{token}")
    commit_marker = os.path.join(ckpt_dir, f".{name}.committing-{token}")
    os.makedirs(temp_dir, exist_ok=True)

    pieces: list[_format.TensorLeaf] = []
    index: dict[str, dict[str, Any]] = {}  # piece tensor name -> its leaf and slice
    for tensor in tensors:
        for k, (ranges, get) in enumerate(_pieces_of(tensor, pid)):
            piece_name = f"{tensor.name}#{pid}.{k}"
            shape = tuple(b - a for a, b in ranges)
            pieces.append(_format.TensorLeaf(piece_name, get, tensor.dtype, shape))
            index[piece_name] = {"leaf": tensor.name, "index": ranges}
    if async_manager is not None:
        pieces = [_format.snapshot(p) for p in pieces]

    def write_and_commit() -> None:
        meta = {_PIECES_KEY: json.dumps(index)}
        header = _format.encode_header(pieces, meta)

        def write(fd: int) -> None:
            _format.write_all(fd, memoryview(header))
            _format.write_tensors(fd, pieces)

        _files.atomic_write(os.path.join(temp_dir, _process_file(pid)), write)
        _files.atomic_write(os.path.join(temp_dir, f"done_{pid:05d}"), lambda fd: None)
        if pid != 0:
            # Done when process 0 has renamed the (unique) temporary directory away and then,
            # after retention, removed the commit marker it created before the rename.
            _wait_until(
                lambda: [p for p in (temp_dir, commit_marker) if os.path.exists(p)],
                timeout_s,
                "process 0 to commit",
            )
            return
        done = [os.path.join(temp_dir, f"done_{i:05d}") for i in range(count)]
        _wait_until(
            lambda: [p for p in done if not os.path.exists(p)],
            timeout_s,
            "every process to write its shards",
        )
        _write_index(temp_dir, count, description, tensors, step, extra_metadata or {})
        _files.remove_files(done)
        _files.atomic_write(commit_marker, lambda fd: None)
        _commit_directory(temp_dir, final_dir)
        _files.apply_retention(
            ckpt_dir, prefix, new_value, overwrite=overwrite, retention=retention
        )
        _files.remove_files([commit_marker])

    if async_manager is not None:
        async_manager.save_async(write_and_commit)
    else:
        write_and_commit()
    return final_dir


def _write_index(
    temp_dir: str, count: int, description: Any, tensors: list, step: Any, extra: dict[str, str]
) -> None:
    arrays: dict[str, dict[str, Any]] = {
        t.name: {"shape": list(t.shape), "dtype": _format.dtype_code(t.dtype, t.name), "pieces": []}
        for t in tensors
    }
    for i in range(count):
        file_name = _process_file(i)
        header = _format.read_header(os.path.join(temp_dir, file_name))
        for tensor_name, piece in json.loads(header.metadata[_PIECES_KEY]).items():
            arrays[piece["leaf"]]["pieces"].append(
                {"file": file_name, "tensor": tensor_name, "index": piece["index"]}
            )
    for leaf, entry in arrays.items():
        covered = sum(math.prod(b - a for a, b in p["index"]) for p in entry["pieces"])
        if covered != math.prod(entry["shape"]):
            raise RuntimeError(
                f"save_checkpoint_multiprocess: the processes wrote {covered} of "
                f"{math.prod(entry['shape'])} elements of '{leaf}'; some shard has no owner."
            )
    metadata = {
        **_format.base_metadata(step, description),
        _ARRAYS_KEY: json.dumps(arrays, separators=(",", ":")),
        **extra,
    }
    header = _format.encode_header([], metadata)
    _files.atomic_write(
        os.path.join(temp_dir, INDEX_NAME),
        lambda fd: _format.write_all(fd, memoryview(header)),
    )


def _commit_directory(temp_dir: str, final_dir: str) -> None:
    parent = os.path.dirname(final_dir)
    if os.path.exists(final_dir):  # overwrite: move the old one aside first
        trash = f"{temp_dir}.old"
        os.replace(final_dir, trash)
        os.replace(temp_dir, final_dir)
        _files.remove_files([trash])
    else:
        os.replace(temp_dir, final_dir)
    _files.fsync_dir(parent)


# ------------------------------------------------------------------------------------ restore


def is_sharded_checkpoint(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, INDEX_NAME))


class ShardedReader:
    """Reads arrays of a multi-process checkpoint, or only the slices a device needs."""

    def __init__(self, directory: str):
        self.directory = directory
        self.index = _format.read_header(os.path.join(directory, INDEX_NAME))
        self.arrays: dict[str, dict[str, Any]] = json.loads(self.index.metadata[_ARRAYS_KEY])
        self._headers: dict[str, _format.Header] = {}

    def info(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
        entry = self.arrays[name]
        return tuple(entry["shape"]), _format._CODE_TO_DTYPE[entry["dtype"]]

    def _read_rows(self, piece: dict[str, Any], first: int, stop: int) -> np.ndarray:
        """Rows `[first, stop)` (along axis 0, relative to the piece) of a piece: one
        contiguous byte range of its C-ordered data, so nothing else is read."""
        path = os.path.join(self.directory, piece["file"])
        if path not in self._headers:
            self._headers[path] = _format.read_header(path)
        info = self._headers[path].tensors[piece["tensor"]]
        if info.shape:
            row_bytes = math.prod(info.shape[1:]) * info.dtype.itemsize
            info = _format.TensorInfo(
                info.name,
                info.dtype,
                (stop - first, *info.shape[1:]),
                info.start + first * row_bytes,
                (stop - first) * row_bytes,
            )
        fd = os.open(path, os.O_RDONLY)
        try:
            return _format.read_tensor(fd, info, path)
        finally:
            os.close(fd)

    def read_block(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """The block `index` (default: all) of array `name`. Only pieces that overlap it are
        touched, and of each only the rows (axis 0) that overlap, as one ranged read."""
        shape, dtype = self.info(name)
        bounds = [
            (0, d) if index is None else (sl.start or 0, d if sl.stop is None else sl.stop)
            for d, sl in zip(shape, index or [slice(None)] * len(shape), strict=True)
        ]
        out = np.empty([b - a for a, b in bounds], dtype=dtype)
        if not shape:  # a scalar: one piece holds it
            out[()] = self._read_rows(self.arrays[name]["pieces"][0], 0, 0)
            return out
        for piece in self.arrays[name]["pieces"]:
            overlap = [
                (max(a, pa), min(b, pb))
                for (a, b), (pa, pb) in zip(bounds, piece["index"], strict=True)
            ]
            if any(lo >= hi for lo, hi in overlap):
                continue
            (first, stop), (piece_first, _) = overlap[0], piece["index"][0]
            rows = self._read_rows(piece, first - piece_first, stop - piece_first)
            starts = [first] + [
                pa for _, (pa, _) in zip(overlap[1:], piece["index"][1:], strict=True)
            ]
            src = tuple(
                slice(lo - st, hi - st) for (lo, hi), st in zip(overlap, starts, strict=True)
            )
            dst = tuple(
                slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(overlap, bounds, strict=True)
            )
            out[dst] = rows[src]
        return out
