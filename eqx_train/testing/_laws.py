"""Ready-made laws: a checkpoint round trip, and a training run that resumes exactly."""

from __future__ import annotations

import contextlib
import os
import struct
import tempfile
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .. import checkpoints
from .._tree import flatten_with_names, path_to_name, place_like
from ._compare import difference_message, show

__all__ = ["assert_checkpoint_roundtrip", "assert_resumes_exactly"]

_T = TypeVar("_T")
_Batch = TypeVar("_Batch")


@contextlib.contextmanager
def _directory(directory: str | os.PathLike[str] | None) -> Iterator[str]:
    if directory is not None:
        yield os.fspath(directory)
        return
    with tempfile.TemporaryDirectory(prefix="eqx_train-testing-") as temporary:
        yield temporary


def _save(directory: str, tree: Any, options: dict[str, Any]) -> str:
    """Saves `tree` as a step newer than any in `directory` (nothing there is replaced, nor
    pruned unless `options` set `keep`); returns the file's path once it is written (an
    async save is waited for)."""
    prefix = options.get("prefix", "checkpoint_")
    storage = options.get("storage_options")
    steps = checkpoints.available_steps(directory, prefix=prefix, storage_options=storage)
    step = int(max(steps)) + 1 if steps else 0
    options = {"keep": 1 << 62, **options}
    path = checkpoints.save_checkpoint(directory, tree, step, **options)
    manager = options.get("async_manager")
    if manager is not None:
        manager.wait_previous_save()
    return path


def _restore_options(options: dict[str, Any]) -> dict[str, Any]:
    return {k: options[k] for k in ("storage_options", "filter_spec") if k in options}


def _saved_form(leaf: Any) -> tuple[Any, ...] | None:
    """What of a leaf a checkpoint keeps, as a comparable tuple: arrays by dtype, shape and
    bytes, typed keys by implementation, shape and key data, Python scalars by type and
    bits, strings by value; None for leaves that are not saved (functions...). Arrays by
    weak type too."""
    if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        data = np.asarray(jax.random.key_data(leaf))
        return ("key", str(jax.random.key_impl(leaf)), leaf.shape, data.tobytes())
    if isinstance(leaf, jax.Array | np.ndarray | np.generic):
        values = np.asarray(leaf)
        # The file records a weak type, so that target=None gives a weakly typed jax.Array
        # back (a strongly typed array comes back as NumPy, whose weak type is False).
        weak = bool(getattr(leaf, "weak_type", False))
        return ("array", str(values.dtype), values.shape, values.tobytes(), weak)
    if isinstance(leaf, float):
        return ("float", struct.pack("<d", leaf))
    if isinstance(leaf, bool | int):
        return (type(leaf).__name__, leaf)
    if isinstance(leaf, str):
        return ("str", leaf)
    return None


def _what_differs(saved: tuple[Any, ...], restored: tuple[Any, ...]) -> str:
    """How two unequal `_saved_form`s differ, as the message says it."""
    if saved[0] == restored[0] == "array" and saved[:-1] == restored[:-1]:
        return "weak type differs"  # an array's form ends with its weak type
    return "dtype, shape or bits differ"


def _saved_leaves(tree: Any) -> dict[str, tuple[Any, Any]]:
    """Dotted tensor name -> (leaf, saved form) for every leaf a checkpoint keeps, named as
    the checkpoint names it (an `eqx.nn.State`'s entries by their markers)."""
    pairs = flatten_with_names(tree)
    return {
        path_to_name(path): (leaf, form)
        for path, leaf in pairs
        if (form := _saved_form(leaf)) is not None
    }


def _check_as_saved(tree: Any, as_saved: Any, filter_spec: Any, path: str) -> None:
    """Every leaf saved from `tree` is in `as_saved` (a `target=None` restore) under the
    same name, with the same dtype, shape, weak type and bits; and nothing else is."""
    if filter_spec is not None:
        tree = eqx.filter(tree, filter_spec)
    expected, got = _saved_leaves(tree), _saved_leaves(as_saved)
    problems = [
        (name, "saved but not restored", show(expected[name][0]), "missing")
        for name in expected
        if name not in got
    ]
    problems += [
        (name, "restored but never saved", "missing", show(got[name][0]))
        for name in got
        if name not in expected
    ]
    problems += [
        (
            name,
            _what_differs(expected[name][1], got[name][1]),
            show(expected[name][0]),
            show(got[name][0]),
        )
        for name in expected
        if name in got and expected[name][1] != got[name][1]
    ]
    if problems:
        name, what, saved, restored = problems[0]
        raise AssertionError(
            f"assert_checkpoint_roundtrip: restoring {path} with target=None: leaf '{name}' "
            f"{what} ({len(problems)} of {len(expected)} saved leaves differ; this is the "
            f"first)\n     saved: {saved}\n  restored: {restored}"
        )


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _flipped(values: np.ndarray) -> np.ndarray:
    """Every element with every bit flipped (booleans negated): no element keeps its bits,
    whatever the dtype (-0.0, NaN payloads, bfloat16, float8 included)."""
    values = np.array(values, order="C")  # a copy; `~` makes a 0-d array a scalar
    if values.dtype == np.bool_:
        return np.asarray(~values)
    # Byte by byte: no unsigned integer is as wide as a complex128.
    flat = np.asarray(~values.reshape(-1).view(np.uint8))
    return flat.view(values.dtype).reshape(values.shape)


def _other_leaf(x: Any) -> Any:
    """An array leaf of the same kind, dtype, shape, placement and weak type as `x`, whose
    every element differs from `x`'s bit for bit; other leaves as they are."""
    if _is_key(x):
        data = _flipped(np.asarray(jax.random.key_data(x)))
        key = jax.random.wrap_key_data(jnp.asarray(data), impl=jax.random.key_impl(x))
        return place_like(key, x)
    if isinstance(x, jax.Array):
        return place_like(_flipped(np.asarray(x)), x)
    if isinstance(x, np.ndarray):
        return _flipped(x)
    if isinstance(x, np.generic):
        return _flipped(np.asarray(x))[()]
    return x  # Python scalars are configuration: restored from the target, not the file


def _other_values(tree: _T, filter_spec: Any) -> tuple[_T, set[int]]:
    """`tree` with every array leaf that a restore fills (those `filter_spec` selects)
    replaced by one whose bits all differ (`_other_leaf`), and the ids of those leaves. A
    zero-size array holds no element that could differ: a restore that left it alone would
    return that very object, which the ids catch."""
    if filter_spec is None:
        chosen, rest = tree, None
    else:
        chosen, rest = eqx.partition(tree, filter_spec)
    other = jtu.tree_map(_other_leaf, chosen)
    if rest is not None:
        other = eqx.combine(other, rest)
    ids = {id(x) for x in jtu.tree_leaves(other) if x is not None and _saved_form(x) is not None}
    ids -= {id(x) for x in jtu.tree_leaves(tree)}  # kept as they are (Python scalars...)
    return other, ids


def _abstract(tree: _T) -> _T:
    """`tree` as an abstract target: each `jax.Array` a `jax.ShapeDtypeStruct` of its dtype,
    shape and weak type, with its sharding when it is committed and without one when it is
    an uncommitted array on the default device (which is where an abstract leaf without a
    sharding is placed); an uncommitted array elsewhere, and NumPy leaves, stay as they are
    (no `ShapeDtypeStruct` says either)."""
    default = next(iter(jax.device_put(np.zeros(())).devices()))

    def abstract(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        if not x.committed and x.sharding.device_set != {default}:
            return x
        sharding = x.sharding if x.committed else None
        weak = False if _is_key(x) else x.weak_type
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=weak)

    return jtu.tree_map(abstract, tree)


def _restored_difference(restored: Any, tree: Any, other_ids: set[int]) -> str | None:
    """How `restored` differs from `tree`, the tree saved, or holds one of the target's own
    leaves `other_ids` (a leaf never read from the file); None if it does neither."""
    message = difference_message(restored, tree, names=("restored", "saved"))
    if message is not None:
        return message
    found = jtu.tree_flatten_with_path(restored)[0]
    kept = [jtu.keystr(p) or "<root>" for p, leaf in found if id(leaf) in other_ids]
    if kept:
        return (
            f"the leaf at {kept[0]} is the target's own array, not one read from the file "
            f"({len(kept)} such leaves; this is the first)"
        )
    return None


def assert_checkpoint_roundtrip(
    tree: _T, directory: str | os.PathLike[str] | None = None, **save_options: Any
) -> _T:
    """Asserts that `tree` survives a checkpoint: saved, then restored, it is the same tree.

    Saves `tree` with `eqx_train.checkpoints.save_checkpoint` (as a step newer than any
    already in `directory`, keeping the others unless `keep` is given), then:

    1. restores it into a target of `tree`'s structure and placement whose every array
       leaf differs from `tree`'s in every bit (so a leaf the restore never fills shows;
       a zero-size array, which has no bits to differ, must not come back as the target's
       own object), and asserts the result equals `tree` as `assert_trees_equal` compares
       them: structure, leaf kinds, dtypes, shapes, shardings, committedness, bits, the
       Python configuration of Equinox modules, and weak types (a restore returns leaves
       jitted code cannot tell from the target's);
    2. restores it into that target made abstract (`jax.ShapeDtypeStruct`s: with the
       sharding of a committed array, without one for an uncommitted array on the default
       device) and asserts the same;
    3. restores it with `target=None` and asserts that every saved leaf comes back under
       the same dotted name with the same dtype, shape, weak type and bits (typed keys: the
       same implementation and key data), and that nothing else does.

    A tree without array leaves (`()`, `None`, `{}`, a module of configuration) passes
    when it comes back equal.

    **Arguments:**

    - `tree`: the pytree to save: a model, a `TrainState`, any tree `save_checkpoint` takes.
    - `directory`: where to save (a local path or an object-store URL); by default a
      temporary directory, removed afterwards.
    - `**save_options`: passed to `save_checkpoint` (`filter_spec`, `storage_options`,
      `async_manager`, `prefix`, ...). `filter_spec` and `storage_options` are passed to the
      restores too; with a `filter_spec`, only the leaves it selects are expected back.

    **Returns:**

    The tree restored into the first target (step 1), equal to `tree`.

    **Raises:**

    `AssertionError` naming the first differing path (or dotted tensor name), what differs,
    both sides and how many leaves differ.

    ```python
    import equinox as eqx
    import jax
    from eqx_train.testing import assert_checkpoint_roundtrip

    model = eqx.nn.MLP(2, 2, 8, 1, key=jax.random.key(0))
    restored = assert_checkpoint_roundtrip(model)
    assert restored is not model
    ```
    """
    law = "assert_checkpoint_roundtrip"
    restore_options = _restore_options(save_options)
    filter_spec = save_options.get("filter_spec")
    target, other_ids = _other_values(tree, filter_spec)
    abstract = _abstract(target)
    with _directory(directory) as where:
        path = _save(where, tree, save_options)
        restored = checkpoints.restore_checkpoint(path, target, **restore_options)
        from_abstract = checkpoints.restore_checkpoint(path, abstract, **restore_options)
        # As saved: the filter_spec (which only a target's leaves take) already chose them.
        as_saved_options = {k: v for k, v in restore_options.items() if k != "filter_spec"}
        as_saved = checkpoints.restore_checkpoint(path, None, **as_saved_options)
    for into, got in (("the tree", restored), ("an abstract tree", from_abstract)):
        message = _restored_difference(got, tree, other_ids)
        if message is not None:
            raise AssertionError(f"{law}: restoring {path} into {into}: {message}")
    _check_as_saved(tree, as_saved, filter_spec, path)
    return restored


def _copy_leaf(x: Any) -> Any:
    if isinstance(x, jax.Array):
        return place_like(x, x, copy=True)  # committed or not, as `x` is
    if isinstance(x, np.ndarray):
        return x.copy()
    return x


def _copy(tree: _T) -> _T:
    """A copy of `tree` whose array buffers are its own: a step that donates its input
    cannot delete the arrays of `state` or of the other run."""
    return jtu.tree_map(_copy_leaf, tree)


def _call(step: Callable[[Any, Any], Any], state: Any, batch: Any) -> tuple[Any, Any, bool]:
    """`step(state, batch)` as `(new_state, aux, has_aux)`."""
    out = step(state, batch)
    if jtu.tree_structure(out) == jtu.tree_structure(state):
        return out, None, False
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(
            "assert_resumes_exactly: `step` returned neither a tree with the structure of "
            f"`state` nor a pair (new_state, aux); got {type(out).__name__}: "
            f"{jtu.tree_structure(out)} vs the state's {jtu.tree_structure(state)}."
        )
    return out[0], out[1], True


def _where(i: int, split_at: int) -> str:
    if i < split_at:
        return (
            f"step {i}, before the save after {split_at} steps: `step` gave different results on "
            "the same state and batch, so it reads something outside its arguments (a counter, "
            "a global random generator, a closure it mutates)"
        )
    return f"step {i}, step {i - split_at + 1} of the run resumed after {split_at} steps"


def assert_resumes_exactly(
    step: Callable[[_T, _Batch], object],
    state: _T,
    batches: Iterable[_Batch],
    *,
    split_at: int,
    directory: str | os.PathLike[str] | None = None,
) -> None:
    """Asserts that a training run saved and restored after `split_at` steps continues
    exactly as the uninterrupted run: the law behind resuming a preempted job.

    Runs `step(state, batch)` over all `batches` twice, side by side: once straight
    through, once with a save after `split_at` steps (`save_checkpoint`), a restore into a
    target like the initial `state` (as a restarted job restores into the state it builds:
    the same structure and placement, but every array leaf differing in every bit, so that
    a leaf the restore leaves unfilled shows even when the steps never change it), and the
    rest. After
    every step, asserts that both runs' states (and outputs, when `step` returns them) are
    bit-identical as `assert_trees_equal` compares them, with weak types compared under
    `assert_checkpoint_roundtrip`'s rule; the restored state is also compared with the one
    saved.

    `step`'s return value is the new state when its tree structure is `state`'s, else a
    pair `(new_state, aux)` whose `aux` (metrics, a loss) is compared too. `step` may
    donate its input (each run starts from its own copy of `state`).

    **Arguments:**

    - `step`: the training step, `step(state, batch)`, jitted or not.
    - `state`: the initial state (a `TrainState`, or any pytree `save_checkpoint` takes);
      not modified.
    - `batches`: the batches, in order (iterated once; both runs see the same batches).
    - `split_at`: after how many steps to save and restore, `0 <= split_at <= len(batches)`.
    - `directory`: where to save (a local path or an object-store URL); by default a
      temporary directory, removed afterwards. A step newer than any there is written.

    **Returns:**

    None.

    **Raises:**

    `AssertionError` naming the first step and pytree path that differ, what differs and
    both sides; a difference before `split_at` says that `step` depends on something
    outside its arguments. `ValueError` for a `split_at` out of range.

    ```python
    import jax.numpy as jnp
    from eqx_train.testing import assert_resumes_exactly

    def step(state, batch):
        new = {"w": state["w"] - 0.1 * batch, "n": state["n"] + 1}
        return new, {"loss": jnp.sum(new["w"] ** 2)}

    state = {"w": jnp.ones(3), "n": jnp.asarray(0)}
    assert_resumes_exactly(step, state, [jnp.full(3, i) for i in range(4)], split_at=2)
    ```
    """
    batches = list(batches)
    if not 0 <= split_at <= len(batches):
        raise ValueError(
            f"assert_resumes_exactly: split_at={split_at} is outside 0..{len(batches)} (the "
            "number of batches)."
        )
    straight, resumed = _copy(state), _copy(state)

    def check(a: Any, b: Any, where: str, what: str) -> None:
        message = difference_message(a, b, names=("uninterrupted", "resumed"))
        if message is not None:
            raise AssertionError(f"assert_resumes_exactly: {where}: {what}: {message}")

    with _directory(directory) as where:
        for i in range(len(batches) + 1):
            if i == split_at:
                path = _save(where, resumed, {})
                target, other_ids = _other_values(state, None)
                restored = checkpoints.restore_checkpoint(path, target)
                message = _restored_difference(restored, resumed, other_ids)
                if message is not None:
                    raise AssertionError(
                        f"assert_resumes_exactly: the state restored from {path} after "
                        f"{split_at} steps is not the state saved: {message}"
                    )
                resumed = restored
            if i == len(batches):
                break
            straight, aux_a, has_aux = _call(step, straight, batches[i])
            resumed, aux_b, _ = _call(step, resumed, batches[i])
            if has_aux:
                check(aux_a, aux_b, _where(i, split_at), "the outputs differ")
            check(straight, resumed, _where(i, split_at), "the states differ")
