"""Strategies for leaves: NumPy arrays of every dtype a checkpoint stores, and typed keys."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

__all__ = ["DTYPES", "arrays", "keys", "shapes"]

#: A composite strategy's `draw` (hypothesis's `DrawFn` is a Protocol that run-time type
#: checkers such as beartype cannot check).
Draw = Callable[[st.SearchStrategy], Any]

#: Every dtype eqx_train saves, simplest first: a failing example shrinks towards float32
#: and the dtypes nearer the front.
DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(d)
    for d in (
        np.float32,
        np.int32,
        np.bool_,
        np.float16,
        ml_dtypes.bfloat16,
        np.int8,
        np.uint8,
        np.int16,
        np.uint16,
        np.uint32,
        np.int64,
        np.uint64,
        np.float64,
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.float8_e5m2,
        np.complex64,
        np.complex128,
    )
)

_FLOAT_WIDTHS: dict[int, Literal[16, 32, 64]] = {2: 16, 4: 32, 8: 64}  # itemsize -> bits

# Key implementations and the trailing shape of their key data (uint32 words).
_KEY_WORDS = {"threefry2x32": 2, "rbg": 4, "unsafe_rbg": 4}


def shapes(*, max_dims: int = 3, max_side: int = 4) -> st.SearchStrategy[tuple[int, ...]]:
    """Array shapes of rank `0..max_dims` with sides `0..max_side` (so 0-d and zero-size
    shapes too), shrinking towards `()`.

    **Arguments:**

    - `max_dims`: the largest rank.
    - `max_side`: the largest side.

    **Returns:**

    A strategy of shape tuples.
    """
    return hnp.array_shapes(min_dims=0, max_dims=max_dims, min_side=0, max_side=max_side)


_default_shapes = shapes  # for the functions below, whose argument `shapes` shadows it


def _as_strategy(value: Any, what: str) -> st.SearchStrategy:
    if isinstance(value, st.SearchStrategy):
        return value
    if what == "shapes":
        return st.just(tuple(value))
    if isinstance(value, str | type | np.dtype):  # one dtype, as hypothesis's arrays take it
        return st.just(np.dtype(value))
    return st.sampled_from([np.dtype(d) for d in value])


def _special_bits(dtype: np.dtype) -> tuple[int, ...]:
    """Bit patterns of `dtype` that a bit-exact round trip must keep and that a careless one
    changes: -0.0 and NaNs other than the canonical one (another sign or payload)."""
    bits = np.dtype(f"uint{dtype.itemsize * 8}")
    canonical = int(np.full((), np.nan, dtype).view(bits))
    negative_zero = 1 << (dtype.itemsize * 8 - 1)
    if dtype.itemsize <= 2:  # few enough patterns to ask the dtype which are NaN
        every = np.arange(1 << (dtype.itemsize * 8), dtype=bits)
        nans = every[np.isnan(every.view(dtype).astype(np.float32))]
    else:  # IEEE binary32/64: exponent all ones, mantissa not zero
        mantissa = np.finfo(dtype).nmant
        exponent = ((1 << (dtype.itemsize * 8 - 1 - mantissa)) - 1) << mantissa
        nans = np.array([exponent | 1, negative_zero | exponent | ((1 << mantissa) - 1)], bits)
    others = [int(n) for n in nans if int(n) != canonical]
    return (negative_zero, *sorted({others[0], others[-1]}))


# Computed once, not while drawing (hypothesis expects a draw to touch no other state).
_SPECIAL_BITS = {
    d: _special_bits(d)
    for d in DTYPES
    if d.kind == "f" or d.kind == "V" or d.name.startswith(("bfloat16", "float8"))
}


@st.composite
def _with_special_values(draw: Draw, values: np.ndarray) -> np.ndarray:
    """`values` (floats), sometimes with one element replaced by -0.0 or a NaN of another
    sign or payload than the canonical NaN, which the elements strategy alone seldom draws;
    shrinks to `values` unchanged."""
    specials = _SPECIAL_BITS.get(values.dtype)  # None for a float dtype no checkpoint stores
    if values.size == 0 or specials is None or not draw(st.booleans()):
        return values
    bits = np.array(values, order="C").reshape(-1).view(f"uint{values.dtype.itemsize * 8}")
    at = draw(st.integers(0, values.size - 1))
    bits[at] = draw(st.sampled_from(specials))
    return bits.view(values.dtype).reshape(values.shape)


@st.composite
def _arrays(draw: Draw, dtypes: st.SearchStrategy, shapes_: st.SearchStrategy) -> np.ndarray:
    dtype = np.dtype(draw(dtypes))
    shape = tuple(draw(shapes_))
    if dtype.kind == "V" or dtype.name.startswith(("bfloat16", "float8")):
        # ml_dtypes floats: any bit pattern is a value (NaNs with any payload, -0.0,
        # infinities where the format has them), and zero bits shrink to +0.0.
        bits = np.dtype(f"uint{dtype.itemsize * 8}")
        return draw(_with_special_values(draw(hnp.arrays(bits, shape)).view(dtype)))
    if dtype.kind == "f":
        width = _FLOAT_WIDTHS[dtype.itemsize]
        values = draw(hnp.arrays(dtype, shape, elements=st.floats(width=width)))
        return draw(_with_special_values(values))
    if dtype.kind == "c":
        # Real and imaginary parts drawn as floats, each any kind of value on its own (NaN
        # beside a finite part, -0.0, infinities), then read as the complex pairs they are.
        part = np.dtype(f"float{dtype.itemsize * 4}")
        width = _FLOAT_WIDTHS[part.itemsize]
        pairs = draw(hnp.arrays(part, (*shape, 2), elements=st.floats(width=width)))
        return draw(_with_special_values(pairs)).view(dtype).reshape(shape)
    return draw(hnp.arrays(dtype, shape))


def arrays(
    dtypes: Sequence[Any] | st.SearchStrategy | Any = DTYPES,
    shapes: tuple[int, ...] | st.SearchStrategy | None = None,
) -> st.SearchStrategy[np.ndarray]:
    """NumPy arrays of any dtype eqx_train saves (`DTYPES`: bool, every int and uint width
    up to 64 bits, float16/32/64, bfloat16, float8_e4m3fn, float8_e5m2, complex64 and
    complex128), 0-d and empty shapes included.

    Floats take every kind of value: infinities, NaN, `-0.0`, subnormals; bfloat16 and the
    float8s are drawn as raw bit patterns, so NaN payloads too; each part of a complex
    takes any float value on its own. A float array often has one element set to `-0.0` or
    to a NaN of another sign or payload than the canonical NaN, the values a round trip
    that is not bit-exact changes. Shrinks towards 0-d
    float32 zeros.

    **Arguments:**

    - `dtypes`: the dtypes to draw from (a sequence, simplest first, one dtype, or a
      strategy of dtypes). Default: `DTYPES`.
    - `shapes`: a fixed shape, or a strategy of shapes. Default: `shapes()`, rank 0 to 3,
      sides 0 to 4.

    **Returns:**

    A strategy of NumPy arrays; wrap it (`.map(jnp.asarray)`) for JAX arrays.
    """
    shape_strategy = _default_shapes() if shapes is None else _as_strategy(shapes, "shapes")
    return _arrays(_as_strategy(dtypes, "dtypes"), shape_strategy)


@st.composite
def _keys(draw: Draw, impls: st.SearchStrategy, shapes_: st.SearchStrategy) -> jax.Array:
    impl = draw(impls)
    shape = tuple(draw(shapes_))
    data = draw(hnp.arrays(np.uint32, (*shape, _KEY_WORDS[impl])))
    return jax.random.wrap_key_data(jnp.asarray(data), impl=impl)


def keys(
    impls: Sequence[str] | str = tuple(_KEY_WORDS),
    shapes: tuple[int, ...] | st.SearchStrategy = (),
) -> st.SearchStrategy[jax.Array]:
    """Typed PRNG keys (`jax.random.key`'s kind, not legacy uint32 keys) with random key
    data, shrinking towards a single threefry key of zeros.

    **Arguments:**

    - `impls`: the key implementations to draw from, simplest first, or one name
      (default: `"threefry2x32"`, `"rbg"`, `"unsafe_rbg"`).
    - `shapes`: the key array's shape (default `()`, one key), or a strategy of shapes.

    **Returns:**

    A strategy of typed key arrays.
    """
    impls = (impls,) if isinstance(impls, str) else tuple(impls)  # one name, or several
    unknown = [impl for impl in impls if impl not in _KEY_WORDS]
    if unknown or not impls:
        raise ValueError(f"keys: unknown key implementation(s) {unknown}; use {list(_KEY_WORDS)}.")
    return _keys(st.sampled_from(list(impls)), _as_strategy(shapes, "shapes"))
