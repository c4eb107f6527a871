"""Reading Orbax PyTree checkpoints with tensorstore, without orbax.

An Orbax PyTree checkpoint (what `flax.training.checkpoints.save_checkpoint` writes by
default, and each item of an orbax `CheckpointManager` step) is a directory holding:

- `_METADATA`: JSON; `tree_metadata` maps every leaf to its key path (`key_metadata`: each
  key with its type, 1 for a sequence index, 2 for a dict key or attribute) and its
  `value_metadata` (`value_type`: `jax.Array`, `np.ndarray`, `scalar`, `string`, or an
  empty value `None`/`Dict`/`List`/`Tuple`/`NamedTuple` that has no data). It also says
  whether the arrays live in one OCDBT database (`use_ocdbt`) and in zarr v2 or v3
  (`use_zarr3`).
- the arrays: one zarr array per leaf, named by its keys joined with `.`, either as keys
  of the OCDBT database rooted at the directory (`manifest.ocdbt`, data under `d/` and the
  per-process `ocdbt.process_<i>/` the save merged) or as plain subdirectories.
- `_strings.json`: string leaves, by the same names.

A `CheckpointManager` step directory holds one such directory per named item
(`<step>/<item>/`), and the directory of a run holds one directory per step.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import jax.tree_util as jtu
else:  # imported on first use: the command line reads headers without JAX
    from .._lazy import LazyModule

    jtu = LazyModule("jax.tree_util")

from ..checkpoints import engine
from ..checkpoints.engine import (
    MAX_NDIM,
    CheckpointFormatError,
    FileReader,
    short,
    too_big,
)
from ._orbax_layout import resolve
from ._orbax_metadata import (
    ARRAY_TYPES,
    DICT,
    EMPTY,
    Leaf,
    check_files,
    parse_metadata,
    read_json,
    unwrap_nnx,
    walk,
)

_STRINGS_NAME = "_strings.json"
# A chunk is decoded whole even when the array is smaller: a hostile `.zarray` may declare
# a tiny array with a huge chunk, and tensorstore aborts the process when that allocation
# fails. Orbax's chunks are at most the array (a shard of it); allow small slack.
_CHUNK_SLACK_BYTES = 1 << 20
# Orbax's own context for reads: many files in flight, and a cache for the B-tree nodes
# of the OCDBT database (every leaf's lookup walks the same few nodes).
_TS_CONTEXT = {
    "file_io_concurrency": {"limit": 128},
    "cache_pool#ocdbt": {"total_bytes_limit": 100_000_000},
}


def _tensorstore() -> Any:
    try:
        import tensorstore
    except ImportError:
        raise ImportError(
            "Reading Orbax checkpoints needs tensorstore: pip install 'eqx_train[orbax]'."
        ) from None
    return tensorstore


class OrbaxReader:
    """One Orbax PyTree checkpoint as a checkpoint `Reader` (`arrays`, `read`, `read_many`,
    ...), so that `restore_checkpoint`'s matcher serves it unchanged.

    `_METADATA` is validated whole and every array opened (its zarr metadata read and
    checked: numeric dtypes only, sizes that exist) before any data is read.
    """

    has_description = False  # no eqx_train tree description: Orbax has its own

    def __init__(self, directory: str, *, unwrap: bool = True):
        """`unwrap`: name NNX's tensors without their `.value` wrappers (`unwrap_nnx`)."""
        self.path = directory
        self.metadata: dict[str, str] = {}  # no safetensors metadata
        self._ts = _tensorstore()
        check_files(directory, self.bad)  # first: nothing is read through a link out of it
        found = parse_metadata(directory, self.bad)
        self.use_ocdbt, self.use_zarr3 = found.use_ocdbt, found.use_zarr3
        self.fill_missing, self.leaves = found.fill_missing, found.leaves
        if unwrap:
            self.leaves = unwrap_nnx(self.leaves)
        self._open_arrays()

    def bad(self, why: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{self.path} is not a valid Orbax checkpoint: {why}.")

    def _failed(self, name: str, what: str, error: BaseException) -> CheckpointFormatError:
        text = short(" ".join(str(error).split()), 300)
        return self.bad(f"array {short(name)} cannot be {what} ({text})")

    def __enter__(self) -> OrbaxReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stores = {}

    def check_unchanged(self) -> None:
        """Nothing to check: orbax never rewrites a committed checkpoint in place."""

    def description(self) -> Any:
        raise self.bad("it has no eqx_train tree description (see `tree()`)")

    def files(self) -> dict[str, FileReader]:
        """No safetensors files: the arrays are zarr arrays read through tensorstore."""
        return {}

    # ------------------------------------------------------------------ metadata

    def _check_chunk_files(self, name: str, store: Any, dtype: np.dtype) -> None:
        """In the plain layout each chunk is one file that tensorstore reads whole: none may
        be much larger than its chunk decoded (compression only adds a small header)."""
        if self.use_ocdbt:
            return  # the database's data files are read by byte ranges
        chunk = store.chunk_layout.write_chunk.shape or store.shape
        limit = 2 * math.prod(int(d) for d in chunk) * dtype.itemsize + _CHUNK_SLACK_BYTES
        for root, files in walk(os.path.join(self.path, name), self.bad):
            for file in files:
                full = os.path.join(root, file)
                try:
                    size = os.stat(full).st_size
                except OSError:
                    continue
                if size > limit:
                    raise self.bad(
                        f"{full}, a chunk file of array {short(name)}, has {size} bytes, "
                        f"more than a chunk can take ({limit})"
                    )

    # ------------------------------------------------------------------ arrays

    def _spec(self, name: str) -> dict[str, Any]:
        directory = os.path.abspath(self.path)
        if self.use_ocdbt:
            kvstore: dict[str, Any] = {
                "driver": "ocdbt",
                "base": {"driver": "file", "path": directory + os.sep},
                "path": name,
                "cache_pool": "cache_pool#ocdbt",
            }
        else:
            kvstore = {"driver": "file", "path": os.path.join(directory, name)}
        return {
            "driver": "zarr3" if self.use_zarr3 else "zarr",
            "kvstore": kvstore,
            "recheck_cached_data": False,
            "recheck_cached_metadata": False,
            "fill_missing_data_reads": self.fill_missing,
        }

    def _open_arrays(self) -> None:
        ts = self._ts
        context = ts.Context(_TS_CONTEXT)
        wanted = [
            (leaf.name, leaf.stored)
            for leaf in self.leaves
            if leaf.value_type in ARRAY_TYPES and not leaf.skip
        ]
        pending = [
            (name, ts.open(self._spec(stored), context=context, open=True, read=True))
            for name, stored in wanted
        ]
        self._stores: dict[str, Any] = {}
        self._shapes: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        for name, future in pending:
            try:
                store = future.result()
            except Exception as error:  # tensorstore raises ValueError/OSError variants
                raise self._failed(name, "opened", error) from None
            shape = tuple(int(d) for d in store.shape)
            if any(int(o) != 0 for o in store.origin):
                raise self.bad(f"array {short(name)} does not start at index 0")
            try:
                dtype = np.dtype(store.dtype.numpy_dtype)
            except (TypeError, ValueError):
                dtype = None
            if dtype is None or not (
                dtype.kind in "biufc"
                or (dtype.type.__module__ == "ml_dtypes" and dtype.itemsize > 0)
            ):
                raise self.bad(f"array {short(name)} has the unsupported dtype {store.dtype}")
            if len(shape) > MAX_NDIM or too_big(shape, dtype.itemsize):
                raise self.bad(f"array {short(name)} has an impossible shape {shape}")
            self._check_chunks(name, store, shape, dtype)
            self._check_chunk_files(name, store, dtype)
            self._check_fits([name], {name: (shape, dtype)})
            self._stores[name] = store
            self._shapes[name] = (shape, dtype)

    def _check_chunks(self, name: str, store: Any, shape: tuple[int, ...], dtype: np.dtype) -> None:
        layout = store.chunk_layout
        limit = max(math.prod(shape) * dtype.itemsize, _CHUNK_SLACK_BYTES)
        for grid in (layout.read_chunk, layout.write_chunk):
            chunk = tuple(int(d) for d in grid.shape or ())
            if chunk and math.prod(chunk) * dtype.itemsize > limit:
                raise self.bad(
                    f"array {short(name)} of shape {shape} declares chunks of shape {chunk}, "
                    f"{math.prod(chunk) * dtype.itemsize} bytes each, more than the array "
                    "itself (a chunk is decoded whole)"
                )

    def _check_fits(
        self, names: Sequence[str], shapes: dict[str, tuple[tuple[int, ...], np.dtype]]
    ) -> None:
        # zarr metadata may declare any shape, and the data of a compressed chunk is tiny on
        # disk; tensorstore aborts the process when an allocation fails. Refuse what this
        # machine cannot hold before asking for it.
        nbytes = sum(math.prod(shapes[n][0]) * shapes[n][1].itemsize for n in names)
        if nbytes > _memory_bytes():
            what = f"array {short(names[0])}" if len(names) == 1 else "its arrays"
            raise self.bad(
                f"{what} would take {nbytes} bytes, more than this machine's "
                f"{_memory_bytes()} bytes of memory"
            )

    def arrays(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return self._shapes

    def read(
        self, name: str, index: tuple[slice, ...] | None = None, *, verify: bool = True
    ) -> np.ndarray:
        store = self._stores[name]
        try:
            return np.asarray(store[index].read().result() if index else store.read().result())
        except Exception as error:
            raise self._failed(name, "read", error) from None

    def read_many(
        self, names: Sequence[str], *, verify: bool = True, parallel: bool = True
    ) -> dict[str, np.ndarray]:
        """Every array named, read at once (tensorstore reads them concurrently)."""
        self._check_fits(names, self._shapes)
        pending = [(name, self._stores[name].read()) for name in names]
        found = {}
        for name, future in pending:
            try:
                found[name] = np.asarray(future.result())
            except Exception as error:
                raise self._failed(name, "read", error) from None
        return found

    def strings(self) -> dict[str, str]:
        """The string leaves, by name (`_strings.json`)."""
        wanted = {leaf.name: leaf.stored for leaf in self.leaves if leaf.value_type == "string"}
        if not wanted:
            return {}
        path = os.path.join(self.path, _STRINGS_NAME)

        def bad(why: str) -> CheckpointFormatError:
            return CheckpointFormatError(f"{path} is not a valid Orbax string file: {why}.")

        if not os.path.lexists(path):
            raise self.bad(f"it has string leaves but no {_STRINGS_NAME}")
        table = read_json(path, "it", bad)
        if not isinstance(table, dict):
            raise bad("it is not a JSON object")
        for stored in wanted.values():
            if not isinstance(table.get(stored), str):
                raise bad(f"it has no string for leaf {short(stored)}")
        return {name: table[stored] for name, stored in wanted.items()}

    def tree(self) -> Any:
        """The whole checkpoint as orbax restores it without a target: nested dicts (and
        lists, for sequence keys) whose leaves are NumPy arrays, Python scalars, strings
        and empty values."""
        arrays = self.read_many(list(self._shapes))
        strings = self.strings()
        values: list[tuple[Leaf, Any]] = []
        for leaf in self.leaves:
            if leaf.name in arrays:
                value: Any = arrays[leaf.name]
                if leaf.value_type == "scalar":
                    if value.ndim != 0:
                        raise self.bad(f"scalar {short(leaf.name)} has shape {value.shape}")
                    value = value.item()
            elif leaf.value_type == "string":
                value = strings[leaf.name]
            elif leaf.value_type in EMPTY:
                empty = EMPTY[leaf.value_type]
                value = None if empty is None else empty()
            else:
                raise self.bad(f"leaf {short(leaf.name)} has no data")
            values.append((leaf, value))
        return _nest(values, self.bad)


def _memory_bytes() -> int:
    """The machine's physical memory (a bound no readable array can pass)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: no bound
        return 2**62


def _nest(values: list[tuple[Leaf, Any]], bad: Any) -> Any:
    """Nested dicts and lists from (keys, value) pairs, as orbax's restore builds them."""
    root: dict[str, Any] = {}
    kinds_at: dict[tuple[str, ...], int] = {}
    for leaf, value in values:
        node = root
        for depth, key in enumerate(leaf.keys):
            prefix = leaf.keys[:depth]
            if kinds_at.setdefault(prefix, leaf.kinds[depth]) != leaf.kinds[depth]:
                raise bad(f"the keys under {short('.'.join(prefix))} mix kinds")
            if depth == len(leaf.keys) - 1:
                if key in node:
                    raise bad(f"leaf {short(leaf.name)} is given twice")
                node[key] = value
            else:
                child = node.setdefault(key, {})
                if not isinstance(child, dict):
                    raise bad(f"leaf {short(leaf.name)} is inside another leaf")
                node = child

    def convert(node: Any, prefix: tuple[str, ...]) -> Any:
        if not isinstance(node, dict) or prefix not in kinds_at:
            return node
        items = {k: convert(v, prefix + (k,)) for k, v in node.items()}
        if kinds_at[prefix] == DICT:
            return items
        order = sorted(items, key=int)
        if [int(k) for k in order] != list(range(len(order))):
            raise bad(f"the sequence {short('.'.join(prefix))} has gaps in its indices")
        return [items[k] for k in order]

    return convert(root, ())


def load_orbax_checkpoint(
    path: str | os.PathLike[str],
    target: Any = None,
    *,
    item: str | Sequence[str] | None = None,
    strict: bool = True,
    rename: engine.Rename = None,
    casting: engine.Casting = "no",
    filter_spec: Any = None,
    transform: engine.Transform = None,
) -> Any:
    """Reads an Orbax PyTree checkpoint, without orbax (through tensorstore).

    Reads what `flax.training.checkpoints.save_checkpoint` writes by default (flax 0.12:
    `checkpoint_<step>/`), what orbax's `PyTreeCheckpointer`/`StandardCheckpointer` write,
    and the items of an orbax `CheckpointManager` step; OCDBT and plain (one directory per
    array) layouts, zarr v2 and v3, arrays saved sharded by one process or several, every
    numeric dtype (bfloat16 and float8 as ml_dtypes' dtypes). Values are bit for bit those
    orbax restores.

    **Arguments:**

    - `path`: a PyTree checkpoint directory (it holds `_METADATA`); a `CheckpointManager`
      step directory (then its one item, or `item`); or a directory of steps
      (`checkpoint_<step>/` of flax, `<step>/` of a `CheckpointManager`): then its highest
      committed step.
    - `target`: None, or a pytree to fill: an Equinox model, a `TrainState`, nested dicts...
      Leaves are matched by their key path joined with `.`, as Orbax names them, exactly
      as `restore_checkpoint` matches: same `strict` rules, same errors listing each
      mismatched path; `jax.Array` and `jax.ShapeDtypeStruct` leaves come back with the
      target's sharding; non-array leaves are kept from the target.
    - `item`: the item of a `CheckpointManager` step to read (required when the step has
      several), or several items (a tuple of names) to read as one tree whose tensors are
      named under their item's name: `item=("model", "optimizer")` reads an NNX model
      and its `nnx.Optimizer` saved as two items into one `TrainState` in one call
      (`model.conv1.kernel`, `optimizer.step`, ...).

    NNX's state (`nnx.state(model)` saved with `ocp.StandardCheckpointer`) is read without
    its `.value` wrappers: the tensor `conv1.kernel.value` is named `conv1.kernel`.
    - `strict`, `rename`, `casting`, `filter_spec`, `transform`: as for
      `restore_checkpoint`, for a target whose names, dtypes, layouts or size differ from
      the saved tree's (`plan_restore` on the same path shows what a load will do).

    **Returns:**

    With `target=None`, the tree as orbax's own restore gives it without a target: nested
    dicts (lists where the saved tree had sequences) whose leaves are NumPy arrays
    (`jax.Array` leaves too), Python scalars for scalar leaves, strings, and `None`/empty
    containers where those were saved. Otherwise `target` with its leaves filled.

    **Raises:**

    `ImportError` naming the `eqx_train[orbax]` extra if tensorstore is missing;
    `FileNotFoundError` if `path` does not exist; `CheckpointFormatError` naming the path
    for a directory that is not an Orbax checkpoint, an unfinished save, a symbolic link
    that leads out of it, or a missing, corrupt or hostile `_METADATA` (array names that
    leave the directory, nesting deeper than 200 levels, non-numeric dtypes, impossible
    shapes, missing data); `ValueError` for an ambiguous or unknown `item` (listing the
    items) and for a checkpoint that does not match `target`.

    **Differences from orbax:** no `restore_args` (`transform=` reshapes tensors instead);
    orbax's custom type handlers and the pre-0.5 format (a `checkpoint` msgpack file, no
    `_METADATA`) are refused.
    """
    with engine.calling("load_orbax_checkpoint"):
        options = engine.RestoreOptions(
            strict=strict,
            rename=rename,
            casting=casting,
            filter_spec=filter_spec,
            transform=transform,
            verify=False,
        ).check(target)
        # A target that names NNX's wrappers itself (an `nnx.State`) reads them as saved.
        unwrap = target is None or not any(
            isinstance(p[-1], jtu.GetAttrKey | jtu.DictKey)
            and str(getattr(p[-1], "name", getattr(p[-1], "key", ""))) == "value"
            for p, _ in jtu.tree_flatten_with_path(target)[0]
            if p
        )
        if item is not None and not isinstance(item, str):
            from ._orbax_items import open_items

            opened: Any = open_items(
                os.fspath(path), list(item), lambda d: OrbaxReader(d, unwrap=unwrap)
            )
        else:
            opened = OrbaxReader(resolve(os.fspath(path), item), unwrap=unwrap)
        with opened as reader:
            if target is None:
                return reader.tree()
            return engine.restore_with(reader, target, options)
