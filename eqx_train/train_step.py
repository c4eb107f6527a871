"""`jit_step` and `pmap_step`: training steps that partition the state once and donate its
buffers, for the mesh track (`jax.jit`) and the pmap track (`jax.pmap`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import equinox as eqx
import jax
from jaxtyping import PyTree

from ._text import short
from ._tree import differences

__all__ = ["jit_step", "pmap_step"]

# The step keeps `fn`'s signature: its first argument is the array part of the state, which
# Equinox types as the state itself (`eqx.partition` returns two trees of its type).
_State = TypeVar("_State")
_Args = ParamSpec("_Args")
_Out = TypeVar("_Out")


def jit_step(
    fn: Callable[Concatenate[_State, _Args], _Out],
    static: Any,
    *,
    has_aux: bool = False,
    donate: bool = True,
) -> Callable[Concatenate[_State, _Args], _Out]:
    """Compiles `fn(state, *args)` into a step over the array part of `state` only.

    `eqx.filter_jit` re-partitions the whole state in Python on every call; on a small model
    that costs more than the step itself. Partition once with
    `arrays, static = eqx.partition(state, eqx.is_array)`, then loop over `arrays` with the
    function this returns: each call is one plain `jax.jit` dispatch, and the old buffers are
    donated so the update happens in place.

    **Arguments:**

    - `fn`: `fn(state, *args, **kwargs) -> new_state`, or `-> (new_state, aux)` with
      `has_aux=True`. `state` is the full pytree (e.g. a `TrainState`), rebuilt inside the
      trace from `arrays` and `static`.
    - `static`: the non-array part of the state from `eqx.partition(state, eqx.is_array)`.
    - `has_aux`: whether `fn` also returns auxiliary output (loss, metrics).
    - `donate`: donate the incoming `arrays` (default). Do not reuse an `arrays` after passing
      it in when this is on.

    **Returns:**

    `step(arrays, *args, **kwargs) -> new_arrays` (or `(new_arrays, aux)`). Recombine with
    `eqx.combine(new_arrays, static)` when the full state is needed (to checkpoint or evaluate).
    For a type checker `step` has `fn`'s signature: `arrays` is typed as the state, as
    Equinox types the halves of `eqx.partition`.

    **Example:**

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, optax
    import eqx_train

    model = eqx.nn.MLP(2, 1, 32, 2, key=jax.random.key(0))
    state = eqx_train.TrainState.create(model=model, tx=optax.adam(1e-3))
    batches = [(jnp.ones((16, 2)), jnp.zeros((16, 1)))] * 3


    def loss_fn(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)


    def train_step(state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(state.model, x, y)
        return state.apply_gradients(grads=grads), loss


    arrays, static = eqx.partition(state, eqx.is_array)
    step = eqx_train.jit_step(train_step, static, has_aux=True)
    for x, y in batches:
        arrays, loss = step(arrays, x, y)
    state = eqx.combine(arrays, static)
    assert int(state.step) == 3
    ```

    Raises `ValueError` at trace time if `fn` changes the non-array part of the state (a new
    activation function, a different optimiser), because the loop could not carry it.
    """
    traced = _rebuild_and_check(fn, static, has_aux, caller="jit_step")
    return cast(Any, jax.jit(traced, donate_argnums=(0,) if donate else ()))


def pmap_step(
    fn: Callable[Concatenate[_State, _Args], _Out],
    static: Any,
    *,
    axis_name: Hashable = "batch",
    has_aux: bool = False,
    donate: bool = True,
    devices: Sequence[Any] | None = None,
) -> Callable[Concatenate[_State, _Args], _Out]:
    """`jit_step`'s twin for the pmap track: compiles `fn(state, *args)` with `jax.pmap` over
    the array part of a replicated state.

    `jax.pmap` accepts only pytrees of arrays, so `jax.pmap(step)(replicate(state), x)` on a
    whole `TrainState` fails as soon as the model holds a function (an activation, a
    `custom_jvp` such as `jax.nn.relu`). Partition once, replicate the arrays, and loop with
    the function this returns: each call is one plain `jax.pmap` dispatch, with the state
    rebuilt inside the trace and the old buffers donated.

    **Arguments:**

    - `fn`: `fn(state, *args, **kwargs) -> new_state`, or `-> (new_state, aux)` with
      `has_aux=True`, run on each device's replica; reduce gradients across devices inside
      it with `eqx_train.pmean(grads, axis_name)`.
    - `static`: the non-array part of the state from `eqx.partition(state, eqx.is_array)`.
    - `axis_name`: the name of the mapped device axis inside `fn` (default `"batch"`).
    - `has_aux`: whether `fn` also returns auxiliary output (loss, metrics).
    - `donate`: donate the incoming `arrays` (default). Do not reuse an `arrays` after
      passing it in when this is on.
    - `devices`: the devices to map over, as for `jax.pmap` (default: all local devices).

    **Returns:**

    `step(arrays, *args, **kwargs) -> new_arrays` (or `(new_arrays, aux)`): `arrays` is the
    array part of the state with a leading device axis (`eqx_train.replicate(arrays)`), and
    every positional argument is split along its leading axis as `jax.pmap` does (shape
    `(devices, per_device_batch, ...)`, e.g. from `eqx_train.shard`). The outputs keep the
    device axis; `eqx.combine(eqx_train.unreplicate(new_arrays), static)` is the state.

    **Example:**

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, numpy as np, optax
    import eqx_train

    model = eqx.nn.MLP(2, 1, 32, 2, key=jax.random.key(0))
    state = eqx_train.TrainState.create(model=model, tx=optax.adam(1e-3))


    def train_step(state, x, y):
        loss_fn = lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(state.model)
        grads = eqx_train.pmean(grads, "batch")
        return state.apply_gradients(grads=grads), loss


    arrays, static = eqx.partition(state, eqx.is_array)
    step = eqx_train.pmap_step(train_step, static, has_aux=True)
    arrays = eqx_train.replicate(arrays)
    n = jax.local_device_count()
    x, y = eqx_train.shard((np.ones((4 * n, 2), np.float32), np.zeros((4 * n, 1), np.float32)))
    for _ in range(3):
        arrays, loss = step(arrays, x, y)
    state = eqx.combine(eqx_train.unreplicate(arrays), static)
    assert int(state.step) == 3 and loss.shape == (n,)
    ```

    To map over a whole state instead (slower: it re-partitions on every call), use
    `eqx.filter_pmap(fn, axis_name="batch")(eqx_train.replicate(state), x, y)`.

    Raises `ValueError` at trace time if `fn` changes the non-array part of the state.
    """
    traced = _rebuild_and_check(fn, static, has_aux, caller="pmap_step")
    pmapped = jax.pmap(
        traced, axis_name=axis_name, donate_argnums=(0,) if donate else (), devices=devices
    )
    return cast(Any, pmapped)


def _rebuild_and_check(
    fn: Callable[..., Any], static: PyTree, has_aux: bool, *, caller: str
) -> Callable[..., Any]:
    """`fn` over the array part of the state: rebuilds the state from `arrays` and `static`
    inside the trace, and refuses a step that changes the static part."""
    static_structure = jax.tree.structure(static)

    def traced(arrays: PyTree, *args: Any, **kwargs: Any) -> Any:
        try:
            state = eqx.combine(arrays, static)
        except ValueError:
            raise ValueError(
                f"{caller}: `arrays` is not the array part of a state like the one `static` "
                f"came from: {_static_difference(arrays, static)}. `tx` is part of a "
                "TrainState's structure (a static field), and two calls of optax.adam(...) "
                "make two different optimisers: build the optimiser once, and restore into a "
                "state created with that same `tx` (or partition the restored state and "
                f"build a new {caller} from its static part)."
            ) from None
        out = fn(state, *args, **kwargs)
        new_state, aux = out if has_aux else (out, None)
        new_arrays, new_static = eqx.partition(new_state, eqx.is_array)
        if jax.tree.structure(new_static) != static_structure or not _same_leaves(
            new_static, static
        ):
            raise ValueError(
                f"{caller}: the step function changed the non-array part of the state "
                "(static fields, functions, structure); only array leaves can change between "
                f"steps. Re-partition and build a new {caller} if the change is intended."
            )
        return (new_arrays, aux) if has_aux else new_arrays

    return traced


def _static_difference(a: PyTree, b: PyTree) -> str:
    """Where the array part `a` and the static part `b` of what should be one state first
    disagree: "the static field 'tx' differs (...)", or their structures shown."""
    walk = differences(
        a,
        b,
        children=_children,
        node_difference=_node_difference,
        leaf_difference=_leaf_difference,
    )
    first = next(walk, None)
    if first is not None:
        return first[1]
    return (
        f"their structures differ: {short(jax.tree.structure(a), 300)} vs "
        f"{short(jax.tree.structure(b), 300)}"
    )


class _Static:
    """A static field's value, as a leaf of the walk: compared, never walked into."""

    def __init__(self, value: Any):
        self.value = value


def _children(x: Any) -> list[tuple[Any, Any]] | None:
    if x is None or eqx.is_array(x):
        return None
    if isinstance(x, eqx.Module):
        fields = dataclasses.fields(x)
        return [
            (f.name, _Static(value) if f.metadata.get("static", False) else value)
            for f in fields
            for value in [getattr(x, f.name, None)]
        ]
    if isinstance(x, dict):
        return list(x.items())
    if isinstance(x, list | tuple):
        return list(enumerate(x))
    return None


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(key) for key in path)


def _type_difference(a: Any, b: Any, path: tuple[Any, ...]) -> str | None:
    if type(a) is type(b):
        return None
    where = f"'{_dotted(path)}'" if path else "the root"
    return f"{where} is a {type(a).__name__} in one and a {type(b).__name__} in the other"


def _leaf_difference(a: Any, b: Any, path: tuple[Any, ...]) -> str | None:
    if a is None or b is None or eqx.is_array(a) or eqx.is_array(b):
        return None  # the array half and the static half of one leaf
    found = _type_difference(a, b, path)
    if found or not isinstance(a, _Static):
        return found
    x, y = a.value, b.value
    if x is y or _equal(x, y):
        return None
    what = (
        f"another {type(x).__name__} object" if type(x) is type(y) else f"{short(x)} vs {short(y)}"
    )
    return f"the static field '{_dotted(path)}' differs ({what})"


def _node_difference(
    a: Any, b: Any, pairs_a: list, pairs_b: list, path: tuple[Any, ...]
) -> str | None:
    found = _type_difference(a, b, path)
    if found or isinstance(a, eqx.Module):
        return found
    keys_a, keys_b = [k for k, _ in pairs_a], [k for k, _ in pairs_b]
    if keys_a != keys_b:
        return f"'{_dotted(path)}' has keys {short(keys_a)} in one and {short(keys_b)} in the other"
    return None


def _equal(x: Any, y: Any) -> bool:
    try:
        return bool(x == y)
    except Exception:  # an array-valued or failing __eq__: not the same object, so different
        return False


def _same_leaves(a: PyTree, b: PyTree) -> bool:
    return all(
        x is y or x == y for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )
