"""save_checkpoint / restore_checkpoint / latest_checkpoint / available_steps."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._tree import path_to_name
from . import _files, _format, _multiprocess
from ._async import AsyncManager

T = TypeVar("T")
_PARALLEL_MIN_BYTES = 16 << 20
_MAX_LISTED_PROBLEMS = 20


def save_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    target: Any,
    step: int | float,
    prefix: str = "checkpoint_",
    keep: int = 1,
    overwrite: bool = False,
    keep_every_n_steps: int | float | None = None,
    async_manager: AsyncManager | None = None,
) -> str:
    """Saves `target` as `{ckpt_dir}/{prefix}{step}.safetensors` and prunes old checkpoints.

    The file is a plain safetensors file (tensor names are the leaves' key paths joined by
    `.`, e.g. `model.layers.0.weight`) that any safetensors reader opens; its metadata
    describes the tree so that `restore_checkpoint(path, None)` can rebuild it. It is written
    to a temporary file, fsynced, atomically renamed into place and the directory fsynced: a
    crash at any moment leaves either the old set of checkpoints or the new one, never a
    half-written file under a checkpoint name. Old files are deleted only afterwards.

    **Arguments:**

    - `ckpt_dir`: directory of the checkpoints (created if missing).
    - `target`: any pytree: dicts/lists/tuples, Equinox modules, a `TrainState`. Array leaves
      (JAX, NumPy, typed PRNG keys, Python and NumPy scalars) are saved bit-exactly in their
      own dtype; strings are kept in the metadata; other leaves (functions, static fields) are
      not saved and come back from the target on restore.
    - `step`: an int or float; it orders the checkpoints numerically.
    - `prefix`: file name prefix.
    - `keep`: how many of the newest checkpoints to keep (>= 1).
    - `overwrite`: if False, a `step` not newer than the latest checkpoint is an error. If
      True, the file for `step` is replaced and every newer checkpoint removed (as flax).
    - `keep_every_n_steps`: additionally keep older checkpoints, by flax's rule: walking the
      checkpoints older than the newest `keep` from the oldest, keep a step when it is at
      least this many steps past the last step kept this way (step 0 is never kept by it).
    - `async_manager`: if given, snapshot `target` to host memory now and write in the
      background; a later save waits for this one and raises its error.

    **Returns:**

    The path of the checkpoint file (being written, if `async_manager` is given).

    **Raises:**

    `ValueError` for a step that is not newer than the latest (without `overwrite`),
    `TypeError` naming the leaf path for a dtype safetensors cannot hold, `OSError` when the
    disk is full (previous checkpoints untouched, no temporary file left behind).
    """
    return save_with_policy(
        ckpt_dir,
        target,
        step,
        prefix=prefix,
        overwrite=overwrite,
        retention=_files.flax_retention(keep, keep_every_n_steps, "save_checkpoint"),
        async_manager=async_manager,
        caller="save_checkpoint",
    )


def save_with_policy(
    ckpt_dir: str | os.PathLike[str],
    target: Any,
    step: int | float,
    *,
    prefix: str,
    overwrite: bool,
    retention: _files.Retention,
    async_manager: AsyncManager | None,
    extra_metadata: dict[str, str] | None = None,
    caller: str,
) -> str:
    """The save path shared by `save_checkpoint` and `CheckpointManager`.

    Writes the file atomically, then (after it is durable) removes newer steps when
    `overwrite`, and the steps `retention(steps_oldest_first)` names.
    """
    _files.check_step(step, caller)
    ckpt_dir = os.fspath(ckpt_dir)
    os.makedirs(ckpt_dir, exist_ok=True)
    if async_manager is not None:
        async_manager.wait_previous_save()
    description, tensors = _format.describe(target)
    final_path = os.path.join(ckpt_dir, _files.checkpoint_name(prefix, step))
    new_value = _files.check_newer(ckpt_dir, prefix, step, overwrite, caller)
    metadata = {**_format.base_metadata(step, description), **(extra_metadata or {})}
    if async_manager is not None:
        # Snapshot now: the caller may mutate or donate the buffers as soon as we return.
        tensors = [_format.snapshot(t) for t in tensors]
    header = _format.encode_header(tensors, metadata)

    def write(fd: int) -> None:
        _format.write_all(fd, memoryview(header))
        _format.write_tensors(fd, tensors)

    def commit() -> None:
        _files.atomic_write(final_path, write)
        _files.apply_retention(
            ckpt_dir, prefix, new_value, overwrite=overwrite, retention=retention
        )

    if async_manager is not None:
        async_manager.save_async(commit)
    else:
        commit()
    return final_path


def _all_checkpoints(ckpt_dir: str | os.PathLike[str], prefix: str) -> list[tuple[Any, str, str]]:
    return _files.list_checkpoints(os.fspath(ckpt_dir), prefix)


def latest_checkpoint(ckpt_dir: str | os.PathLike[str], prefix: str = "checkpoint_") -> str | None:
    """Returns the path of the checkpoint with the highest step in `ckpt_dir`, or None.

    Steps compare numerically (`9 < 10`, `-1.0 < 0.5 < 1e5`); files that are not exactly
    `{prefix}{number}.safetensors` (notes, temporary files) are ignored.
    """
    found = _all_checkpoints(ckpt_dir, prefix)
    return found[-1][2] if found else None


def available_steps(
    ckpt_dir: str | os.PathLike[str],
    prefix: str = "checkpoint_",
    step_type: Callable[[str], Any] = int,
) -> list[Any]:
    """Returns the steps of all checkpoints in `ckpt_dir`, sorted numerically.

    **Arguments:**

    - `ckpt_dir`: the checkpoint directory (missing: `[]`).
    - `prefix`: file name prefix.
    - `step_type`: `int` (default) or `float`; an int step type on float-named files raises.
    """
    return [_files.parse_step(text, step_type) for _, text, _ in _all_checkpoints(ckpt_dir, prefix)]


def _resolve_path(ckpt_dir: str, step: Any, prefix: str) -> str | None:
    if os.path.isfile(ckpt_dir) or _multiprocess.is_sharded_checkpoint(ckpt_dir):
        if step is not None:
            raise ValueError(
                f"restore_checkpoint: step={step!r} was given but {ckpt_dir} is a checkpoint, "
                "not a directory of checkpoints; pass the directory to choose a step."
            )
        return ckpt_dir
    if not os.path.isdir(ckpt_dir):
        return None
    found = _files.list_checkpoints(ckpt_dir, prefix)
    if step is None:
        return found[-1][2] if found else None
    path = _files.find_step(found, step)
    if path is not None:
        return path
    available = [text for _, text, _ in found]
    raise ValueError(
        f"restore_checkpoint: no checkpoint for step {step} with prefix '{prefix}' in "
        f"{ckpt_dir}; available steps: {available}."
    )


def _describe(shape: Any, dtype: Any) -> str:
    return f"{tuple(shape)} {np.dtype(dtype)}"


def _read_many(path: str, header: _format.Header, names: list[str], parallel: bool) -> dict:
    infos = [header.tensors[n] for n in names]
    fd = os.open(path, os.O_RDONLY)
    try:
        total = sum(i.nbytes for i in infos)
        if parallel and len(infos) > 1 and total >= _PARALLEL_MIN_BYTES:
            with ThreadPoolExecutor(max_workers=min(8, len(infos))) as pool:
                arrays = list(pool.map(lambda i: _format.read_tensor(fd, i, path), infos))
        else:
            arrays = [_format.read_tensor(fd, i, path) for i in infos]
    finally:
        os.close(fd)
    return dict(zip(names, arrays, strict=True))


def _unflatten_names(flat: dict[str, np.ndarray]) -> dict[str, Any]:
    """A foreign safetensors file (no tree description): nested dicts split on '.'."""
    nested: dict[str, Any] = {}
    for name, array in flat.items():
        node = nested
        *parents, last = name.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                return dict(flat)
            node = child
        if last in node:
            return dict(flat)
        node[last] = array
    return nested


class _Expected:
    """What a target leaf expects from the file, and how to turn the array into the leaf."""

    def __init__(self, leaf: Any):
        self.leaf = leaf
        if _format.is_prng_key(leaf):
            data = jax.random.key_data(leaf)
            self.shape, self.dtype = tuple(data.shape), np.dtype(data.dtype)
        elif isinstance(leaf, jax.Array | np.ndarray | jax.ShapeDtypeStruct):
            self.shape, self.dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
        elif isinstance(leaf, np.generic):
            self.shape, self.dtype = (), np.dtype(leaf.dtype)
        else:  # Python scalar: any numeric dtype of shape ()
            self.shape, self.dtype = (), None

    def matches(self, shape: tuple[int, ...], dtype: np.dtype) -> bool:
        return tuple(shape) == self.shape and (self.dtype is None or dtype == self.dtype)

    def expectation(self) -> str:
        return (
            _describe(self.shape, self.dtype)
            if self.dtype is not None
            else (f"() {type(self.leaf).__name__}")
        )

    def build(self, array: np.ndarray) -> Any:
        leaf = self.leaf
        if _format.is_prng_key(leaf):
            key = jax.random.wrap_key_data(jnp.asarray(array), impl=jax.random.key_impl(leaf))
            return jax.device_put(key, leaf.sharding)
        if isinstance(leaf, jax.Array):
            return jax.device_put(array, leaf.sharding)
        if isinstance(leaf, jax.ShapeDtypeStruct):
            sharding = getattr(leaf, "sharding", None)
            return (
                jax.device_put(array, sharding) if sharding is not None else jax.device_put(array)
            )
        if isinstance(leaf, np.ndarray):
            return array
        if isinstance(leaf, np.generic):
            return array[()]
        return type(leaf)(array.item())


def _is_restorable(leaf: Any) -> bool:
    return isinstance(
        leaf, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct | bool | int | float
    )


def restore_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    target: T,
    step: int | float | None = None,
    prefix: str = "checkpoint_",
    parallel: bool = True,
    *,
    strict: bool = True,
) -> T:
    """Restores a checkpoint into the structure of `target` (or as saved, if `target` is None).

    **Arguments:**

    - `ckpt_dir`: a checkpoint file, or a directory (then the latest checkpoint, or `step`).
    - `target`: a pytree to fill: dicts, Equinox modules, a `TrainState`... Array leaves are
      read from the file by their key path; non-array leaves (activation functions, static
      fields) are kept from `target`. `jax.Array` leaves come back with the target's sharding;
      `jax.ShapeDtypeStruct` leaves become arrays of that shape, dtype and sharding; NumPy
      leaves stay NumPy. With `target=None`, returns the saved tree as nested dicts, lists and
      tuples of NumPy arrays (Equinox modules and other nodes as dicts of their fields).
    - `step`: the step to restore from a directory; `None` for the latest.
    - `prefix`: file name prefix.
    - `parallel`: read large tensors with several threads.
    - `strict`: if True (default), every array leaf of `target` must be in the file with the
      same shape and dtype, and the file must hold nothing else. With `strict=False`, leaves
      missing from the file keep the target's value and extra tensors are ignored (shape and
      dtype must still match).

    **Returns:**

    The restored pytree. If `ckpt_dir` does not exist, or holds no checkpoint and `step` is
    None, `target` is returned unchanged (as flax does).

    **Raises:**

    `ValueError` for a missing `step` (naming the available ones) and for a file that does
    not match `target` (listing each path with what the file has and what the target
    expects); `CheckpointFormatError` (a `ValueError`) naming the file if it is truncated or
    corrupt. Only the tensors the target needs are read from disk.
    """
    path = _resolve_path(os.fspath(ckpt_dir), step, prefix)
    if path is None:
        return target
    if _multiprocess.is_sharded_checkpoint(path):
        return _restore_sharded(path, target, strict)
    header = _format.read_header(path)
    if target is None:
        names = list(header.tensors)
        arrays = _read_many(path, header, names, parallel)
        if not header.has_description:
            return _unflatten_names(arrays)  # type: ignore[return-value]
        return _format.rebuild(header.description, arrays.__getitem__)
    available = {name: (info.shape, info.dtype) for name, info in header.tensors.items()}
    leaves, treedef, slots = _match_target(target, available, path, strict)
    arrays = _read_many(path, header, [name for _, name, _ in slots], parallel)
    for index, name, expected in slots:
        leaves[index] = expected.build(arrays[name])
    return jtu.tree_unflatten(treedef, leaves)


def _match_target(
    target: Any, available: dict[str, tuple[tuple[int, ...], np.dtype]], path: str, strict: bool
) -> tuple[list[Any], Any, list[tuple[int, str, _Expected]]]:
    """Pairs each restorable target leaf with a saved array; raises one error listing every
    missing, extra or mismatched path (missing and extra are allowed when not `strict`)."""
    pairs, treedef = jtu.tree_flatten_with_path(target)
    slots: list[tuple[int, str, _Expected]] = []
    problems: list[str] = []
    mismatched: set[str] = set()
    for index, (key_path, leaf) in enumerate(pairs):
        if not _is_restorable(leaf):
            continue
        name = path_to_name(key_path)
        expected = _Expected(leaf)
        if name not in available:
            if strict:
                problems.append(
                    f"'{name}': missing from the file, target expects {expected.expectation()}"
                )
            continue
        shape, dtype = available[name]
        if not expected.matches(shape, dtype):
            mismatched.add(name)
            problems.append(
                f"'{name}': file has {_describe(shape, dtype)}, target expects "
                f"{expected.expectation()}"
            )
            continue
        slots.append((index, name, expected))
    if strict:
        used = {name for _, name, _ in slots} | mismatched
        for name, (shape, dtype) in available.items():
            if name not in used:
                problems.append(
                    f"'{name}': in the file as {_describe(shape, dtype)}, not in the target"
                )
    if problems:
        listed = "\n  ".join(problems[:_MAX_LISTED_PROBLEMS])
        more = len(problems) - _MAX_LISTED_PROBLEMS
        listed += f"\n  ... and {more} more" if more > 0 else ""
        raise ValueError(
            f"restore_checkpoint: {path} does not match the target:\n  {listed}\n"
            "Pass target=None to load the file as saved"
            + (", or strict=False to restore only the leaves present in both." if strict else ".")
        )
    return [leaf for _, leaf in pairs], treedef, slots


def _restore_sharded(path: str, target: Any, strict: bool) -> Any:
    reader = _multiprocess.ShardedReader(path)
    if target is None:
        return _format.rebuild(reader.index.description, reader.read_block)
    available = {name: reader.info(name) for name in reader.arrays}
    leaves, treedef, slots = _match_target(target, available, path, strict)
    for index, name, expected in slots:
        leaf = expected.leaf
        sharding = getattr(leaf, "sharding", None)
        if (
            isinstance(leaf, jax.Array | jax.ShapeDtypeStruct)
            and sharding is not None
            and not (_format.is_prng_key(leaf))
        ):
            shape = tuple(leaf.shape)
            read: dict[Any, np.ndarray] = {}  # a slice several devices hold is read once
            blocks = []
            for device, idx in sharding.addressable_devices_indices_map(shape).items():
                key = tuple((sl.start, sl.stop) for sl in idx)
                if key not in read:
                    read[key] = reader.read_block(name, idx)
                blocks.append(jax.device_put(read[key], device))
            leaves[index] = jax.make_array_from_single_device_arrays(shape, sharding, blocks)
        else:
            leaves[index] = expected.build(reader.read_block(name))
    return jtu.tree_unflatten(treedef, leaves)
