"""`eqx-train diff A B`: two checkpoints compared tensor by tensor, bit for bit or within a
tolerance."""

from __future__ import annotations

import argparse
import math

import numpy as np

from ._cli_open import open_one, spec_text
from ._close import close


def _parts(x: np.ndarray) -> np.ndarray:
    """A float array as `(..., 1)`; a complex one as its real and imaginary parts, `(..., 2)`."""
    if x.dtype.kind != "c":
        return x.reshape(*x.shape, 1)
    part = np.dtype(f"f{x.dtype.itemsize // 2}")
    return np.ascontiguousarray(x).reshape(-1).view(part).reshape(*x.shape, 2)


def _difference(
    a: np.ndarray, b: np.ndarray, atol: float = 0.0, rtol: float = 0.0
) -> tuple[int, float]:
    """(number of differing elements, max |a - b| among them).

    Without a tolerance, floats compare by their bits (-0.0 differs from 0.0), except that
    NaN equals NaN (for a complex, each of its parts so). With `atol`/`rtol`, a float element
    differs only when `|a - b| > atol + rtol * |b|`, as `numpy.isclose` (NaN still equals
    NaN; an infinity equals only itself). Integers and booleans always compare exactly, and
    their gap is exact (a float64 would round away a difference of 1 between int64s near
    2**62)."""
    if a.dtype.kind in "biu":
        differs = a != b
        count = int(np.count_nonzero(differs))
        if not count:
            return 0, 0.0
        if a.dtype.kind == "b":
            return count, 1.0
        # The true gap of two 64-bit integers is below 2**64: modulo 2**64 it is exact.
        high = np.maximum(a[differs], b[differs]).astype(np.uint64)
        low = np.minimum(a[differs], b[differs]).astype(np.uint64)
        return count, float(int((high - low).max()))
    wide = np.complex128 if a.dtype.kind == "c" else np.float64
    wide_a, wide_b = a.astype(wide), b.astype(wide)
    # Each part of a complex on its own: NaN in one part does not hide the other part.
    nan_a, nan_b = np.isnan(_parts(wide_a)), np.isnan(_parts(wide_b))
    # inf - inf is NaN and 1.7e308 - -1.7e308 overflows to inf: both are meant.
    with np.errstate(invalid="ignore", over="ignore"):
        if atol or rtol:
            differs = ~close(wide_a, wide_b, rtol, atol)
        else:
            part_a, part_b = _parts(a), _parts(b)
            size = part_a.dtype.itemsize
            bits_a = part_a.reshape(-1).view(np.uint8).reshape(*part_a.shape, size)
            bits_b = part_b.reshape(-1).view(np.uint8).reshape(*part_b.shape, size)
            differs = ((bits_a != bits_b).any(axis=-1) & ~(nan_a & nan_b)).any(axis=-1)
        count = int(np.count_nonzero(differs))
        if not count:
            return 0, 0.0
        gap = np.abs(wide_a[differs] - wide_b[differs])
    return count, math.nan if np.isnan(gap).all() else float(np.nanmax(gap))


def run_diff(args: argparse.Namespace) -> int:
    """`eqx-train diff A B`: prints each tensor that differs; returns 1 if any does."""
    tolerant = bool(args.atol or args.rtol)
    limits = f"atol={args.atol:g}, rtol={args.rtol:g}"
    beyond = f" beyond {limits}" if tolerant else ""
    _, a = open_one(args.a, args.prefix)
    with a:
        _, b = open_one(args.b, args.prefix)
        with b:
            arrays_a, arrays_b = a.arrays(), b.arrays()
            lines = []
            for name, (shape, dtype) in arrays_a.items():
                if name not in arrays_b:
                    lines.append(f"only in A: {name} {spec_text(shape, dtype)}")
            for name, (shape, dtype) in arrays_b.items():
                if name not in arrays_a:
                    lines.append(f"only in B: {name} {spec_text(shape, dtype)}")
            same = 0
            for name, (shape, dtype) in arrays_a.items():
                if name not in arrays_b:
                    continue
                other = arrays_b[name]
                if (shape, dtype) != other:
                    lines.append(
                        f"differs: {name} A {spec_text(shape, dtype)}, B {spec_text(*other)}"
                    )
                    continue
                va, vb = a.read(name), b.read(name)
                count, gap = _difference(va, vb, args.atol, args.rtol)
                if count:
                    lines.append(
                        f"differs: {name} {spec_text(shape, dtype)}: {count} of {va.size} elements"
                        f"{beyond}, max abs diff {gap:.6g}"
                    )
                else:
                    same += 1
    for line in lines:
        print(line)
    total = len(set(arrays_a) | set(arrays_b))
    if tolerant:
        print(
            f"{same} of {total} tensors equal within {limits}"
            + ("" if lines else "; A and B match")
        )
    else:
        print(f"{same} of {total} tensors identical" + ("" if lines else "; A and B are identical"))
    return 1 if lines else 0
