"""Restoring, as stages: resolve -> open -> match -> read -> place.

- **resolve** (`_resolve`): which checkpoint: the path itself, or the latest / the step
  asked for in a directory listing, as an `Entry` that knows its layout.
- **open** (`open_reader`, the one place that picks a reader: `_reader.FileReader`,
  `_shards.ShardedReader` or `_hf_layout.IndexReader`; all are a `Reader`).
- **match** (`_matching.match`): every leaf of the target paired with a saved tensor, every
  problem listed before any tensor data is read.
- **read** and **place** (`_read`): only the tensors the target needs, a window at a time
  or device block by device block, placed on the target's devices (`place`).

Every stage takes the restore's `RestoreOptions` whole; errors name the public call in
progress (`_errors.call`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

if TYPE_CHECKING:
    import jax
    import jax.tree_util as jtu
else:  # imported on first use: the command line reads headers without JAX
    from ..._lazy import LazyModule

    jax = LazyModule("jax")
    jtu = LazyModule("jax.tree_util")

from ... import _progress
from ..._calls import call
from ..._progress import reporting
from ..._text import short
from .._errors import CheckpointFormatError, StepNotFoundError, invalid
from ..format import _names
from ..format._description import LeafKind, rebuild
from ..format._layouts import Location, Reader as Reader, foreign_directory, locate, open_reader
from ..storage._base import Storage
from . import _directory, _matching, _read, _selection
from ._options import RestoreOptions
from ._window import stage

T = TypeVar("T")
_MAX_LISTED_PROBLEMS = 20
RESTORE_ATTEMPTS = 5


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
                f"{call()}: step={step!r} was given but {ckpt_dir} is a checkpoint, "
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
    found_step = _directory.find_step(listing, _names.check_step(step))
    if found_step is not None:
        return found_step, True
    available = list({e.value: e.text for e in listing}.values())
    raise StepNotFoundError(
        f"{call()}: no checkpoint for step {step} with prefix '{prefix}' in "
        f"{ckpt_dir}; available steps: {available}."
    )


def _refuse_two_layouts(store: Storage, directory: str, hf_path: str, prefix: str) -> None:
    """A directory holding both Hugging Face weights and checkpoints of ours: which one a
    restore means is a guess, and a wrong guess starts from the wrong weights silently."""
    listing = _directory.list_checkpoints(store, directory, prefix)
    if listing:
        raise ValueError(
            f"{call()}: {directory} holds both Hugging Face weights "
            f"({os.path.basename(hf_path)}) and checkpoints with prefix '{prefix}' (latest "
            f"{os.path.basename(listing[-1].path)}); pass the file or checkpoint to restore."
        )


def restore(
    store: Storage, where: str, target: T, step: Any, prefix: str, options: RestoreOptions
) -> T:
    """`restore_checkpoint` once its location is resolved: pick the checkpoint, open it,
    match it (`restore_one`); again (up to 5 times) when a concurrent save replaced what
    was being read."""
    named_gone: FileNotFoundError | None = None
    for attempt in range(RESTORE_ATTEMPTS):
        entry, listed = _resolve(store, where, step, prefix)
        if entry is None:
            if named_gone is not None:
                raise named_gone  # the checkpoint named was there, and went
            return target
        try:
            return restore_one(store, entry, target, options)
        except FileNotFoundError as error:
            # A concurrent save replaced or removed what we were reading (an overwrite of
            # the step, or retention after a newer save): look again.
            if attempt + 1 == RESTORE_ATTEMPTS:
                raise
            named_gone = None if listed else error
    raise AssertionError("unreachable")  # pragma: no cover


def restore_one(
    store: Storage, entry: _directory.Entry | Location, target: T, options: RestoreOptions
) -> T:
    """Restores the listed checkpoint `entry` (or the `Location` of a checkpoint named
    directly) into `target`, then proves that no file read changed meanwhile (object
    stores): a checksum failure or a silently mixed read becomes `ObjectReplacedError`.
    Raises `FileNotFoundError` if it is gone, or was replaced while being read: the caller
    lists again."""
    with open_reader(store, entry) as reader:
        try:
            restored = restore_from(reader, target, options=options)
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


def _fail(path: str, problems: list[str], strict: bool, hint: str = "") -> None:
    """Raises the `ValueError` listing `problems`; `strict` says whether `strict=False` is
    worth suggesting (not when no leaf is in both)."""
    listed = "\n  ".join(problems[:_MAX_LISTED_PROBLEMS])
    more = len(problems) - _MAX_LISTED_PROBLEMS
    listed += f"\n  ... and {more} more" if more > 0 else ""
    raise ValueError(
        f"{call()}: {path} does not match the target:\n  {listed}\n"
        + (f"{hint}\n" if hint else "")
        + "Pass target=None to load the file as saved"
        + (", or strict=False to restore only the leaves present in both." if strict else ".")
    )


def _as_saved(reader: Reader, options: RestoreOptions) -> Any:
    """The tree as saved, for `target=None`: rebuilt from the description, or (a file of
    another tool) nested dicts split on '.'."""

    def read_all() -> dict[str, np.ndarray]:
        available = reader.arrays()
        sizes = {
            name: math.prod(shape) * dtype.itemsize for name, (shape, dtype) in available.items()
        }
        _progress.expect(sum(sizes.values()))
        arrays: dict[str, np.ndarray] = {}
        # With a report open, read in groups, so that it moves as the groups arrive.
        for group in _groups(list(available), sizes, _REPORT_EVERY if options.progress else 0):
            arrays.update(
                reader.read_many(group, verify=options.verify, parallel=options.threaded_reads)
            )
            _progress.advance(sum(sizes[name] for name in group))
        return arrays

    if not reader.has_description:
        return _unflatten_names(read_all())
    description = reader.description()  # validated before any tensor is read
    arrays = read_all()
    try:
        return rebuild(description, arrays.__getitem__)
    except CheckpointFormatError:
        raise
    except (ValueError, TypeError, KeyError) as error:  # e.g. an unknown PRNG impl
        raise reader.bad(f"its tree cannot be rebuilt ({short(str(error), 160)})") from None


# A restore of the tree as saved reports its progress after each group of this many bytes.
_REPORT_EVERY = 64 << 20


def _groups(names: list[str], sizes: dict[str, int], bound: int) -> list[list[str]]:
    """`names` cut into consecutive groups of about `bound` bytes (one group: 0)."""
    if bound <= 0:
        return [names]
    groups: list[list[str]] = [[]]
    held = 0
    for name in names:
        if groups[-1] and held + sizes[name] > bound:
            groups.append([])
            held = 0
        groups[-1].append(name)
        held += sizes[name]
    return groups


def restore_from(reader: Reader, target: Any, *, options: RestoreOptions) -> Any:
    """`target` filled from `reader` (or, for `target=None`, the tree as saved).

    The match stage (`_matching.match`) pairs every data leaf of `target` with a saved
    tensor, as `options` say, every problem listed in one `ValueError` before any tensor
    data is read. Then the read and place stages (`_read`) read only the tensors needed:
    whole, a window of `options.host_window_bytes` at a time, or device block by device
    block for a sharded target (never a transformed leaf, whose blocks are not blocks of
    the saved tensor). With `strict=False`, a `PartialRestoreWarning` says what did not
    match.
    """
    with reporting(options.progress, "restore"):
        return _restore_from(reader, target, options)


def _restore_from(reader: Reader, target: Any, options: RestoreOptions) -> Any:
    if target is None:
        return _as_saved(reader, options)
    found = _matching.match(reader, target, options)
    if found.problems:
        # A file whose header was corrupted can look like a mismatch: its checksums say which.
        for name in found.mismatched:
            reader.read(name, verify=True)
        _fail(reader.path, found.problems, options.strict and not found.nothing_found, found.hint)
    whole: dict[str, list[_matching.Slot]] = {}  # saved name -> the leaves it fills
    blocks: list[_matching.Slot] = []
    for slot in found.slots:
        if slot.transform is not None or not _read.blockwise(
            reader, found.leaves[slot.index], slot.kind
        ):
            whole.setdefault(slot.saved, []).append(slot)
        else:
            blocks.append(slot)
    # `place` and `settle_placed` looked up here, when called: tests replace them.
    problems = _read.read_whole(reader, found, whole, options, place, settle_placed)
    _read.read_blocks(reader, found, blocks, options)
    config_values = _read.config_values(reader, found, options, problems)
    if problems:
        _fail(reader.path, problems, options.strict)
    differences = _selection.config_differences(config_values)
    if differences:
        _selection.warn_config(reader.path, differences)
    if not options.strict:
        _matching.warn_partial(reader.path, found)
    _matching.warn_placeholders(reader.path, found, found.leaves)
    return jtu.tree_unflatten(found.treedef, found.leaves)


def place(kind: LeafKind, target: Any, array: np.ndarray | jax.Array) -> Any:
    """The restored leaf for `target` from its host bytes `array` (or, for a tensor read in
    pieces, the pieces joined on the target's device): on the target's devices for an
    array target. The transfer is started, not waited for; `settle_placed` waits.
    Called by the restore's reader threads, several at once (and, for a tensor joined from
    pieces, by the restoring thread).
    (Raises `ValueError` if `array` cannot fill `target`.)"""
    with stage("place"):
        return kind.fill(target, array)


def settle_placed(placed: Sequence[Any]) -> None:
    """Waits until the leaves `placed` are on their devices, so that the host bytes they came
    from can be let go (an accelerator copies them asynchronously; a CPU device adopts
    them): once per window group, not once per leaf."""
    with stage("place"):
        jax.block_until_ready([leaf for leaf in placed if isinstance(leaf, jax.Array)])
