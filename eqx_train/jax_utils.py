"""Multi-device utilities with `flax.jax_utils`' API, for Equinox models on today's JAX.

Two tracks. The **pmap track** is flax's: `replicate` / `unreplicate` move whole pytrees
with one transfer per call, keep the non-array leaves of Equinox modules, and never gather
replicas; `pad_shard_unpad` runs a pmapped function on any batch size; `prefetch_to_device`,
`pmean` and `partial_eval_by_shape` complete flax's set. The **mesh track** (`jax.jit` over
a `Mesh`) uses the same names where they fit (`prefetch_to_device` with a sharding,
`pad_shard_unpad(mesh=...)`), JAX's own one-liners where JAX has them (replicating a state
is `eqx.filter_shard(state, NamedSharding(mesh, PartitionSpec()))`), and `fsdp_sharding`
for parameters and optimiser state sharded over a mesh axis. Built on public JAX APIs only.
"""

from __future__ import annotations

import collections
import functools
import inspect
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.extend import core as jex_core
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ._tree import is_array, map_array_leaves_batched, path_to_name

__all__ = [
    "fsdp_sharding",
    "pad_shard_unpad",
    "partial_eval_by_shape",
    "pmean",
    "prefetch_to_device",
    "replicate",
    "unreplicate",
]

_AXIS = "devices"

#: `jax.Device` (pyright cannot use JAX's alias of it as a type).
Device = Any
# A pytree's type, kept by functions that return a pytree of the same structure (the
# Equinox convention: `eqx.filter` returns the model's type with leaves replaced).
T = TypeVar("T")


def _device_axis_sharding(devices: Sequence[Device]) -> NamedSharding:
    """Leading axis split over `devices` in order: the layout `jax.pmap` expects."""
    mesh = Mesh(np.asarray(devices), (_AXIS,))
    return NamedSharding(mesh, PartitionSpec(_AXIS))


def replicate(tree: T, devices: Sequence[Device] | None = None) -> T:
    """Returns `tree` with a leading device axis on every array leaf, one replica per device.

    The result is laid out as `jax.pmap` expects (replica `i` lives on `devices[i]`), so
    `jax.pmap(f)(replicate(params), batch)` and `eqx.filter_pmap` work directly.

    **Arguments:**

    - `tree`: any pytree; an Equinox model may hold activation functions, static fields or
      `None`: every leaf that is not an array (including Python scalars) is returned as is.
    - `devices`: the devices to replicate to; `jax.local_devices()` by default (pmap's order).

    **Returns:**

    The pytree with each array leaf `x` replaced by a `jax.Array` of shape `(n, *x.shape)`.

    The whole tree moves in one `jax.device_put` to a replicated layout whose per-device
    buffers become the device-axis array without a further copy (flax first stacks `n` host
    copies). On CPU devices, which share host memory, all replicas alias one read-only host
    copy of each leaf.
    """
    devices = list(jax.local_devices() if devices is None else devices)
    if not devices:
        raise ValueError("replicate: `devices` is empty.")
    target = _device_axis_sharding(devices)

    def replicate_all(leaves: list[Any]) -> list[jax.Array]:
        if all(d.platform == "cpu" for d in devices):
            per_device = _replicate_on_cpu(leaves, devices)
        else:
            per_device = _replicate_by_transfer(leaves, devices, target)
        return [
            jax.make_array_from_single_device_arrays(
                (len(devices), *buffers[0].shape[1:]), target, buffers
            )
            for buffers in per_device
        ]

    return map_array_leaves_batched(replicate_all, tree)


def _replicate_by_transfer(
    leaves: list[Any], devices: list[Device], target: NamedSharding
) -> list[list[jax.Array]]:
    """One `device_put` of the whole tree to a replicated layout; its per-device buffers
    already have the `(1, *shape)` shape of a device-axis shard, so no further copy."""
    replicated = NamedSharding(target.mesh, PartitionSpec())
    placed = jax.device_put([leaf[None] for leaf in leaves], replicated)
    order = {d: k for k, d in enumerate(devices)}
    return [
        [s.data for s in sorted(array.addressable_shards, key=lambda s: order[s.device])]
        for array in placed
    ]


_XLA_ALIGNMENT = 64


def _aligned_copy(array: np.ndarray) -> np.ndarray:
    """A copy of `array` whose data starts on a 64-byte boundary (XLA only adopts such)."""
    raw = np.empty(array.nbytes + _XLA_ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % _XLA_ALIGNMENT
    out = raw[start : start + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


def _replicate_on_cpu(leaves: list[Any], devices: list[Device]) -> list[list[jax.Array]]:
    """CPU devices share host memory: every device's buffer aliases one read-only host copy
    (JAX adopts read-only, aligned NumPy memory without copying), so replicating costs one
    copy instead of one per device. The copy also isolates the result from later mutation
    of a NumPy input."""
    hosts = []
    for leaf in leaves:
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            hosts.append(leaf[None])  # key arrays have no NumPy view; transfer them normally
            continue
        host = np.asarray(leaf)[None]
        if host.flags.writeable or host.ctypes.data % _XLA_ALIGNMENT:
            host = _aligned_copy(host)
            host.flags.writeable = False
        hosts.append(host)
    flat = jax.device_put([h for h in hosts for _ in devices], [d for _ in hosts for d in devices])
    n = len(devices)
    return [flat[k * n : (k + 1) * n] for k in range(len(hosts))]


def _one_replica(x: Any) -> Any:
    """One replica of array `x`, or `(host_view, device)` when it is best made by the batched
    `device_put` in `unreplicate` (CPU: JAX adopts a read-only NumPy view of the buffer
    without copying, and keeps the source alive, declining to donate it, while it lives)."""
    if not isinstance(x, jax.Array):
        return x[0] if x.ndim else x
    if x.ndim == 0:
        return x
    data = x.addressable_shards[0].data
    if x.sharding.is_fully_replicated and len(x.sharding.device_set) > 1:
        return data  # every device holds the whole array: it is one replica already (as flax)
    if data.shape[0] != 1:
        return x[0]
    (device,) = data.devices()
    if device.platform == "cpu" and not jnp.issubdtype(data.dtype, jax.dtypes.prng_key):
        return (np.asarray(data)[0], device)
    return data.reshape(data.shape[1:])


def _unreplicate_all(leaves: list[Any]) -> list[Any]:
    results = [_one_replica(leaf) for leaf in leaves]
    pending = [i for i, r in enumerate(results) if isinstance(r, tuple)]
    if pending:
        views, devices = zip(*(results[i] for i in pending), strict=True)
        for i, array in zip(pending, jax.device_put(list(views), list(devices)), strict=True):
            results[i] = array
    return results


def unreplicate(tree: T) -> T:
    """Returns one replica of a replicated pytree: element 0 of every array leaf's first axis.

    The replica is read from the device that holds it (`addressable_shards[0]`), never via
    `x[0]` on the global array, which would gather every replica first; on CPU it is a
    zero-copy view of that device's buffer. Non-array leaves are returned unchanged, 0-d
    arrays as they are, and an array fully replicated over several devices is returned as
    its first device's copy (all as flax does).

    **Arguments:**

    - `tree`: a pytree as returned by `replicate` or by a pmapped function.

    **Returns:**

    The pytree with each array leaf's leading device axis removed.
    """
    return map_array_leaves_batched(_unreplicate_all, tree)


def pmean(xs: T, axis_name: Any) -> T:
    """`jax.lax.pmean(xs, axis_name)`: the mean of `xs` over a named mapped axis.

    Kept for flax users (flax's version emits a `DeprecationWarning`; this one does not).
    Use inside `jax.pmap`, `eqx.filter_pmap` or `jax.shard_map` with a matching axis name.
    """
    return jax.lax.pmean(xs, axis_name)


def prefetch_to_device(
    iterator: Iterable[T],
    size: int,
    devices: Sequence[Device] | jax.sharding.Sharding | None = None,
) -> Iterator[T]:
    """Yields the batches of `iterator` already placed on device, keeping `size` in flight.

    **Arguments:**

    - `iterator`: yields pytrees whose array leaves have a leading axis of length
      `len(devices)` (e.g. from `eqx_train.shard`); non-array leaves pass through.
    - `size`: how many batches to transfer ahead (>= 1); 2 is usually right on GPUs, so a
      transfer overlaps each step.
    - `devices`: the devices to shard the leading axis over (default `jax.local_devices()`),
      or any `jax.sharding.Sharding` to place every leaf with (then leaves need only fit that
      sharding, e.g. a batch-sharded `NamedSharding` for a `jax.jit` training step).

    **Yields:**

    The original batches, in order, with array leaves as sharded `jax.Array`s. Each batch is
    transferred with one asynchronous `jax.device_put`; at most `size` transferred batches are
    held at a time. Ends when `iterator` ends.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"prefetch_to_device: size must be an int >= 1, got {size!r}.")
    if isinstance(devices, jax.sharding.Sharding):
        sharding: jax.sharding.Sharding = devices
    else:
        sharding = _device_axis_sharding(list(jax.local_devices() if devices is None else devices))

    def place(batch: T) -> T:
        return map_array_leaves_batched(lambda leaves: jax.device_put(leaves, sharding), batch)

    source = iter(iterator)
    queue: collections.deque[T] = collections.deque(
        place(batch) for batch in itertools.islice(source, size)
    )
    while queue:
        ready = queue.popleft()
        for batch in itertools.islice(source, 1):
            queue.append(place(batch))
        yield ready


# -------------------------------------------------------------------------------- fsdp_sharding


def _fsdp_spec(shape: tuple[int, ...], axis: str, size: int) -> PartitionSpec:
    """Shards the largest dimension that `size` divides (the first of equals); none: `P()`."""
    candidates = [(d, -i) for i, d in enumerate(shape) if d >= size and d % size == 0]
    if not candidates:
        return PartitionSpec()
    _, neg_index = max(candidates)
    spec: list[str | None] = [None] * len(shape)
    spec[-neg_index] = axis
    return PartitionSpec(*spec)


def fsdp_sharding(tree: T, mesh: Mesh, axis: str = "model") -> T:
    """Returns FSDP-style shardings for `tree`: each array split along one dimension over `axis`.

    Every array leaf gets a `NamedSharding(mesh, spec)` that splits its largest dimension
    divisible by the size of mesh axis `axis` over that axis (the first such dimension when
    several are equally large) and replicates it over the other mesh axes. A leaf with no
    such dimension (a scalar step count, a bias shorter than the axis) is replicated:
    `PartitionSpec()`. Non-array leaves get `None`.

    The result is a pytree of the same structure as `tree`, so it can be handed to
    `eqx.filter_shard` (outside `jit`: place the state; inside: constrain it) or used as
    `out_shardings`. The usual one-liner shards a whole `TrainState` (model and optimiser
    state alike, since Adam's moments have the parameters' shapes):

    ```python
    import equinox as eqx, jax, numpy as np, optax
    import eqx_train

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    model = eqx.nn.MLP(16, 4, 32, 2, key=jax.random.key(0))
    state = eqx_train.TrainState.create(model=model, tx=optax.adam(1e-3))
    state = eqx.filter_shard(state, eqx_train.fsdp_sharding(state, mesh, "model"))
    ```

    **Arguments:**

    - `tree`: any pytree; array leaves may be `jax.Array`, NumPy arrays or
      `jax.ShapeDtypeStruct`s (e.g. from `eqx.filter_eval_shape`, to build a restore target
      or to initialise a model that does not fit on one device).
    - `mesh`: the device mesh.
    - `axis`: the mesh axis to split parameters over (default `"model"`).

    **Returns:**

    A pytree like `tree` with a `jax.sharding.NamedSharding` at every array leaf and `None`
    at every other leaf.

    **Raises:**

    `ValueError` when `axis` is not an axis of `mesh`.
    """
    if axis not in mesh.axis_names:
        raise ValueError(
            f"fsdp_sharding: axis {axis!r} is not an axis of the mesh; its axes are "
            f"{tuple(mesh.axis_names)}."
        )
    size = int(mesh.shape[axis])

    def one(leaf: Any) -> NamedSharding | None:
        if not (is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)):
            return None
        return NamedSharding(mesh, _fsdp_spec(tuple(leaf.shape), axis, size))

    return jtu.tree_map(one, tree)


# ------------------------------------------------------------------------------ pad_shard_unpad


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


def _batch_sharding(
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


def _pad_rows(x: Any, total: int) -> np.ndarray:
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
        mesh_sharding, mesh_devices = _batch_sharding(mesh, batch_axis, caller="pad_shard_unpad")
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
                padded = _pad_rows(x, total)
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


# ------------------------------------------------------------------------ partial_eval_by_shape


def _spec_to_struct(spec: Any) -> jax.ShapeDtypeStruct:
    if isinstance(spec, jax.ShapeDtypeStruct):
        return spec
    spec = tuple(spec)
    if len(spec) == 2 and isinstance(spec[0], Iterable):
        return jax.ShapeDtypeStruct(tuple(spec[0]), spec[1])
    return jax.ShapeDtypeStruct(spec, jnp.float32)


def _input_dependent_outputs(jaxpr: Any, dependent_inputs: Sequence[bool]) -> list[bool]:
    """Forward dataflow: which outputs of `jaxpr` depend on the inputs marked True."""
    dependent = {v for v, d in zip(jaxpr.invars, dependent_inputs, strict=True) if d}

    def depends(atom: Any) -> bool:
        return not isinstance(atom, jex_core.Literal) and atom in dependent

    for eqn in jaxpr.eqns:
        inputs = [depends(v) for v in eqn.invars]
        if not any(inputs):
            continue
        inner = eqn.params.get("jaxpr")
        inner_jaxpr = getattr(inner, "jaxpr", inner)
        if (
            isinstance(inner_jaxpr, jex_core.Jaxpr)
            and len(inner_jaxpr.invars) == len(eqn.invars)
            and len(inner_jaxpr.outvars) == len(eqn.outvars)
            and not inner_jaxpr.constvars
        ):
            outputs = _input_dependent_outputs(inner_jaxpr, inputs)
        else:
            outputs = [True] * len(eqn.outvars)
        dependent.update(v for v, d in zip(eqn.outvars, outputs, strict=True) if d)
    return [depends(v) for v in jaxpr.outvars]


def partial_eval_by_shape(
    fn: Callable[..., Any], input_spec: Iterable[Any], *args: Any, **kwargs: Any
) -> Any:
    """Evaluates `fn` knowing only the shapes of its first inputs, like `jax.eval_shape`, but
    returns concrete values for every output that does not depend on those inputs.

    **Arguments:**

    - `fn`: called as `fn(*inputs, *args, **kwargs)`.
    - `input_spec`: one entry per input: a shape (float32), a `(shape, dtype)` pair, or a
      `jax.ShapeDtypeStruct`.
    - `*args`, `**kwargs`: concrete arguments passed after the inputs.

    **Returns:**

    `fn`'s output pytree: `jax.ShapeDtypeStruct` where a leaf depends on the inputs, the
    computed array where it does not (e.g. parameters initialised without data).

    Implemented with `jax.make_jaxpr` and a dependency analysis of the traced program; the
    input-independent outputs are then computed by `jax.jit`, which drops everything else.
    """
    structs = [_spec_to_struct(spec) for spec in input_spec]

    def bound(*inputs: Any) -> Any:
        return fn(*inputs, *args, **kwargs)

    closed, out_shapes = jax.make_jaxpr(bound, return_shape=True)(*structs)
    out_structs, out_tree = jtu.tree_flatten(out_shapes)
    dependent = _input_dependent_outputs(closed.jaxpr, [True] * len(closed.jaxpr.invars))
    known = [i for i, d in enumerate(dependent) if not d]
    values: list[Any] = []
    if known:

        def known_outputs(*inputs: Any) -> list[Any]:
            flat = jtu.tree_leaves(bound(*inputs))
            return [flat[i] for i in known]

        zeros = [jnp.zeros(s.shape, s.dtype) for s in structs]
        values = jax.jit(known_outputs)(*zeros)
    results = list(out_structs)
    for i, value in zip(known, values, strict=True):
        results[i] = value
    return jtu.tree_unflatten(out_tree, results)
