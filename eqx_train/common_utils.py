"""Helpers for data parallelism: `shard`, `shard_prng_key`, `stack_forest`, `get_metrics`,
`onehot` (the `flax.training.common_utils` API, pmap track), `shard_to_mesh`, the mesh
track's counterpart of `shard`, and `numpy_rng_state` / `numpy_rng_from_state`, which put a
NumPy `Generator` into a checkpoint."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Array, ArrayLike, Float, Int, Key

from ._jax_utils_pad import batch_sharding, pad_rows
from ._jax_utils_replicate import unreplicate
from ._tree import is_array, map_array_leaves_batched, map_arrays_with_path, path_to_name

# A pytree's type, kept by the functions that return a pytree of the same structure.
T = TypeVar("T")

__all__ = [
    "get_metrics",
    "numpy_rng_from_state",
    "numpy_rng_state",
    "onehot",
    "shard",
    "shard_prng_key",
    "shard_to_mesh",
    "stack_forest",
]


def shard(xs: T, num_devices: int | None = None) -> T:
    """Splits the leading (batch) axis of every array leaf into `(devices, batch // devices)`.

    **Arguments:**

    - `xs`: a pytree whose array leaves share a leading batch axis. Non-array leaves
      (strings, functions inside an Equinox module, `None`) are returned unchanged.
    - `num_devices`: how many shards; `jax.local_device_count()` by default (as flax).

    **Returns:**

    The same pytree with each array reshaped to `(num_devices, -1, *rest)`, ready for
    `jax.pmap`. Arrays stay where they are (no transfer); NumPy stays NumPy.

    **Raises:**

    `ValueError` naming the leaf path and both sizes when a batch does not divide evenly or a
    leaf has no batch axis (flax raises an anonymous reshape error).
    """
    count = jax.local_device_count() if num_devices is None else num_devices

    def reshape(name: str, x: Any) -> Any:
        if np.ndim(x) == 0:
            raise ValueError(
                f"shard: leaf '{name}' is a scalar; every array leaf needs a leading batch axis "
                f"to split over {count} devices."
            )
        batch = x.shape[0]
        if batch % count:
            raise ValueError(
                f"shard: leaf '{name}' has batch size {batch}, which is not divisible by the "
                f"device count {count}. Pad the batch (see pad_shard_unpad) or drop the remainder."
            )
        return x.reshape((count, batch // count, *x.shape[1:]))

    return map_arrays_with_path(reshape, xs)


def shard_to_mesh(
    xs: T,
    mesh: Mesh,
    batch_axis: str | Sequence[str] | None = None,
    *,
    pad: bool = False,
) -> T:
    """Places a host batch on `mesh`, its leading axis split over `batch_axis`: `shard` for
    the mesh track.

    Where `shard` reshapes to `(devices, batch // devices, ...)` for `jax.pmap`, this keeps
    every array's shape and gives it the layout `NamedSharding(mesh, PartitionSpec(axes))`,
    ready for a `jax.jit` step. All array leaves move in one `jax.device_put`.

    **Arguments:**

    - `xs`: a pytree whose array leaves share a leading batch axis of size `b`. Non-array
      leaves are returned unchanged.
    - `mesh`: the device mesh.
    - `batch_axis`: the mesh axis, or axes, to split the batch over (every mesh axis by
      default, as for an FSDP mesh; `"data"` on a data × model mesh to replicate each row
      over the model axis).
    - `pad`: when `b` is not a multiple of `n` (the number of devices along `batch_axis`),
      append zero rows up to the next multiple instead of raising. The first `b` rows are the
      batch; mask the rest, e.g. with `jnp.arange(padded_size) < b`.

    **Returns:**

    The pytree with each array leaf a `jax.Array` of shape `(b, ...)`, or
    `(n * ceil(b / n), ...)` with `pad=True`, sharded along its first axis.

    **Raises:**

    `ValueError` naming the leaf path and the sizes when a leaf is a scalar, when `b` does
    not divide over `n` devices and `pad` is off, or when leaves disagree on `b`; and when
    `batch_axis` names no axis of `mesh`.
    """
    sharding, count = batch_sharding(mesh, batch_axis, caller="shard_to_mesh")
    sizes: dict[int, str] = {}

    def check(name: str, x: Any) -> Any:
        if np.ndim(x) == 0:
            raise ValueError(
                f"shard_to_mesh: leaf '{name}' is a scalar; every array leaf needs a leading "
                f"batch axis to split over {count} devices."
            )
        sizes.setdefault(int(np.shape(x)[0]), name)
        return x

    map_arrays_with_path(check, xs)
    if len(sizes) > 1:
        found = ", ".join(f"'{name}' has {b}" for b, name in sizes.items())
        raise ValueError(f"shard_to_mesh: leaves disagree on the batch size: {found}.")
    if not sizes:
        return xs
    ((batch, name),) = sizes.items()
    total = -(-batch // count) * count
    if total != batch and not pad:
        axes = sharding.spec[0]
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        raise ValueError(
            f"shard_to_mesh: leaf '{name}' has batch size {batch}, which is not divisible by "
            f"the {count} devices along mesh axes {axes}. Pass pad=True to append "
            f"{total - batch} zero rows (and mask them), or drop the remainder."
        )

    def place(leaves: list[Any]) -> list[Any]:
        host = [x if total == batch else pad_rows(x, total) for x in leaves]
        return jax.device_put(host, sharding)

    return map_array_leaves_batched(place, xs)


def shard_prng_key(prng_key: Key[Array, ""] | ArrayLike, num_devices: int | None = None) -> Array:
    """Splits a PRNG key into one key per local device, for a pmapped function.

    **Arguments:**

    - `prng_key`: a typed key (`jax.random.key`) or a raw `uint32[2]` key (`PRNGKey`).
    - `num_devices`: how many keys; `jax.local_device_count()` by default.

    **Returns:**

    Keys of the same kind with a leading axis of length `num_devices`
    (`jax.random.split(prng_key, num_devices)`, exactly as flax).
    """
    count = jax.local_device_count() if num_devices is None else num_devices
    return jax.random.split(jnp.asarray(prng_key), num=count)


def stack_forest(forest: Sequence[T]) -> T:
    """Stacks a sequence of same-structured pytrees into one pytree of stacked leaves.

    **Arguments:**

    - `forest`: a non-empty sequence of pytrees with the same structure and, leaf by leaf,
      the same shapes. Non-array leaves must be equal across the forest and are kept once.

    **Returns:**

    One pytree whose array leaves have a new leading axis of length `len(forest)`. NumPy
    leaves stack to NumPy (no device transfer), JAX leaves to JAX arrays.
    """
    trees = list(forest)
    if not trees:
        raise ValueError("stack_forest: the forest is empty; there is nothing to stack.")
    first_structure = jax.tree.structure(trees[0])
    for i, tree in enumerate(trees[1:], start=1):
        if jax.tree.structure(tree) != first_structure:
            raise ValueError(
                f"stack_forest: tree {i} has structure {jax.tree.structure(tree)}, but tree 0 "
                f"has {first_structure}."
            )
    paths_and_leaves = [jtu.tree_flatten_with_path(tree)[0] for tree in trees]
    stacked = []
    for j, (path, first) in enumerate(paths_and_leaves[0]):
        column = [leaves[j][1] for leaves in paths_and_leaves]
        name = path_to_name(path)
        if is_array(first) or isinstance(first, int | float | complex | bool):
            shapes = {np.shape(leaf) for leaf in column}
            if len(shapes) > 1:
                raise ValueError(
                    f"stack_forest: leaf '{name}' has different shapes across the forest: "
                    f"{sorted(shapes)}."
                )
            if all(isinstance(leaf, jax.Array) for leaf in column):
                stacked.append(jnp.stack(column))
            else:
                stacked.append(np.stack([np.asarray(leaf) for leaf in column]))
        else:
            if any(leaf is not first and leaf != first for leaf in column[1:]):
                raise ValueError(
                    f"stack_forest: non-array leaf '{name}' differs across the forest "
                    f"(first is {first!r}); only array leaves can be stacked."
                )
            stacked.append(first)
    return jax.tree.unflatten(first_structure, stacked)


def get_metrics(device_metrics: Sequence[T]) -> T:
    """Gathers per-step, replicated device metrics into host NumPy arrays stacked over time.

    **Arguments:**

    - `device_metrics`: a sequence (one entry per step) of pytrees whose array leaves have a
      leading device axis, as returned by a pmapped step.

    **Returns:**

    A pytree of NumPy arrays with leading axis `len(device_metrics)`, holding the first
    replica of each step's metrics. The first replica is read from the device that holds it,
    without gathering the others.

    !!! note "Differences from flax"
        flax's docstring promises host arrays but returns `jax.Array`s; these are NumPy.
    """
    # One replica per step, read from its own device, then one transfer for everything.
    host = jax.device_get([unreplicate(step) for step in device_metrics])
    return stack_forest(jtu.tree_map(lambda x: np.asarray(x) if is_array(x) else x, host))


def onehot(
    labels: Int[ArrayLike, "..."],
    num_classes: int,
    on_value: float = 1.0,
    off_value: float = 0.0,
) -> Float[Array, "... num_classes"]:
    """Returns the one-hot encoding of integer `labels` along a new last axis (float32).

    **Arguments:**

    - `labels`: an integer array of any shape.
    - `num_classes`: length of the new axis; labels outside `[0, num_classes)` give a row of
      `off_value`.
    - `on_value`, `off_value`: the values written (1.0 and 0.0 by default).

    **Returns:**

    A float32 array of shape `labels.shape + (num_classes,)`, as flax's `onehot`. Jit-safe.
    """
    labels = jnp.asarray(labels)
    hits = labels[..., None] == jnp.arange(num_classes).reshape((1,) * labels.ndim + (-1,))
    return jnp.where(hits, on_value, off_value).astype(jnp.float32)


# ------------------------------------------------------------- NumPy generators in checkpoints

# Two uint64 words hold the widest integer a NumPy bit generator keeps (PCG64's 128-bit state
# and increment); every integer of a state is stored this way, so the shapes never depend on
# the values and any generator of the same kind is a restore target.
_WORDS = 2
_WORD = 64


def numpy_rng_state(rng: np.random.Generator) -> dict[str, Any]:
    """Returns the state of a NumPy `Generator` as a pytree a checkpoint can hold.

    `rng.bit_generator.state` holds Python integers of up to 128 bits (PCG64), which no
    array dtype holds, so checkpoints refuse it as a leaf. This is the same state with
    every integer as two `uint64` words (low, high), arrays copied as they are, and the
    bit generator's name kept as a string. Save it with the training state and rebuild the
    generator with `numpy_rng_from_state`; the rebuilt generator continues the stream exactly.

    **Arguments:**

    - `rng`: a `numpy.random.Generator` over any of NumPy's bit generators (PCG64,
      PCG64DXSM, MT19937, Philox, SFC64).

    **Returns:**

    A dict of NumPy arrays and strings. To restore into a target, build the target with
    `numpy_rng_state` of any generator over the same bit generator (e.g.
    `np.random.default_rng(0)` for PCG64).

    **Example:**

    ```python
    import numpy as np
    from eqx_train import numpy_rng_from_state, numpy_rng_state

    rng = np.random.default_rng(7)
    rng.random(3)
    saved = numpy_rng_state(rng)
    expected = rng.random(5)
    assert np.array_equal(numpy_rng_from_state(saved).random(5), expected)
    ```
    """
    if not isinstance(rng, np.random.Generator):
        raise TypeError(
            f"numpy_rng_state: expected a numpy.random.Generator, got {type(rng).__name__}."
        )
    return _encode_rng(rng.bit_generator.state, ())


def _encode_rng(node: Any, path: tuple[str, ...]) -> Any:
    where = path_to_name(path)
    if isinstance(node, dict):
        return {key: _encode_rng(value, (*path, str(key))) for key, value in node.items()}
    if isinstance(node, str):
        return node
    if isinstance(node, int | np.integer):
        value = int(node)
        if not 0 <= value < 2 ** (_WORDS * _WORD):
            raise ValueError(
                f"numpy_rng_state: the integer at '{where}' of the generator's state does not "
                f"fit in {_WORDS * _WORD} unsigned bits: {value}."
            )
        words = [(value >> (_WORD * i)) & (2**_WORD - 1) for i in range(_WORDS)]
        return np.array(words, np.uint64)
    if isinstance(node, np.ndarray):
        return node.copy()
    raise TypeError(
        f"numpy_rng_state: the generator's state holds a {type(node).__name__} at '{where}', "
        "which has no array form."
    )


def numpy_rng_from_state(state: dict[str, Any]) -> np.random.Generator:
    """Returns a new NumPy `Generator` in the state `numpy_rng_state` recorded.

    **Arguments:**

    - `state`: the output of `numpy_rng_state`, or the same tree as restored from a
      checkpoint (NumPy or JAX arrays).

    **Returns:**

    A `numpy.random.Generator` over a new bit generator of the recorded kind, whose next
    draws are those the saved generator would have made.

    **Raises:**

    `ValueError` (or `TypeError`) naming the path in `state` that does not have the shape,
    dtype or kind the recorded bit generator needs, or an unknown bit generator name.
    """
    name = state.get("bit_generator") if isinstance(state, dict) else None
    kind = getattr(np.random, name, None) if isinstance(name, str) else None
    if not (
        isinstance(kind, type)
        and issubclass(kind, np.random.BitGenerator)
        and kind is not np.random.BitGenerator  # the abstract base: no state of its own
    ):
        raise ValueError(
            "numpy_rng_from_state: 'bit_generator' must name one of NumPy's bit generators "
            f"(PCG64, MT19937, ...), got {name!r}."
        )
    bit_generator = kind(0)
    bit_generator.state = _decode_rng(bit_generator.state, state, ())
    return np.random.Generator(bit_generator)


def _decode_rng(template: Any, node: Any, path: tuple[str, ...]) -> Any:
    where = path_to_name(path)
    if isinstance(template, dict):
        if not isinstance(node, dict) or set(node) != set(template):
            found = sorted(node) if isinstance(node, dict) else type(node).__name__
            raise ValueError(
                f"numpy_rng_from_state: '{where}' must have the keys {sorted(template)}, "
                f"found {found}."
            )
        return {key: _decode_rng(template[key], node[key], (*path, key)) for key in template}
    if isinstance(template, str):
        return template
    expected = (
        ((_WORDS,), np.dtype(np.uint64))
        if isinstance(template, int)
        else (template.shape, template.dtype)
    )
    array = np.asarray(node) if is_array(node) else None
    if array is None or (array.shape, array.dtype) != expected:
        found = f"{array.shape} {array.dtype}" if array is not None else type(node).__name__
        raise ValueError(
            f"numpy_rng_from_state: '{where}' must be an array {expected[0]} {expected[1]}, "
            f"found {found}."
        )
    if isinstance(template, int):
        return sum(int(word) << (_WORD * i) for i, word in enumerate(array.tolist()))
    return array.copy()
