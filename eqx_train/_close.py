"""Closeness of float and complex values within a tolerance, one rule for
`eqx_train.testing.assert_trees_equal` and `python -m eqx_train diff` (NumPy only: the command
line runs without JAX)."""

from __future__ import annotations

import numpy as np


def close(x: np.ndarray, y: np.ndarray, rtol: float | int, atol: float | int) -> np.ndarray:
    """Which elements of two float64 or complex128 arrays lie within `atol + rtol * |y|`.

    An infinity is close only to itself (`|inf - x| <= rtol * inf` would hold for any x);
    NaN is close to NaN; a complex with a NaN part is compared part by part, each part so,
    so that a NaN in one part neither hides the other part's difference nor matches a NaN
    in the other part.
    """
    with np.errstate(invalid="ignore", over="ignore"):
        near = np.abs(x - y) <= atol + rtol * np.abs(y)
    near &= np.isfinite(x) & np.isfinite(y)
    near |= x == y
    if x.dtype.kind != "c":
        return np.asarray(near | (np.isnan(x) & np.isnan(y)))  # 0-d inputs give a NumPy bool
    part_x, part_y = (np.stack([np.real(v), np.imag(v)], axis=-1) for v in (x, y))
    by_parts = close(part_x, part_y, rtol, atol).all(axis=-1)
    return np.asarray(near | ((np.isnan(x) | np.isnan(y)) & by_parts))
