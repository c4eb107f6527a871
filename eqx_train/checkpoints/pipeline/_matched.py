"""What the matcher decided (`_matching.match`): one `Slot` per target leaf a saved tensor
fills, and the `Match` of the whole tree, which the read stage follows and a plan shows.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..format._description import LeafKind
from . import _transform


def cast_on_host(array: np.ndarray, dtype: np.dtype | None) -> np.ndarray:
    """`array` as `dtype` (None: as it is), as NumPy casts: a value out of range becomes
    inf (a float) or wraps (an integer), and a complex loses its imaginary part, silently,
    as the `casting` asked for allows."""
    if dtype is None or array.dtype == dtype:
        return array
    with np.errstate(over="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", np.exceptions.ComplexWarning)
        return array.astype(dtype)


@dataclass(frozen=True)
class Slot:
    """One target leaf filled from one saved tensor (`cast`: the dtype to cast to on the
    host, or None; `transform`: the function run on the saved tensor first, or None, and
    `shape`, `dtype`: what it returns)."""

    index: int
    target: str
    saved: str
    kind: LeafKind
    cast: np.dtype | None = None
    transform: Callable[[Any], Any] | None = None
    shape: tuple[int, ...] = ()
    dtype: np.dtype | None = None

    def host_array(self, saved: np.ndarray) -> np.ndarray:
        """The saved tensor's host bytes as this leaf takes them: transformed, then cast."""
        if self.transform is not None and self.dtype is not None:
            saved = _transform.apply(self.transform, saved, self.shape, self.dtype)
        return cast_on_host(saved, self.cast)


@dataclass
class Match:
    """What `match` decided: the leaves to fill, and what a plan shows."""

    leaves: list[Any]
    treedef: Any
    names: list[str]  # of every leaf, as the file names them
    slots: list[Slot] = field(default_factory=list)  # arrays, taken
    config_slots: list[Slot] = field(default_factory=list)  # module scalars, compared
    taken: dict[str, str] = field(default_factory=dict)
    cast: dict[str, tuple[np.dtype, np.dtype]] = field(default_factory=dict)
    # target name -> (saved shape, shape after its transform)
    transformed: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    # target name -> the layout convention its transform applied (a preset's label)
    conventions: dict[str, str] = field(default_factory=dict)
    kept: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # kept: no saved tensor (strict=False)
    unused: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)  # saved names a bad header may explain
    hint: str = ""
    nothing_found: bool = False  # no leaf to restore is in the file: the names differ

    def take(self, slot: Slot, saved_shape: tuple[int, ...]) -> None:
        """Records that `slot` fills its leaf from a saved tensor of `saved_shape`."""
        self.slots.append(slot)
        self.taken[slot.target] = slot.saved
        if slot.cast is not None and slot.dtype is not None:
            self.cast[slot.target] = (slot.dtype, slot.cast)
        if slot.transform is not None:
            self.transformed[slot.target] = (saved_shape, slot.shape)
            label = getattr(slot.transform, "convention", None)
            if isinstance(label, str):
                self.conventions[slot.target] = label
