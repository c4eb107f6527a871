"""Per-leaf transforms of saved tensors (`transform=`): a saved tensor stored in another
layout than the target's (a transposed kernel, a fused QKV projection) is reshaped on the
host after it is read and before it is cast, shape-checked and placed.

A transform is given as a mapping of target-name prefixes to functions `array -> array`, or
as one function `(target_name, array) -> array | None` (None: no transform for that leaf).
The matcher (`_matching.match`) learns each transform's output shape and dtype without
reading any tensor data, by running it under `jax.eval_shape` on a `jax.ShapeDtypeStruct`
of the saved tensor; the restore then runs it on the saved tensor as a read-only NumPy
array (`apply`) and checks that it returned what the evaluation promised.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

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

Transform = Mapping[str, Callable[[Any], Any]] | Callable[[str, Any], Any] | None
Shape = tuple[int, ...]

_TRACEABLE = (
    "a transform is first evaluated by jax.eval_shape on a jax.ShapeDtypeStruct of the "
    "saved tensor, to learn its output shape without reading data, so it must trace: use "
    "array methods and jnp or NumPy functions (a.T, a.transpose(1, 0), a.reshape(...), "
    "a[..., :n]), not np.asarray or Python decisions on values"
)


class TransformError(ValueError):
    """A transform failed or returned something that cannot fill its leaf (the message
    names neither leaf nor caller: the matcher and the restore add them)."""


def check_transform(transform: Any) -> None:
    """Raises `TypeError` for a `transform` that is neither None, a
    mapping of target-name prefixes (str) to functions, nor a function."""
    if transform is None:
        return
    if isinstance(transform, Mapping):
        bad = [(k, v) for k, v in transform.items() if not isinstance(k, str) or not callable(v)]
        if not bad:
            return
        key, value = bad[0]
        raise TypeError(
            f"{call()}: transform must map target name prefixes (str) to functions "
            f"array -> array; its entry {short(key)}: {short(value)} is not one."
        )
    if not callable(transform):
        raise TypeError(
            f"{call()}: transform must be a mapping of target name prefixes to functions "
            "array -> array, or a function (target_name, array) -> array | None, got "
            f"{short(transform)}."
        )


def bind(transform: Transform, name: str, chosen: Callable[[Any], Any] | None) -> Any:
    """The one-argument function that transforms target leaf `name`'s saved tensor: the
    mapping's `chosen` entry, or the function form with the leaf's name given."""
    if transform is None or isinstance(transform, Mapping):
        return chosen
    return lambda array: transform(name, array)


def evaluate(
    fn: Callable[[Any], Any], shape: Shape, dtype: np.dtype, *, none_ok: bool
) -> tuple[Shape, np.dtype] | None:
    """(shape, dtype) of `fn`'s output for a saved tensor of `shape` and `dtype`, learnt by
    `jax.eval_shape` (no data is read or allocated); None when `fn` returned None and
    `none_ok` (the function form's "no transform for this leaf").

    **Raises:**

    `TransformError` when `fn` raises, does not trace, or returns something other than one
    array."""
    returned: list[Any] = []

    def traced(array: Any) -> Any:
        out = fn(array)
        returned.append(out)
        if isinstance(out, np.ndarray | np.generic):
            return jnp.asarray(out)
        return out if isinstance(out, jax.Array) else None

    try:
        # The dtype JAX would trace it as (float64 is float32 without x64): a
        # ShapeDtypeStruct of a dtype JAX lacks warns in newer JAX.
        traced_as = jax.dtypes.canonicalize_dtype(dtype)
        out = jax.eval_shape(traced, jax.ShapeDtypeStruct(shape, traced_as))
    except Exception as error:
        raise TransformError(
            f"the transform raised {type(error).__name__} on the saved tensor "
            f"{_describe(shape, dtype)}: {_first_line(error)} ({_TRACEABLE})"
        ) from error
    if out is None:
        if none_ok and returned[0] is None:
            return None
        raise TransformError(
            f"the transform returned {type(returned[0]).__name__}, not an array (it must "
            f"return one array for the saved tensor {_describe(shape, dtype)})"
        )
    out_dtype = np.dtype(out.dtype)
    # Under 32-bit JAX a 64-bit ShapeDtypeStruct traces as 32 bits: a transform that keeps
    # the dtype keeps the saved one, as NumPy does when the restore runs it.
    if out_dtype == np.dtype(jax.dtypes.canonicalize_dtype(dtype)):
        out_dtype = np.dtype(dtype)
    return tuple(int(d) for d in out.shape), out_dtype


def apply(fn: Callable[[Any], Any], array: np.ndarray, shape: Shape, dtype: np.dtype) -> np.ndarray:
    """`fn` run on the saved tensor `array` (a read-only NumPy array: several leaves may be
    cut from one saved tensor), as a C-contiguous NumPy array, checked to be of the
    `shape` and `dtype` its evaluation promised.

    **Raises:**

    `TransformError` when `fn` raises or returns something else."""
    try:
        out = fn(_read_only(array))
    except Exception as error:
        raise TransformError(
            f"the transform raised {type(error).__name__} on the saved tensor "
            f"{_describe(array.shape, array.dtype)}: {_first_line(error)}"
        ) from error
    if not isinstance(out, np.ndarray | np.generic | jax.Array):
        raise TransformError(f"the transform returned {type(out).__name__}, not an array")
    result = np.asarray(out)
    if result.shape != shape or result.dtype != dtype:
        raise TransformError(
            f"the transform returned {_describe(result.shape, result.dtype)} where its "
            f"evaluation on a jax.ShapeDtypeStruct gave {_describe(shape, dtype)}"
            + (
                " (jnp functions compute 64-bit data in 32 bits unless jax_enable_x64 is "
                "set: use NumPy's functions or array methods)"
                if result.dtype != dtype
                else ""
            )
        )
    return result if result.flags.c_contiguous else np.ascontiguousarray(result)


def _read_only(array: np.ndarray) -> np.ndarray:
    """`array`'s bytes seen through a read-only buffer. A view merely flagged read-only can
    be flagged writable again (`a.flags.writeable = True`) when the memory under it is, and
    a transform writing there would change every other leaf cut from the same saved tensor;
    over a read-only buffer NumPy refuses that."""
    # No copy for what the readers return (`np.ascontiguousarray` would make a 0-d one 1-d).
    contiguous = array if array.flags.c_contiguous else array.copy(order="C")
    raw = contiguous.reshape(-1).view(np.uint8).data.toreadonly()
    # `np.frombuffer` keeps the read-only buffer as the base (`np.ndarray(buffer=...)`
    # would look through it to the writable array).
    return np.frombuffer(raw, contiguous.dtype).reshape(contiguous.shape)


def permutation_hint(name: str, saved: Shape, target: Shape) -> str:
    """When `saved` is a reordering of `target`'s axes (and not `target` itself), the
    `transform=` that reorders it, as the end of a shape refusal; else ""."""
    if saved == target or sorted(saved) != sorted(target):
        return ""
    free = list(range(len(saved)))
    axes = []
    for size in target:
        axis = next(a for a in free if saved[a] == size)
        free.remove(axis)
        axes.append(axis)
    return (
        f"; the saved shape is a permutation of the target's: "
        f"transform={{{name!r}: lambda a: a.transpose({', '.join(map(str, axes))})}} "
        "would fit it"
    )


def only_unit_axes(saved: Shape, target: Shape) -> bool:
    """Whether `saved` and `target` differ, but only in axes of size 1 (a flax or PyTorch
    conv bias (8,) for Equinox's (8, 1, 1)): the same values in the same order."""
    saved, target = tuple(saved), tuple(target)
    return saved != target and [d for d in saved if d != 1] == [d for d in target if d != 1]


class Reshape:
    """The transform that fills a leaf from a saved tensor differing only in size-1 axes:
    every reading call accepts one and its plan shows it (`convention`)."""

    def __init__(self, shape: Shape):
        self.shape = tuple(shape)
        self.convention = "reshaped: the shapes differ only in axes of size 1"

    def __call__(self, array: Any) -> Any:
        return array.reshape(self.shape)


def unit_axes(shape: Shape) -> Reshape:
    """The reshape to `shape` of a saved tensor that differs from it only in size-1 axes."""
    return Reshape(shape)


# The last name segment of a weight in flax's layout (inputs first, conv kernels HWIO),
# and in Equinox's (outputs first, OIHW), as both libraries name them.
_FLAX_KERNEL, _EQUINOX_WEIGHT = "kernel", "weight"


def layouts_differ(saved_name: str, target_name: str, saved: Shape, target: Shape) -> bool:
    """Whether a saved tensor named like a flax kernel fills a leaf named like an Equinox
    weight, or the other way (renamed, with no transform), with a shape that converting the
    layout leaves as it is (a square Dense kernel; a conv kernel as many channels in as
    out, as wide as it is deep): the shapes cannot tell the layouts apart, and taken as
    saved the kernel would load untransposed and silently compute something else."""
    ends = (saved_name.rsplit(".", 1)[-1], target_name.rsplit(".", 1)[-1])
    saved, target = tuple(saved), tuple(target)
    if len(saved) < 2 or saved != target:
        return False
    if ends == (_FLAX_KERNEL, _EQUINOX_WEIGHT):  # (*K, I, O) -> (O, I, *K)
        return (saved[-1], saved[-2], *saved[:-2]) == saved
    if ends == (_EQUINOX_WEIGHT, _FLAX_KERNEL):  # (O, I, *K) -> (*K, I, O)
        return (*saved[2:], saved[1], saved[0]) == saved
    return False


def layout_hint(saved_name: str, target_name: str) -> str:
    """For a flax kernel refused for an Equinox weight's shape (or the other way), the
    layout preset that converts it, as the end of the refusal; else ""."""
    ends = (saved_name.rsplit(".", 1)[-1], target_name.rsplit(".", 1)[-1])
    if ends == (_FLAX_KERNEL, _EQUINOX_WEIGHT):
        return "; a flax kernel: the layout preset eqx_train.interop.flax_to_equinox converts it"
    if ends == (_EQUINOX_WEIGHT, _FLAX_KERNEL):
        return (
            "; an Equinox weight: the layout preset eqx_train.interop.equinox_to_flax converts it"
        )
    return ""


def layout_refusal(saved_name: str, target_name: str) -> str:
    """Why a kernel/weight pair (`layouts_differ`) is refused, and what to pass."""
    to_equinox = saved_name.rsplit(".", 1)[-1] == _FLAX_KERNEL
    flax, equinox = (
        "a flax kernel (inputs first; a conv kernel HWIO)",
        ("an Equinox weight (outputs first; a conv weight OIHW)"),
    )
    what, into = (flax, equinox) if to_equinox else (equinox, flax)
    preset = "flax_to_equinox(target)" if to_equinox else "equinox_to_flax(target, model)"
    return (
        f"the saved '{saved_name}' is {what} and the target's leaf is {into}: taken as "
        f"saved it would load untransposed. Pass the layout preset "
        f"(**eqx_train.interop.{preset}), or a transform for this leaf "
        f"(transform={{{target_name!r}: lambda a: a}} takes it as saved)"
    )


def _first_line(error: Exception) -> str:
    """An exception's message, its first line only (JAX's run to many)."""
    lines = str(error).strip().splitlines()
    return short(lines[0] if lines else "", 200)


def _describe(shape: Any, dtype: Any) -> str:
    return f"{tuple(shape)} {np.dtype(dtype)}"
