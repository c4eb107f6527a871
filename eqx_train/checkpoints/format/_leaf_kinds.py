"""The leaf kinds and dtypes: which leaves a checkpoint holds as tensors, and how each is
saved, rebuilt and filled into a target.

One table (`LEAF_KINDS`) says which leaf kinds exist and how each is saved, rebuilt and
filled into a target; one table (`CODE_TO_DTYPE`) which dtypes a tensor may have and their
safetensors codes. A `Tensor` is one leaf as the writer sees it.
"""

from __future__ import annotations

import cmath
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

if TYPE_CHECKING:
    import jax
    import jax.numpy as jnp
else:  # imported on first use: the command line reads headers without JAX
    from ..._lazy import LazyModule

    jax = LazyModule("jax")
    jnp = LazyModule("jax.numpy")

from ..._calls import call
from ..._text import short
from ..._tree import as_weak, place_like

MAX_DEPTH = 200  # nesting of a tree description; deeper trees are refused when saving too

Arrays = Mapping[str, tuple[tuple[int, ...], np.dtype]]
"""Every tensor of a checkpoint: name -> (shape, dtype)."""

DTYPE_TO_CODE: dict[np.dtype, str] = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint16): "U16",
    np.dtype(np.int16): "I16",
    np.dtype(np.uint32): "U32",
    np.dtype(np.int32): "I32",
    np.dtype(np.uint64): "U64",
    np.dtype(np.int64): "I64",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(ml_dtypes.float8_e5m2): "F8_E5M2",
    np.dtype(np.complex64): "C64",
    # Not a safetensors code: a file's header stores a complex128 tensor as F64 with a
    # trailing axis of 2 (`_format`); this code names it in checksums and `.shards` indexes.
    np.dtype(np.complex128): "C128",
}
CODE_TO_DTYPE = {code: dtype for dtype, code in DTYPE_TO_CODE.items()}


def dtype_code(dtype: Any, name: str) -> str:
    try:
        return DTYPE_TO_CODE[np.dtype(dtype)]
    except (KeyError, TypeError):
        supported = ", ".join(sorted(str(d) for d in DTYPE_TO_CODE))
        raise TypeError(
            f"{call()}: leaf '{name}' has dtype {dtype}, which safetensors cannot store. "
            f"Supported dtypes: {supported}."
        ) from None


# --------------------------------------------------------------------------------------------
# The leaf kinds: one table, used to describe a tree, rebuild it, and fill a target.


@dataclass(frozen=True)
class Tensor:
    """One tensor to write: its name, a way to get its NumPy value, and the array it came
    from (a `jax.Array` whose shards a multi-process save writes piece by piece). `owned`:
    the source is a snapshot copy made for this save (or `get` holds the caller's buffers in
    place, `_transfer.Pins`), which the writer frees once written."""

    name: str
    get: Callable[[], np.ndarray]
    dtype: np.dtype
    shape: tuple[int, ...]
    source: Any = None
    owned: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def is_prng_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _is_key(x: Any) -> bool:
    """A typed PRNG key, or an abstract one (a `ShapeDtypeStruct` of a key dtype, as
    `eqx.filter_eval_shape` gives for a model holding a key): a target may hold either."""
    return is_prng_key(x) or (
        isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
    )


def key_impl(key: Any) -> Any:
    """The PRNG implementation of a typed key, concrete or abstract."""
    if not isinstance(key, jax.ShapeDtypeStruct):
        return jax.random.key_impl(key)
    found = []

    def key_data(traced: Any) -> Any:
        found.append(jax.random.key_impl(traced))
        return jax.random.key_data(traced)

    jax.eval_shape(key_data, key)
    return found[0]


def _key_data(key: Any) -> Any:
    """A key's data: its uint32 array (a `ShapeDtypeStruct` of it for an abstract key)."""
    if isinstance(key, jax.ShapeDtypeStruct):
        return jax.eval_shape(jax.random.key_data, key)
    return jax.random.key_data(key)


@dataclass(frozen=True)
class LeafKind:
    """How one kind of leaf is saved (as a 0-d or n-d tensor), rebuilt without a target, and
    checked against a target leaf of the same kind."""

    name: str
    test: Callable[[Any], bool]
    data: Callable[[Any], Any]  # the leaf as an array-like with .dtype/.shape
    rebuild: Callable[[np.ndarray, dict[str, Any]], Any]
    # (target leaf, file array; for "array", also the tensor already joined on the target's
    # device from pieces) -> restored leaf
    fill: Callable[[Any, Any], Any]
    scalar_type: type | None = None  # Python scalars: any dtype whose value converts exactly


def _wrap_key(array: np.ndarray, impl: Any) -> Any:
    return jax.random.wrap_key_data(jnp.asarray(array), impl=impl)


def _place_key(data: np.ndarray, like: Any) -> Any:
    """The typed key array of key data `data`, placed as the target key `like`."""
    impl = key_impl(like)
    sharding = getattr(like, "sharding", None)
    if sharding is not None and not sharding.is_fully_addressable:
        # Over several processes: `device_put` refuses a key array made on one device, so
        # every process builds its own blocks from the same host data.
        wrap = functools.partial(jax.random.wrap_key_data, impl=impl)
        return jax.jit(wrap, out_shardings=sharding)(data)
    return place_like(_wrap_key(data, impl), like)


def _exact_scalar(kind: type) -> Callable[[Any, np.ndarray], Any]:
    def fill(leaf: Any, array: np.ndarray) -> Any:
        value = array[()].item()  # a Python number: comparisons below are exact
        try:
            converted = type(leaf)(value)
        except (ValueError, OverflowError, TypeError):
            converted = None
        same = converted is not None and (
            converted == value
            or (
                isinstance(converted, float | complex)
                and cmath.isnan(converted)
                and cmath.isnan(value)
            )
        )
        if not same or (kind is not bool and isinstance(value, bool)):
            raise ValueError(
                f"the file holds {short(value)} ({array.dtype}), not exactly a {kind.__name__}"
            )
        return converted

    return fill


def _rebuild_array(array: np.ndarray, entry: dict[str, Any]) -> Any:
    """A file's array as saved: NumPy, or a weakly typed `jax.Array` when it was one."""
    return as_weak(jnp.asarray(array)) if entry.get("weak_type") else array


LEAF_KINDS: tuple[LeafKind, ...] = (
    LeafKind(
        "prng_key",
        _is_key,
        _key_data,
        lambda a, entry: _wrap_key(a, entry["impl"]),
        lambda leaf, a: _place_key(a, leaf),
    ),
    LeafKind(
        "array",
        lambda x: isinstance(x, jax.Array | np.ndarray | jax.ShapeDtypeStruct),
        lambda x: x,
        _rebuild_array,
        lambda leaf, a: a if isinstance(leaf, np.ndarray) else place_like(a, leaf),
    ),
    LeafKind(
        "numpy_scalar",
        lambda x: isinstance(x, np.generic),
        np.asarray,
        lambda a, entry: a[()],
        lambda leaf, a: a[()],
    ),
    # bool before int before float: an IntEnum is an int, bool is an int too.
    LeafKind(
        "bool",
        lambda x: isinstance(x, bool),
        lambda x: np.asarray(x, np.bool_),
        lambda a, entry: bool(a.item()),
        _exact_scalar(bool),
        bool,
    ),
    LeafKind(
        "int",
        lambda x: isinstance(x, int),
        lambda x: np.asarray(x, np.int64),
        lambda a, entry: int(a.item()),
        _exact_scalar(int),
        int,
    ),
    LeafKind(
        "float",
        lambda x: isinstance(x, float),
        lambda x: np.asarray(x, np.float64),
        lambda a, entry: float(a.item()),
        _exact_scalar(float),
        float,
    ),
    LeafKind(
        "complex",
        lambda x: isinstance(x, complex),
        lambda x: np.asarray(x, np.complex128),
        lambda a, entry: complex(a.item()),
        _exact_scalar(complex),
        complex,
    ),
)
KIND_BY_NAME = {kind.name: kind for kind in LEAF_KINDS}


def kind_of(leaf: Any) -> LeafKind | None:
    """The kind of a tensor leaf, or None for leaves that are not data (str, functions...)."""
    return next((kind for kind in LEAF_KINDS if kind.test(leaf)), None)
