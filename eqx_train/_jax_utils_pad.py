"""`pad_shard_unpad`: a pmapped or mesh-sharded function run on any batch size (pad the
batch to a multiple of the devices, shard it, run, drop the padding)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ._tree import is_array, path_to_name


def _argument_names(wrapped: Callable[..., Any]) -> list[str] | None:
    try:
        params = inspect.signature(wrapped).parameters.values()
    except (TypeError, ValueError):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _batch_size(label: str, tree: PyTree, sizes: dict[int, str]) -> None:
    for path, leaf in jtu.tree_flatten_with_path(tree)[0]:
        if not is_array(leaf):
            continue
        where = f"{label} leaf '{path_to_name(path)}'"
        if np.ndim(leaf) == 0:
            raise ValueError(
                f"pad_shard_unpad: {where} is a scalar; every leaf of a padded argument needs "
                "a leading batch axis. Mark the argument static (static_argnums / "
                "static_argnames) to pass it through unchanged."
            )
        sizes.setdefault(int(np.shape(leaf)[0]), where)


def batch_sharding(
    mesh: Mesh, batch_axis: str | Sequence[str] | None, *, caller: str
) -> tuple[NamedSharding, int]:
    """The sharding that splits a leading batch axis over `batch_axis` (default: every mesh
    axis), and how many shards that makes. Raises naming `caller` for an unknown axis."""
    if batch_axis is None:
        axes = tuple(mesh.axis_names)
    else:
        axes = (batch_axis,) if isinstance(batch_axis, str) else tuple(batch_axis)
    unknown = [a for a in axes if a not in mesh.axis_names]
    if unknown or not axes:
        raise ValueError(
            f"{caller}: batch_axis {batch_axis!r} must name axes of the mesh; its axes are "
            f"{tuple(mesh.axis_names)}."
        )
    count = int(np.prod([mesh.shape[a] for a in axes]))
    return NamedSharding(mesh, PartitionSpec(axes)), count


def pad_rows(x: Any, total: int) -> np.ndarray:
    """Copies `x` into a zero-padded host array of leading size `total` (one copy)."""
    host = np.asarray(x)
    if host.shape[0] == total:
        return host
    out = np.empty((total, *host.shape[1:]), dtype=host.dtype)
    out[: host.shape[0]] = host
    out[host.shape[0] :] = 0
    return out


def pad_shard_unpad(
    wrapped: Callable[..., Any],
    static_argnums: Sequence[int] = (0,),
    static_argnames: Sequence[str] = (),
    static_return: bool = False,
    *,
    mesh: Mesh | None = None,
    batch_axis: str | Sequence[str] | None = None,
) -> Callable[..., Any]:
    """Wraps `wrapped` so that it accepts any batch size: pad, shard, call, unshard, unpad.

    **pmap style** (default, as flax): `wrapped` is a pmapped function. Every non-static
    argument's array leaves share a batch size `b`; they are zero-padded on the host to
    `n * db` rows (`n = jax.local_device_count()`, `db = ceil(b / n)`, at least
    `min_device_batch`) and reshaped to `(n, db, ...)`. Outputs of shape `(n, db, ...)` are
    brought to the host, reshaped back and cut to the first `b` rows; other outputs (per-device
    scalars or metrics of shape `(n,)`, `(n, k)`) are returned as host arrays unchanged.

    **mesh style** (`mesh=`): `wrapped` is a `jax.jit` function over the whole batch. Inputs
    are padded to a multiple of the number of devices along `batch_axis` (all mesh axes by
    default) and placed with `NamedSharding(mesh, PartitionSpec(batch_axis))`; outputs whose
    leading size is the padded batch are cut back to `b` rows.

    **Arguments:**

    - `wrapped`: the function to wrap, `wrapped(params, *args, **kwargs)`.
    - `static_argnums`: positional arguments passed through unchanged (default `(0,)`,
      the params).
    - `static_argnames`: keyword arguments passed through unchanged.
    - `static_return`: return the output of `wrapped` untouched (e.g. summed metrics).
    - `mesh`, `batch_axis`: select the mesh style (see above).

    **Returns:**

    `wrapper(*args, min_device_batch=None, **kwargs)`. `min_device_batch` forces at least
    that many rows per device, so the last, smaller batch does not trigger a recompile.

    **Raises:**

    `ValueError` naming the argument and leaf path for a leaf without a batch axis, and for
    leaves whose batch sizes differ (flax raises an anonymous `AssertionError`).
    """
    if mesh is not None:
        mesh_sharding, mesh_devices = batch_sharding(mesh, batch_axis, caller="pad_shard_unpad")
    else:
        mesh_sharding, mesh_devices = None, 0
    names = _argument_names(wrapped)
    static_nums = frozenset(static_argnums)
    static_names = frozenset(static_argnames)

    @functools.wraps(wrapped)
    def wrapper(*args: Any, min_device_batch: int | None = None, **kwargs: Any) -> Any:
        n = mesh_devices or jax.local_device_count()
        sizes: dict[int, str] = {}
        for i, arg in enumerate(args):
            if i not in static_nums:
                label = f"argument {i}" + (f" ('{names[i]}')" if names and i < len(names) else "")
                _batch_size(label, arg, sizes)
        for key, value in kwargs.items():
            if key not in static_names:
                _batch_size(f"keyword argument '{key}'", value, sizes)
        if len(sizes) > 1:
            found = "; ".join(f"{where} has batch size {b}" for b, where in sizes.items())
            raise ValueError(f"pad_shard_unpad: inconsistent batch sizes: {found}.")
        if not sizes:
            raise ValueError("pad_shard_unpad: no argument has an array to pad.")
        (b,) = sizes
        per_device = -(-b // n)
        if min_device_batch:
            per_device = max(per_device, int(min_device_batch))
        total = n * per_device

        def pad(tree: PyTree) -> PyTree:
            def one(x: Any) -> Any:
                if not is_array(x):
                    return x
                padded = pad_rows(x, total)
                if mesh_sharding is not None:
                    return padded
                return padded.reshape(n, per_device, *padded.shape[1:])

            out = jtu.tree_map(one, tree)
            return jax.device_put(out, mesh_sharding) if mesh_sharding is not None else out

        new_args = [a if i in static_nums else pad(a) for i, a in enumerate(args)]
        new_kwargs = {k: v if k in static_names else pad(v) for k, v in kwargs.items()}
        out = wrapped(*new_args, **new_kwargs)
        if static_return:
            return out

        def unpad(host: Any) -> Any:
            if not is_array(host):
                return host
            host = np.asarray(host)
            if mesh_sharding is not None:
                return host[:b] if host.ndim and host.shape[0] == total else host
            if host.ndim >= 2 and host.shape[:2] == (n, per_device):
                return host.reshape(total, *host.shape[2:])[:b]
            return host

        return jtu.tree_map(unpad, jax.device_get(out))  # one transfer for all outputs

    return wrapper
