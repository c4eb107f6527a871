"""The read and place stages of a restore: the tensors a match chose, read from a reader and
placed on the target's devices.

Whole tensors are read a window of `host_window_bytes` at a time (background threads read,
verify, transform, cast and place several leaves at once while the caller waits for
earlier ones to reach their devices, `_transfer.windowed_reads`); the leaves of a sharded
target are read device block by device block (`blockwise`), a block several processes
place read once across them (`_read_once`).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from contextlib import closing
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import jax
else:  # imported on first use: the command line reads headers without JAX
    from ..._lazy import LazyModule

    jax = LazyModule("jax")

from ... import _progress
from ..._tree import weak_like
from ..format._description import LeafKind
from ..format._spans import Span, name_of
from . import _pieces, _pinned, _read_once, _transform
from ._matched import Match, Slot, cast_on_host
from ._options import RestoreOptions
from ._transfer import GROUPS_PER_WINDOW, reads_in_place, windowed_reads
from ._window import HostWindow

# Whether a restore onto an accelerator checks a group's checksums while its transfers run
# (`read_whole`), rather than as it reads it; benchmarks/restore_variants.py compares both.
CHECK_WHILE_PLACING = True
# (kind, target leaf, its value: host bytes, or a tensor joined on its device from pieces)
# -> the placed leaf; and: wait until leaves are placed.
Place = Callable[[LeafKind, Any, "np.ndarray | jax.Array"], Any]
Settle = Callable[[Sequence[Any]], None]


def blockwise(reader: Any, leaf: Any, kind: LeafKind) -> bool:
    """Read device by device (each device's block only) rather than whole: for an array
    target whose sharding spans processes, or any sharded target of a `.shards` layout. An
    uncommitted target (one device) is read whole, and placed uncommitted as it is."""
    sharding = getattr(leaf, "sharding", None)
    if kind.name != "array" or sharding is None or isinstance(leaf, np.ndarray):
        return False
    if isinstance(leaf, jax.Array) and not leaf.committed:
        return False
    return getattr(reader, "reads_blocks", False) or not sharding.is_fully_addressable


def read_whole(
    reader: Any,
    found: Match,
    whole: dict[str, list[Slot]],
    options: RestoreOptions,
    place: Place,
    settle: Settle,
) -> list[str]:
    """Fills `found.leaves` from the saved tensors `whole` names (saved name -> the slots
    it fills), a window at a time; returns the problems (a leaf that cannot be placed)."""
    leaves, available = found.leaves, reader.arrays()
    targets = list(leaves)  # read by the threads that place; the caller fills `leaves`
    pinned = _PinnedBlocks(reader, whole, targets)
    # A tensor larger than one group's share of the window (or arena) may be read in spans.
    candidates = _plain_leaves(whole, targets, pinned.arenas, options)
    pieces = _pieces.Pieces(reader, available, list(whole), candidates)

    def nbytes(unit: str | Span) -> int:
        return unit.nbytes if isinstance(unit, Span) else _held_bytes(available[unit], whole[unit])

    def place_all(unit: str | Span, array: np.ndarray) -> list[tuple[Slot, Any, str]]:
        """The leaves saved tensor `unit` fills (several when rename ties leaves), or why not;
        for a span of one, the piece placed on its device."""
        placed, slots = [], whole[name_of(unit)]
        if isinstance(unit, Span):  # one plain array leaf (`_plain_leaves`)
            host = pinned.unshared(unit, targets[slots[0].index], array)
            pinned.placed_from(unit, host, piece := pieces.place(unit, host))
            return [(slots[0], piece, "")]
        for slot in slots:
            try:
                host = pinned.unshared(unit, targets[slot.index], slot.host_array(array))
                leaf = place(slot.kind, targets[slot.index], host)
                pinned.placed_from(unit, host, leaf)
            except _transform.TransformError as error:
                placed.append((slot, None, f"'{slot.target}': from saved '{unit}': {error}"))
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

    def place_joined(slot: Slot, joined: Any) -> Any:
        return place(slot.kind, targets[slot.index], joined)

    placed_by: dict[str | Span, list[Any]] = {}  # what each unit read placed, until settled

    def settle_and_free(group: list[str | Span]) -> None:
        settle([leaf for unit in group for leaf in placed_by.pop(unit, [])])
        pinned.free(group)  # on their devices: the blocks they came from can be reused

    later = _check_while_placing(reader, options, pinned)
    reads = windowed_reads(
        pieces.units,
        nbytes,
        lambda group: reader.read_many(
            group,
            verify=options.verify and not later,
            parallel=options.threaded_reads,
            **pinned.offer,
        ),
        HostWindow(options.host_window_bytes),
        settle=settle_and_free,
        place=place_all,
        check=reader.verify_read if later else None,
    )
    _progress.expect(sum(_saved_bytes(available[name]) for name in whole))
    problems = []
    try:
        with closing(reads):
            for unit, placed in reads:
                placed_by[unit] = [leaf for _, leaf, problem in placed if not problem]
                if isinstance(unit, Span):
                    _progress.advance(unit.nbytes)
                    shape = available[unit.name][0]
                    placed = _joined(pieces, unit, placed, shape, place_joined)
                else:
                    _progress.advance(_saved_bytes(available[unit]))
                for slot, leaf, problem in placed:
                    if problem:
                        problems.append(problem)
                    else:
                        leaves[slot.index] = leaf
    finally:
        # After an error or an interrupt no reader thread is left (`windowed_reads` waits
        # for them); a transfer still in flight feeds a leaf the restore drops, and its
        # block is freed once it is over.
        pinned.free(list(pinned.blocks))
    return problems


def _check_while_placing(reader: Any, options: RestoreOptions, pinned: _PinnedBlocks) -> bool:
    """Whether a group's checksums are checked while its transfers run (onto an accelerator):
    a tensor as large as the window is otherwise read, checked, then sent, while the next
    one waits for its room (the checks of the parts run at once on the shared readers)."""
    return bool(
        CHECK_WHILE_PLACING
        and options.verify
        and options.threaded_reads
        and pinned.offer
        and hasattr(reader, "verify_read")
    )


def _held_bytes(saved: tuple[tuple[int, ...], np.dtype], slots: list[Slot]) -> int:
    """The host bytes a saved tensor (`saved`: shape, dtype) filling `slots` is held as:
    the saved bytes, any cast copy, and each transform's output (with its cast copy)."""
    shape, dtype = saved
    held = math.prod(shape) * max(
        [dtype.itemsize]
        + [2 * s.cast.itemsize for s in slots if s.cast is not None and not s.transform]
    )
    for s in slots:
        if s.transform is not None and s.dtype is not None:
            itemsize = s.dtype.itemsize + (s.cast.itemsize if s.cast is not None else 0)
            held += math.prod(s.shape) * itemsize
    return held


def _plain_leaves(
    whole: dict[str, list[Slot]],
    targets: list[Any],
    arenas: dict[str, _pinned.Arena],
    options: RestoreOptions,
) -> dict[str, tuple[Any, int, int]]:
    """Saved name -> (its target leaf, the most bytes of one of its spans, the most one may
    have to be read into the arena), for each tensor read into a pinned block that fills
    one array leaf, neither cast nor transformed: those `_pieces` may read in spans and
    join on the device. A span takes at most one group's share of the window, and of the
    arena (each is read into a block of it)."""
    return {
        name: (
            targets[slots[0].index],
            min(options.host_window_bytes, arenas[name].nbytes) // GROUPS_PER_WINDOW,
            arenas[name].nbytes // GROUPS_PER_WINDOW,
        )
        for name, slots in whole.items()
        if name in arenas
        and len(slots) == 1
        and slots[0].kind.name == "array"
        and slots[0].cast is None
        and slots[0].transform is None
    }


def _joined(
    pieces: _pieces.Pieces,
    span: Span,
    placed: list[tuple[Slot, Any, str]],
    shape: tuple[int, ...],
    place: Callable[[Slot, Any], Any],
) -> list[tuple[Slot, Any, str]]:
    """What span `span`'s piece (`placed`) fills: nothing before its tensor's last piece is
    in; then the pieces joined on the device and placed with `place(slot, joined)`."""
    ((slot, piece, _),) = placed
    joined = pieces.add(span, piece, shape)
    return [] if joined is None else [_placed(slot, partial(place, slot, joined))]


def _placed(slot: Slot, place: Callable[[], Any]) -> tuple[Slot, Any, str]:
    """(slot, the leaf `place()` returns, "") or, where it refuses, (slot, None, why)."""
    try:
        return slot, place(), ""
    except ValueError as error:
        return slot, None, f"'{slot.target}': {error}"


class _PinnedBlocks:
    """The pinned host blocks (`_pinned.Arena`) a `read_whole` reads tensors (or spans of
    them) into: offered for a saved tensor whose every slot places an array on an
    accelerator, held until the tensor is on its devices. `offer` is the `read_many`
    keyword (none for a reader that cannot read into given buffers, or where no target
    has an arena)."""

    def __init__(self, reader: Any, whole: dict[str, list[Slot]], targets: list[Any]) -> None:
        self.arenas: dict[str, _pinned.Arena] = {}
        self.blocks: dict[str | Span, tuple[_pinned.Arena, np.ndarray]] = {}
        self.leaves: dict[str | Span, list[Any]] = {}  # placed from each block: may be in flight
        self.offer: dict[str, Any] = {}
        if not getattr(reader, "reads_into", False):
            return
        for name, slots in whole.items():
            devices = [_pinned.target_device(targets[s.index]) for s in slots]
            if any(s.kind.name != "array" for s in slots) or None in devices:
                continue
            arenas = {id(a): a for a in map(_pinned.arena_for, devices)}
            if len(arenas) == 1 and (arena := next(iter(arenas.values()))) is not None:
                self.arenas[name] = arena
        if self.arenas:
            self.offer = {"into": self.allocate}

    def allocate(
        self, key: str | Span, shape: tuple[int, ...], dtype: np.dtype
    ) -> np.ndarray | None:
        arena = self.arenas.get(name_of(key))
        block = None if arena is None else arena.allocate(shape, dtype)
        if arena is not None and block is not None:
            self.blocks[key] = (arena, block)
        return block

    def unshared(self, key: str | Span, target: Any, host: np.ndarray) -> np.ndarray:
        """`host` (the bytes of tensor or span `key` for `target`), copied if it is a block
        and the target's device would adopt it rather than copy it (a CPU device): the
        block is reused once freed."""
        held = self.blocks.get(key)
        if held is None or not np.may_share_memory(host, held[1]):
            return host
        device = _pinned.target_device(target)
        return host.copy() if device is None or reads_in_place(device.platform) else host

    def placed_from(self, key: str | Span, host: np.ndarray, leaf: Any) -> None:
        """Records `leaf`, placed from `host` (the bytes of tensor or span `key`), where `host`
        is in a block: `free` waits for its transfer."""
        held = self.blocks.get(key)
        if held is not None and np.may_share_memory(host, held[1]):
            self.leaves.setdefault(key, []).append(leaf)

    def free(self, keys: list[str | Span]) -> None:
        """Frees the blocks of tensors or spans `keys` once the transfers from them are over:
        after an error, leaves placed but never settled may still be reading their blocks,
        which the next restore would overwrite (or `_pinned.release` unmap) under them."""
        for key in keys:
            if (held := self.blocks.pop(key, None)) is not None:
                try:
                    jax.block_until_ready(self.leaves.pop(key, []))
                except Exception:  # a transfer that failed is over too
                    pass
                held[0].free(held[1])


def read_blocks(reader: Any, found: Match, slots: list[Slot], options: RestoreOptions) -> None:
    """Fills the leaves of `slots` in `found.leaves` device block by device block, a block
    several processes place read once across them with `options.replica_parallel`."""
    leaves, verify = found.leaves, options.verify
    # Read once across processes: a tensor no cast changes, filling one leaf (a tensor tied
    # to several leaves may be placed differently for each).
    counts = collections.Counter(slot.saved for slot in slots)
    tied = {saved for saved, count in counts.items() if count > 1}
    once = (
        _read_once.place(
            reader,
            [(s.saved, leaves[s.index]) for s in slots if s.cast is None and s.saved not in tied],
            verify,
        )
        if options.replica_parallel
        else {}
    )
    _progress.expect(sum(_own_bytes(leaves[slot.index]) for slot in slots))
    for slot in slots:
        if slot.saved in once:
            read = once[slot.saved]
        else:
            read = _read_blockwise(reader, slot.saved, leaves[slot.index], verify, slot.cast)
        leaves[slot.index] = weak_like(leaves[slot.index], read)
        _progress.advance(_own_bytes(read))


def _saved_bytes(entry: tuple[tuple[int, ...], np.dtype]) -> int:
    shape, dtype = entry
    return math.prod(shape) * dtype.itemsize


def _own_bytes(leaf: Any) -> int:
    """The bytes of a sharded leaf this process reads: one copy of each distinct block its
    devices hold."""
    shape = tuple(leaf.shape)
    blocks = {
        tuple(s.indices(d)[:2] for s, d in zip(index, shape, strict=True))
        for index in leaf.sharding.addressable_devices_indices_map(shape).values()
    }
    itemsize = np.dtype(leaf.dtype).itemsize
    return sum(math.prod(b - a for a, b in bounds) * itemsize for bounds in blocks)


def config_values(
    reader: Any, found: Match, options: RestoreOptions, problems: list[str]
) -> list[tuple[str, Any, LeafKind, np.ndarray]]:
    """(name, target leaf, kind, saved value) of each Python scalar of an Equinox module the
    file saved, to compare with the target's (read outside the window: a few bytes each);
    a transform that fails on one adds to `problems`."""
    arrays = reader.read_many(
        list({slot.saved: None for slot in found.config_slots}),
        verify=options.verify,
        parallel=options.threaded_reads,
    )
    values = []
    for s in found.config_slots:
        try:
            values.append((s.target, found.leaves[s.index], s.kind, s.host_array(arrays[s.saved])))
        except _transform.TransformError as error:
            problems.append(f"'{s.target}': from saved '{s.saved}': {error}")
    return values


def _read_blockwise(
    reader: Any, name: str, leaf: Any, verify: bool, cast: np.dtype | None = None
) -> jax.Array:
    shape, sharding = tuple(leaf.shape), leaf.sharding
    read: dict[tuple[tuple[int, int], ...], np.ndarray] = {}  # a block several devices hold
    blocks = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        bounds = tuple(s.indices(d)[:2] for s, d in zip(index, shape, strict=True))
        if bounds not in read:
            block = reader.read(name, tuple(slice(*b) for b in bounds), verify=verify)
            read[bounds] = cast_on_host(block, cast)
        blocks.append(jax.device_put(read[bounds], device))
    return jax.make_array_from_single_device_arrays(shape, sharding, blocks)
