"""Restoring: the `Reader` every layout implements, opening any layout, and matching what a
checkpoint holds against a target pytree.

A restore goes `_locations.resolve` (where) -> `_resolve` (which checkpoint: the path itself,
or the latest / the step asked for in a directory listing, as an `Entry` that knows its
layout) -> `open_reader` (the one place that picks a reader: `_format.FileReader`,
`_shards.ShardedReader` or `_hf_layout.IndexReader`) -> `restore_from` (match the target,
read only the tensors it needs, rebuild).
"""

from __future__ import annotations

import collections
import math
import os
from collections.abc import Mapping, Sequence
from contextlib import closing
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    import jax
    import jax.tree_util as jtu
else:  # imported on first use: the command line reads headers without JAX
    from ..._lazy import LazyModule

    jax = LazyModule("jax")
    jtu = LazyModule("jax.tree_util")

from ..._tree import weak_like
from .._errors import CheckpointFormatError, StepNotFoundError, invalid, short
from ..format import _names
from ..format._description import LeafKind, rebuild
from ..format._format import FileReader
from ..format._layouts import Location, foreign_directory, locate, open_reader
from ..format._shards import ShardedReader
from ..storage import Storage
from . import _directory, _matching, _read_once, _selection, _transform
from ._transfer import windowed_reads
from ._window import DEFAULT_HOST_WINDOW_BYTES, HostWindow, stage

T = TypeVar("T")
_MAX_LISTED_PROBLEMS = 20
RESTORE_ATTEMPTS = 5


@runtime_checkable
class Reader(Protocol):
    """One checkpoint, whatever its layout, as the matcher and the command line see it:
    implemented by `FileReader` (one file), `ShardedReader` (a `.shards` directory) and
    `IndexReader` (a Hugging Face directory). Use as a context manager."""

    path: str
    metadata: dict[str, str]  # the file's (or index's) `__metadata__`

    @property
    def has_description(self) -> bool:
        """False for a checkpoint written by another tool (no tree description)."""
        ...

    def description(self) -> Any:
        """The tree description, validated against `arrays()` (parsed on the first call)."""
        ...

    def bad(self, why: str) -> CheckpointFormatError:
        """The error saying this checkpoint is not valid, and why."""
        ...

    def arrays(self) -> Mapping[str, tuple[tuple[int, ...], np.dtype]]:
        """Every tensor: name -> (shape, dtype)."""
        ...

    def read(
        self, name: str, index: tuple[slice, ...] | None = None, *, verify: bool = True
    ) -> np.ndarray:
        """Tensor `name`, or its block `index`."""
        ...

    def read_many(
        self, names: Sequence[str], *, verify: bool = True, parallel: bool = True
    ) -> dict[str, np.ndarray]:
        """Whole tensors, by name."""
        ...

    def files(self) -> dict[str, FileReader]:
        """Every file holding tensor data, opened, by path."""
        ...

    def check_unchanged(self) -> None:
        """Raises `ObjectReplacedError` if a file read was replaced since it was opened."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> None: ...


def _resolve(
    store: Storage, ckpt_dir: str, step: Any, prefix: str
) -> tuple[_directory.Entry | Location | None, bool]:
    """(the checkpoint to restore or None, whether it was chosen from a directory listing)."""
    found = locate(store, ckpt_dir)
    if found is None:
        return None, False
    if found.layout == "hf" and found.path != ckpt_dir:
        _refuse_two_layouts(store, ckpt_dir, found.path, prefix)
    if found.layout != "directory":
        if step is not None:
            raise ValueError(
                f"restore_checkpoint: step={step!r} was given but {ckpt_dir} is a checkpoint, "
                "not a directory of checkpoints; pass the directory to choose a step."
            )
        return found, False
    if ckpt_dir.rstrip("/" + os.sep).endswith(_names.SHARDED_SUFFIX):
        raise invalid(ckpt_dir)(f"it has no {_names.INDEX_NAME}, so its save never committed")
    listing = _directory.list_checkpoints(store, ckpt_dir, prefix)
    if not listing:
        # No checkpoint of ours: weights of another layout are read or refused, never
        # silently skipped (only a directory without weights returns the target as it is).
        weights = foreign_directory(store, ckpt_dir, prefix)
        if weights is not None:
            return _resolve(store, weights.path, step, prefix)[0], False
    if step is None:
        return _directory.latest(listing), True
    found_step = _directory.find_step(listing, _names.check_step(step, "restore_checkpoint"))
    if found_step is not None:
        return found_step, True
    available = list({e.value: e.text for e in listing}.values())
    raise StepNotFoundError(
        f"restore_checkpoint: no checkpoint for step {step} with prefix '{prefix}' in "
        f"{ckpt_dir}; available steps: {available}."
    )


def _refuse_two_layouts(store: Storage, directory: str, hf_path: str, prefix: str) -> None:
    """A directory holding both Hugging Face weights and checkpoints of ours: which one a
    restore means is a guess, and a wrong guess starts from the wrong weights silently."""
    listing = _directory.list_checkpoints(store, directory, prefix)
    if listing:
        raise ValueError(
            f"restore_checkpoint: {directory} holds both Hugging Face weights "
            f"({os.path.basename(hf_path)}) and checkpoints with prefix '{prefix}' (latest "
            f"{os.path.basename(listing[-1].path)}); pass the file or checkpoint to restore."
        )


def restore(store: Storage, where: str, target: T, step: Any, prefix: str, **options: Any) -> T:
    """`restore_checkpoint` once its location is resolved: pick the checkpoint, open it,
    match it (`restore_entry`, with `options`); again (up to 5 times) when a concurrent save
    replaced what was being read."""
    named_gone: FileNotFoundError | None = None
    for attempt in range(RESTORE_ATTEMPTS):
        entry, listed = _resolve(store, where, step, prefix)
        if entry is None:
            if named_gone is not None:
                raise named_gone  # the checkpoint named was there, and went
            return target
        try:
            return restore_entry(store, entry, target, **options)
        except FileNotFoundError as error:
            # A concurrent save replaced or removed what we were reading (an overwrite of
            # the step, or retention after a newer save): look again.
            if attempt + 1 == RESTORE_ATTEMPTS:
                raise
            named_gone = None if listed else error
    raise AssertionError("unreachable")  # pragma: no cover


def restore_entry(
    store: Storage,
    entry: _directory.Entry | Location,
    target: T,
    *,
    strict: bool = True,
    parallel: bool = True,
    verify: bool = True,
    config: _selection.Config = "target",
    filter_spec: Any = None,
    host_window_bytes: int = DEFAULT_HOST_WINDOW_BYTES,
    rename: _matching.Rename = None,
    casting: _matching.Casting = "no",
    replica_parallel: bool = True,
    transform: _transform.Transform = None,
) -> T:
    """Restores the listed checkpoint `entry` (or the `Location` of a checkpoint named
    directly) into `target`. Raises `FileNotFoundError` if
    it is gone, or was replaced while being read: the caller lists again."""
    with open_reader(store, entry) as reader:
        return _restore_one(
            reader,
            target,
            strict=strict,
            parallel=parallel,
            verify=verify,
            config=config,
            filter_spec=filter_spec,
            host_window_bytes=host_window_bytes,
            rename=rename,
            casting=casting,
            replica_parallel=replica_parallel,
            transform=transform,
        )


def _restore_one(reader: Reader, target: Any, **options: Any) -> Any:
    """`restore_from`, then proof that no file read changed meanwhile (object stores): a
    checksum failure or a silently mixed read becomes `ObjectReplacedError`, and a retry."""
    try:
        restored = restore_from(reader, target, **options)
    except CheckpointFormatError:
        reader.check_unchanged()
        raise
    reader.check_unchanged()
    return restored


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


def _fail(path: str, problems: list[str], strict: bool, caller: str, hint: str = "") -> None:
    """Raises the `ValueError` listing `problems`; `strict` says whether `strict=False` is
    worth suggesting (not when no leaf is in both)."""
    listed = "\n  ".join(problems[:_MAX_LISTED_PROBLEMS])
    more = len(problems) - _MAX_LISTED_PROBLEMS
    listed += f"\n  ... and {more} more" if more > 0 else ""
    raise ValueError(
        f"{caller}: {path} does not match the target:\n  {listed}\n"
        + (f"{hint}\n" if hint else "")
        + "Pass target=None to load the file as saved"
        + (", or strict=False to restore only the leaves present in both." if strict else ".")
    )


def restore_from(
    reader: Reader,
    target: Any,
    *,
    strict: bool,
    parallel: bool,
    verify: bool,
    caller: str = "restore_checkpoint",
    config: _selection.Config = "target",
    filter_spec: Any = None,
    host_window_bytes: int = DEFAULT_HOST_WINDOW_BYTES,
    rename: _matching.Rename = None,
    casting: _matching.Casting = "no",
    replica_parallel: bool = True,
    transform: _transform.Transform = None,
) -> Any:
    """`target` filled from `reader` (or, for `target=None`, the tree as saved).

    `_matching.match` pairs every data leaf of `target` with a saved tensor (by name through
    `rename`; through `transform`; shape, dtype or a cast `casting` allows, PRNG key
    implementation; with `strict`, nothing missing or extra; `filter_spec` and `config` as
    in `_selection`), every problem listed in one `ValueError`, before any tensor data is
    read. Then only the tensors needed are read: whole, a window of `host_window_bytes` at
    a time (background threads read, verify, transform, cast and place several leaves at
    once while the caller waits for earlier ones to reach their devices), or device block
    by device block for a sharded target (`_blockwise`; never a transformed leaf, whose
    blocks are not blocks of the saved tensor). `caller` names the public function in errors. With
    `strict=False`, a `PartialRestoreWarning` says what did not match. With
    `replica_parallel`, a block the target places on several processes is read once across
    them (`_read_once`).
    """
    if target is None:
        if not reader.has_description:
            return _unflatten_names(
                reader.read_many(list(reader.arrays()), verify=verify, parallel=parallel)
            )
        description = reader.description()
        arrays = reader.read_many(list(reader.arrays()), verify=verify, parallel=parallel)
        try:
            return rebuild(description, arrays.__getitem__)
        except CheckpointFormatError:
            raise
        except (ValueError, TypeError, KeyError) as error:  # e.g. an unknown PRNG impl
            raise reader.bad(f"its tree cannot be rebuilt ({short(str(error), 160)})") from None

    found = _matching.match(
        reader,
        target,
        strict=strict,
        rename=rename,
        casting=casting,
        config=config,
        filter_spec=filter_spec,
        caller=caller,
        transform=transform,
    )
    if found.problems:
        # A file whose header was corrupted can look like a mismatch: its checksums say which.
        for name in found.mismatched:
            reader.read(name, verify=True)
        _fail(reader.path, found.problems, strict and not found.nothing_found, caller, found.hint)
    available, leaves, problems = reader.arrays(), found.leaves, []

    def nbytes(name: str) -> int:
        """Held on the host: the saved bytes, any cast copy, and each transform's output
        (with its cast copy)."""
        shape, dtype = available[name]
        held = math.prod(shape) * max(
            [dtype.itemsize]
            + [2 * s.cast.itemsize for s in whole[name] if s.cast is not None and not s.transform]
        )
        for s in whole[name]:
            if s.transform is not None and s.dtype is not None:
                itemsize = s.dtype.itemsize + (s.cast.itemsize if s.cast is not None else 0)
                held += math.prod(s.shape) * itemsize
        return held

    whole: dict[str, list[_matching.Slot]] = {}  # saved name -> the leaves it fills
    in_whole: set[int] = set()  # their indices
    for slot in found.slots:
        if slot.transform is not None or not _blockwise(reader, leaves[slot.index], slot.kind):
            whole.setdefault(slot.saved, []).append(slot)
            in_whole.add(slot.index)
    targets = list(leaves)  # read by the threads that place; the caller fills `leaves`

    def place_all(name: str, array: np.ndarray) -> list[tuple[_matching.Slot, Any, str]]:
        """The leaves saved tensor `name` fills (several when rename ties leaves), or why not."""
        placed, slots = [], whole[name]
        for slot in slots:
            try:
                leaf = place(slot.kind, targets[slot.index], slot.host_array(array))
            except _transform.TransformError as error:
                placed.append((slot, None, f"'{slot.target}': from saved '{name}': {error}"))
                continue
            except ValueError as error:
                placed.append((slot, None, f"'{slot.target}': {error}"))
                continue
            if len(slots) > 1 and isinstance(leaf, np.ndarray) and np.may_share_memory(leaf, array):
                # NumPy leaves are mutable: a tied one must alias neither another NumPy leaf
                # nor a jax.Array (a CPU device adopts the host buffer it is placed from).
                leaf = leaf.copy()
            placed.append((slot, leaf, ""))
        return placed

    reads = windowed_reads(
        list(whole),
        nbytes,
        lambda group: reader.read_many(group, verify=verify, parallel=parallel),
        HostWindow(host_window_bytes),
        settle=lambda group: settle_placed([leaves[s.index] for n in group for s in whole[n]]),
        place=place_all,
    )
    with closing(reads):
        for _, placed in reads:
            for slot, leaf, problem in placed:
                if problem:
                    problems.append(problem)
                else:
                    leaves[slot.index] = leaf
    blockwise = [slot for slot in found.slots if slot.index not in in_whole]
    # Read once across processes: a tensor no cast changes, filling one leaf (a tensor tied
    # to several leaves may be placed differently for each).
    counts = collections.Counter(slot.saved for slot in blockwise)
    tied = {saved for saved, count in counts.items() if count > 1}
    once = (
        _read_once.place(
            reader,
            [
                (s.saved, leaves[s.index])
                for s in blockwise
                if s.cast is None and s.saved not in tied
            ],
            verify,
        )
        if replica_parallel
        else {}
    )
    for slot in blockwise:
        if slot.saved in once:
            read = once[slot.saved]
        else:
            read = _read_blockwise(reader, slot.saved, leaves[slot.index], verify, slot.cast)
        leaves[slot.index] = weak_like(leaves[slot.index], read)
    config_values = _config_values(reader, found, verify, parallel, problems)
    if problems:
        _fail(reader.path, problems, strict, caller)
    differences = _selection.config_differences(config_values)
    if differences:
        _selection.warn_config(reader.path, differences, caller)
    if not strict:
        _matching.warn_partial(reader.path, found, caller)
    _matching.warn_placeholders(reader.path, found, leaves, caller)
    return jtu.tree_unflatten(found.treedef, leaves)


def _config_values(
    reader: Reader, found: _matching.Match, verify: bool, parallel: bool, problems: list[str]
) -> list[tuple[str, Any, LeafKind, np.ndarray]]:
    """(name, target leaf, kind, saved value) of each Python scalar of an Equinox module the
    file saved, to compare with the target's (read outside the window: a few bytes each);
    a transform that fails on one adds to `problems`."""
    arrays = reader.read_many(
        list({slot.saved: None for slot in found.config_slots}), verify=verify, parallel=parallel
    )
    values = []
    for s in found.config_slots:
        try:
            values.append((s.target, found.leaves[s.index], s.kind, s.host_array(arrays[s.saved])))
        except _transform.TransformError as error:
            problems.append(f"'{s.target}': from saved '{s.saved}': {error}")
    return values


def place(kind: LeafKind, target: Any, array: np.ndarray) -> Any:
    """The restored leaf for `target` from its host bytes `array`: on the target's devices
    for an array target. The transfer is started, not waited for; `settle_placed` waits.
    Called by the restore's reader threads, several at once.
    (Raises `ValueError` if `array` cannot fill `target`.)"""
    with stage("place"):
        return kind.fill(target, array)


def settle_placed(placed: Sequence[Any]) -> None:
    """Waits until the leaves `placed` are on their devices, so that the host bytes they came
    from can be let go (an accelerator copies them asynchronously; a CPU device adopts
    them): once per window group, not once per leaf."""
    with stage("place"):
        jax.block_until_ready([leaf for leaf in placed if isinstance(leaf, jax.Array)])


def _blockwise(reader: Reader, leaf: Any, kind: LeafKind) -> bool:
    """Read device by device (each device's block only) rather than whole: for an array
    target whose sharding spans processes, or any sharded target of a `.shards` layout. An
    uncommitted target (one device) is read whole, and placed uncommitted as it is."""
    sharding = getattr(leaf, "sharding", None)
    if kind.name != "array" or sharding is None or isinstance(leaf, np.ndarray):
        return False
    if isinstance(leaf, jax.Array) and not leaf.committed:
        return False
    return isinstance(reader, ShardedReader) or not sharding.is_fully_addressable


def _read_blockwise(
    reader: Reader, name: str, leaf: Any, verify: bool, cast: np.dtype | None = None
) -> jax.Array:
    shape, sharding = tuple(leaf.shape), leaf.sharding
    read: dict[tuple[tuple[int, int], ...], np.ndarray] = {}  # a block several devices hold
    blocks = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        bounds = tuple(s.indices(d)[:2] for s, d in zip(index, shape, strict=True))
        if bounds not in read:
            block = reader.read(name, tuple(slice(*b) for b in bounds), verify=verify)
            read[bounds] = _matching.cast_on_host(block, cast)
        blocks.append(jax.device_put(read[bounds], device))
    return jax.make_array_from_single_device_arrays(shape, sharding, blocks)
