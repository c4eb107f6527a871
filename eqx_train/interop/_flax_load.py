"""Loading flax msgpack checkpoints (their parser is `_flax`): the state dict as flax
restores it, or a target filled through `restore_checkpoint`'s own matcher (`FlaxReader`),
and what the command line asks of such a file."""

from __future__ import annotations

import os
import pathlib
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..checkpoints.engine import (
    Casting,
    CheckpointFormatError,
    FileReader,
    LocalSource,
    Rename,
    RestoreOptions,
    Transform,
    calling,
    is_orbax,
    restore_with,
)
from ._flax import CHUNKED, ArrayRef, Source, chunked_spec, materialize, parse

_SIGNED_FLOAT = re.compile(r"([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)")


def _natural_key(name: str) -> list[Any]:
    return [float(p) if _SIGNED_FLOAT.match(p) else p for p in _SIGNED_FLOAT.split(name)]


def _orbax_error(path: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{path} is an Orbax checkpoint directory, not a flax msgpack checkpoint (flax writes "
        "Orbax by default). Read it with eqx_train.interop.load_orbax_checkpoint, or convert "
        "it with `eqx-train convert-orbax`."
    )


def _latest(directory: str, prefix: str) -> str:
    pattern = f"{prefix}*"
    names = [
        name
        for name in os.listdir(directory)
        if pathlib.PurePath(name).match(pattern)
        and name != f"{prefix}tmp"
        and not name.endswith("_gda")
        and ".orbax-checkpoint-tmp" not in name
    ]
    if not names:
        raise FileNotFoundError(
            f"load_flax_checkpoint: {directory} holds no checkpoint named '{prefix}<step>'."
        )
    # The last of the natural sort, as flax: among equal steps (checkpoint_1, checkpoint_01)
    # the one listed last.
    return os.path.join(directory, sorted(names, key=_natural_key)[-1])


def _walk_arrays(root: Any, src: Source) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """(shape, dtype) of every array and number of a parsed file, by dotted name, in file
    order; no array data is read."""
    found: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    stack: list[tuple[str, Any]] = [("", root)]
    while stack:
        name, node = stack.pop()
        if isinstance(node, ArrayRef):
            found[name or "<root>"] = (node.shape, node.dtype)
        elif isinstance(node, dict) and CHUNKED in node:
            shape, chunks = chunked_spec(node, src)
            found[name or "<root>"] = (tuple(shape), chunks[0].dtype)
        elif isinstance(node, dict | list):
            items = node.items() if isinstance(node, dict) else enumerate(node)
            children = [(f"{name}.{key}" if name else str(key), value) for key, value in items]
            stack.extend(reversed(children))
        elif isinstance(node, bool | int | float | complex | np.generic):
            found[name or "<root>"] = ((), np.asarray(node).dtype)
    return found


def flax_arrays(path: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The arrays (and numbers, as 0-d) of one flax msgpack checkpoint file, by dotted name:
    its structure only, no array data read. For `eqx-train inspect`."""

    def bad(why: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{path} is not a flax msgpack checkpoint: {why}.")

    file = LocalSource(path, bad)
    try:
        if file.size == 0:
            raise bad("it is empty")
        src = Source(file, file.size, bad)
        return _walk_arrays(parse(src), src)
    finally:
        file.close()


def looks_like_flax(path: str) -> bool:
    """Whether a file starts as flax's msgpack files do: a msgpack map (its state dict)."""
    try:
        file = LocalSource(path, CheckpointFormatError)  # never blocks on a FIFO
    except (OSError, CheckpointFormatError):
        return False
    try:
        if file.size == 0:
            return False
        first = bytearray(1)
        file.read_into(memoryview(first), 0)
    finally:
        file.close()
    return 0x80 <= first[0] <= 0x8F or first[0] in (0xDE, 0xDF)


def load_flax_checkpoint(
    path: str | os.PathLike[str],
    target: Any = None,
    *,
    prefix: str = "checkpoint_",
    strict: bool = True,
    rename: Rename = None,
    casting: Casting = "no",
    filter_spec: Any = None,
    transform: Transform = None,
) -> Any:
    """Reads a checkpoint written by `flax.training.checkpoints.save_checkpoint`, without flax.

    Returns what flax's `restore_checkpoint(path, None)` returns, bit for bit: flax's state
    dict of the saved tree, i.e. nested dicts (lists, tuples, TrainStates and optax states all
    became dicts keyed by field name or by '0', '1', ...) whose leaves are NumPy arrays,
    NumPy scalars and Python scalars. Arrays are writable, 64-byte aligned and independent
    of each other; bfloat16 and float8 arrays have ml_dtypes' dtypes.

    **Arguments:**

    - `path`: a checkpoint file, or a directory: then the latest file named `prefix<step>`
      in it, picked as flax picks it.
    - `target`: None (flax's state dict, as above), or a pytree to fill (an Equinox model,
      a `TrainState`...), matched by the state dict's dotted names (`params.Dense_0.kernel`)
      exactly as `restore_checkpoint` matches: a target's names rarely equal flax's, so
      give `rename` (`plan_restore` on the same path shows the match first).
    - `prefix`: the file name prefix, as given to flax's `save_checkpoint`.
    - `strict`, `rename`, `casting`, `filter_spec`, `transform`: as for `restore_checkpoint`.

    **Returns:**

    The restored state dict, or `target` filled.

    Raises `FileNotFoundError` when there is no such file (or no checkpoint in the
    directory), and `eqx_train.checkpoints.CheckpointFormatError`, naming the file, when it
    is not a flax msgpack checkpoint: truncated, corrupt, an Orbax directory, or crafted
    (unknown extension types, nesting deeper than 200, sizes larger than the file, object
    dtypes). Nothing is allocated for a size before the file is known to hold it.

    **Differences from flax:** flax returns read-only arrays that share one buffer per array
    extension and returns `None` for a missing directory; this raises instead. Multi-process
    arrays (flax's `save_checkpoint_multiprocess` with a tensorstore side directory) are
    refused.
    """
    with calling("load_flax_checkpoint"):
        options = RestoreOptions(
            strict=strict,
            rename=rename,
            casting=casting,
            filter_spec=filter_spec,
            transform=transform,
            verify=False,
        ).check(target)
        return _load(path, target, prefix, options)


def _load(path: str | os.PathLike[str], target: Any, prefix: str, options: RestoreOptions) -> Any:
    """`load_flax_checkpoint` once its options are checked."""
    path = resolve_flax_path(os.fspath(path), prefix)
    if target is not None:
        with FlaxReader(path) as reader:
            return restore_with(reader, target, options)

    def bad(why: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{path} is not a flax msgpack checkpoint: {why}.")

    try:
        file = LocalSource(path, bad)  # opened without blocking; regular files only
    except FileNotFoundError:
        raise FileNotFoundError(f"load_flax_checkpoint: {path} does not exist.") from None
    try:
        if file.size == 0:
            raise bad("it is empty")
        src = Source(file, file.size, bad)
        tree = materialize(parse(src), src)
        src.finish()
        return tree
    finally:
        file.close()


def resolve_flax_path(path: str, prefix: str) -> str:
    """The flax checkpoint file `path` stands for: itself, or the latest `prefix<step>` file
    of a directory, picked as flax picks it."""
    if os.path.isdir(path):
        if is_orbax(path):
            raise _orbax_error(path)
        path = _latest(path, prefix)
        if os.path.isdir(path):
            raise _orbax_error(path)
    return path


def _flatten(node: Any, name: str, out: dict[str, np.ndarray]) -> None:
    """The arrays and numbers of a loaded state dict by the names `_walk_arrays` gives."""
    if isinstance(node, dict | list):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            _flatten(value, f"{name}.{key}" if name else str(key), out)
    elif isinstance(node, np.ndarray | bool | int | float | complex | np.generic):
        out[name or "<root>"] = np.asarray(node)


class FlaxReader:
    """One flax msgpack checkpoint file as a checkpoint `Reader`, so that the restore's
    matcher serves it unchanged: its names and shapes from the file's framing alone (what
    `plan_restore` needs); the data, on the first read, as `load_flax_checkpoint` reads it."""

    has_description = False  # a flax state dict, no eqx_train tree description

    def __init__(self, path: str):
        self.path = path
        self.metadata: dict[str, str] = {}
        self._arrays = flax_arrays(path)
        self._values: dict[str, np.ndarray] | None = None

    def bad(self, why: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{self.path} is not a flax msgpack checkpoint: {why}.")

    def description(self) -> Any:
        raise self.bad("it has no eqx_train tree description")

    def arrays(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return self._arrays

    def _loaded(self) -> dict[str, np.ndarray]:
        if self._values is None:
            values: dict[str, np.ndarray] = {}
            _flatten(load_flax_checkpoint(self.path), "", values)
            self._values = values
        return self._values

    def read(
        self, name: str, index: tuple[slice, ...] | None = None, *, verify: bool = True
    ) -> np.ndarray:
        array = self._loaded()[name]
        return array[index] if index else array

    def read_many(
        self, names: Sequence[str], *, verify: bool = True, parallel: bool = True
    ) -> dict[str, np.ndarray]:
        return {name: self._loaded()[name] for name in names}

    def files(self) -> dict[str, FileReader]:
        return {}  # no safetensors files

    def check_unchanged(self) -> None:
        """Nothing to check: the file was read through one descriptor."""

    def close(self) -> None:
        self._values = None

    def __enter__(self) -> FlaxReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
