"""How a block that several processes hold is cut into one contiguous run per process: the
one rule a replica-parallel save writes by and a read-once restore reads by."""

from __future__ import annotations

from collections.abc import Sequence


def split_axis(extents: Sequence[int], parts: int) -> int | None:
    """The axis along which a block of `extents` is cut into `parts` contiguous runs, one per
    replica holder: the first whose extent `parts` divides, else the first at least `parts`
    long; None if no axis is (a scalar, or a block smaller than its holders). The save and
    the read-once restore use this one rule, so that a restore onto the processes that saved
    reads exactly the pieces each wrote."""
    if parts <= 1:
        return None
    divisible = [a for a, n in enumerate(extents) if n >= parts and n % parts == 0]
    long_enough = [a for a, n in enumerate(extents) if n >= parts]
    return (divisible or long_enough or [None])[0]


def split_bounds(
    bounds: Sequence[tuple[int, int]], axis: int, part: int, parts: int
) -> list[list[int]]:
    """Run `part` of `parts` of the block `bounds` cut along `axis` (as even as can be)."""
    lo, hi = bounds[axis]
    cut = [lo + (hi - lo) * k // parts for k in (part, part + 1)]
    return [cut if a == axis else list(b) for a, b in enumerate(bounds)]
