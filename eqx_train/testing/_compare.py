"""`assert_trees_equal`: two pytrees compared node by node, naming the first difference.

The comparison walks both trees together, one level at a time, so that a difference in
structure is reported at the node where it occurs (a missing dict key, a list of another
length, an Equinox module with another static field) rather than as two unequal treedefs.
Leaves are compared by kind first, then by what that kind holds (see `_leaf_difference`).
"""

from __future__ import annotations

import cmath
import dataclasses
import re
import struct
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._close import close
from .._text import short
from .._tree import KeyPath, differences, is_state, state_entries

__all__ = ["assert_trees_equal"]

_SHOWN_CHARS = 300  # how much of each side a failure message shows


def leaf_kind(x: Any) -> str:
    """The kind of a leaf, as the messages name it."""
    if x is None:
        return "None"
    if isinstance(x, jax.Array):
        return "typed PRNG key" if _is_key(x) else "jax.Array"
    if isinstance(x, np.ndarray):
        return "NumPy array"
    if isinstance(x, np.generic):
        return "NumPy scalar"
    if isinstance(x, bool | int | float | complex):
        return "Python scalar"
    return "other"


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _children(node: Any) -> list[tuple[Any, Any]] | None:
    """One level of flattening as `[(key, child)]` (a `None` child is kept as a child), or
    None when `node` is a leaf. Empty containers are nodes without children."""
    if node is None:
        return None
    if is_state(node):  # keyed by StateIndex marker, as checkpoints name them, not position
        return state_entries(node)
    pairs, treedef = jtu.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return None
    return [(path[0], child) for path, child in pairs]


def is_node(x: Any) -> bool:
    """Whether `x` is a pytree node (a container, a module), not a leaf or None."""
    return _children(x) is not None


def _count_leaves(tree: Any) -> int:
    return len(jtu.tree_leaves(tree, is_leaf=lambda x: x is None))


def show(x: Any) -> str:
    """A leaf or subtree as a failure message shows it: kind, dtype, shape, then values."""
    if isinstance(x, jax.Array | np.ndarray | np.generic):
        if isinstance(x, jax.Array) and _is_key(x):
            head = f"{leaf_kind(x)} {x.dtype}{list(x.shape)}"
            values = np.asarray(jax.random.key_data(x))
        else:
            head = f"{leaf_kind(x)} {x.dtype}{list(np.shape(x))}"
            values = np.asarray(x)
        if isinstance(x, jax.Array):
            weak = "" if _is_key(x) else f" weak_type={x.weak_type}"
            head += f"{weak} sharding={x.sharding} committed={x.committed}"
        text = f"{head} {np.array2string(values, threshold=20, edgeitems=2)}"
    elif is_node(x):
        text = f"{type(x).__qualname__} {x!r}"
    else:
        text = f"{leaf_kind(x)} {type(x).__name__} {x!r}"
    text = " ".join(text.split())
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def _bytes_per_element(values: np.ndarray) -> np.ndarray:
    flat = np.ascontiguousarray(values).reshape(-1)
    return flat.view(np.uint8).reshape(flat.size, values.dtype.itemsize)


def _first_index(mask: np.ndarray, shape: tuple[int, ...]) -> str:
    index = np.unravel_index(int(np.argmax(mask.reshape(-1))), shape) if shape else ()
    return str(tuple(int(i) for i in index))


def _value_difference(
    a: np.ndarray, b: np.ndarray, rtol: float | int, atol: float | int
) -> str | None:
    """Where two arrays of one dtype and shape differ: bit for bit when `rtol == atol == 0`
    (NaN equals the same NaN, -0.0 differs from 0.0), else within `atol + rtol * |b|` (NaNs
    equal NaNs, infinities only themselves; booleans always exactly)."""
    if a.size == 0:
        return None
    exact = (rtol == 0 and atol == 0) or a.dtype == np.bool_
    if a.dtype == np.object_:  # references, not bytes: each element compared with ==
        pairs = zip(a.reshape(-1), b.reshape(-1), strict=True)
        differs = np.array([_other_difference(x, y) is not None for x, y in pairs])
        exact = True
    elif exact:
        differs = np.any(_bytes_per_element(a) != _bytes_per_element(b), axis=1)
    elif a.dtype.kind in "iu" and a.dtype.itemsize == 8:
        # int64/uint64 exactly, as Python ints: float64 rounds them above 2**53.
        x, y = a.reshape(-1).tolist(), b.reshape(-1).tolist()
        differs = np.array(
            [abs(p - q) > atol + rtol * abs(q) for p, q in zip(x, y, strict=True)], dtype=bool
        )
    else:
        x, y = (
            a.astype(np.complex128 if a.dtype.kind == "c" else np.float64),
            b.astype(np.complex128 if b.dtype.kind == "c" else np.float64),
        )
        differs = ~close(x, y, rtol, atol).reshape(-1)
    count = int(np.count_nonzero(differs))
    if count == 0:
        return None
    how = "bits" if exact else f"values (rtol={rtol}, atol={atol})"
    how = "values (by ==)" if a.dtype == np.object_ else how
    where = _first_index(differs, a.shape)
    i = int(np.argmax(differs))
    first_a, first_b = a.reshape(-1)[i], b.reshape(-1)[i]
    shown = f"{first_a!r} vs {first_b!r}"
    if (
        exact and a.dtype != np.object_ and str(first_a) == str(first_b)
    ):  # NaNs with other payloads, -0.0 and 0.0
        bits_a, bits_b = (_bytes_per_element(x)[i][::-1].tobytes().hex() for x in (a, b))
        shown += f" (bits 0x{bits_a} vs 0x{bits_b})"
    return f"{how} differ in {count} of {a.size} elements, first at index {where}: {shown}"


def _float_bits(x: float | complex) -> bytes:
    if isinstance(x, complex):
        return struct.pack("<dd", x.real, x.imag)
    return struct.pack("<d", x)


def _scalar_difference(a: Any, b: Any, rtol: float | int, atol: float | int) -> str | None:
    if type(a) is not type(b):
        return f"type differs: {type(a).__name__} vs {type(b).__name__}"
    if rtol == 0 and atol == 0:
        same = _float_bits(a) == _float_bits(b) if isinstance(a, float | complex) else a == b
    elif isinstance(a, bool):
        same = a == b
    elif isinstance(a, int):
        same = abs(a - b) <= atol + rtol * abs(b)
    elif isinstance(a, complex) and (cmath.isnan(a) or cmath.isnan(b)):  # part by part
        same = all(
            _scalar_difference(p, q, rtol, atol) is None
            for p, q in ((a.real, b.real), (a.imag, b.imag))
        )
    else:
        nans = cmath.isnan(a) and cmath.isnan(b)
        finite = cmath.isfinite(a) and cmath.isfinite(b)  # an infinity is close only to itself
        same = nans or a == b or (finite and abs(a - b) <= atol + rtol * abs(b))
    return None if same else "value differs"


def _array_difference(
    a: Any, b: Any, rtol: float | int, atol: float | int, weak_type: bool
) -> str | None:
    """Arrays (JAX, NumPy, NumPy scalars, typed keys) of the same kind."""
    if _is_key(a):
        impl_a, impl_b = jax.random.key_impl(a), jax.random.key_impl(b)
        if str(impl_a) != str(impl_b):
            return f"key implementation differs: {impl_a} vs {impl_b}"
    elif a.dtype != b.dtype:
        return f"dtype differs: {a.dtype} vs {b.dtype}"
    if np.shape(a) != np.shape(b):
        return f"shape differs: {np.shape(a)} vs {np.shape(b)}"
    if isinstance(a, jax.Array):
        if not a.sharding.is_equivalent_to(b.sharding, a.ndim):
            return f"sharding differs: {a.sharding} vs {b.sharding}"
        if a.committed != b.committed:
            # An uncommitted array follows the others into a jitted computation; a committed
            # one on another device refuses to meet them ("incompatible devices").
            return f"committedness differs: committed={a.committed} vs committed={b.committed}"
        if weak_type and not _is_key(a) and a.weak_type != b.weak_type:
            return f"weak type differs: weak_type={a.weak_type} vs weak_type={b.weak_type}"
    if _is_key(a):
        a, b, rtol, atol = jax.random.key_data(a), jax.random.key_data(b), 0, 0  # keys: exact
    return _value_difference(np.asarray(a), np.asarray(b), rtol, atol)


def _other_difference(a: Any, b: Any) -> str | None:
    """Any other leaf (a function, a string, an object): compared with `==`."""
    try:
        same = a == b
        if not isinstance(same, bool):
            same = bool(same)
    except Exception as error:  # a leaf whose == raises or gives no truth value
        return f"`==` gives no answer ({type(error).__name__}: {error})"
    return None if same else "`==` is False"


def _leaf_difference(
    a: Any, b: Any, rtol: float | int, atol: float | int, weak_type: bool
) -> str | None:
    kind_a, kind_b = leaf_kind(a), leaf_kind(b)
    if kind_a != kind_b:
        return f"leaf kind differs: {kind_a} vs {kind_b}"
    if kind_a == "None":
        return None
    if kind_a == "Python scalar":
        return _scalar_difference(a, b, rtol, atol)
    if kind_a == "other":
        return _other_difference(a, b)
    return _array_difference(a, b, rtol, atol, weak_type)


def _node_difference(a: Any, b: Any, pairs_a: list, pairs_b: list) -> str | None:
    """How two nodes differ in themselves (not in their children), or None."""
    if type(a) is not type(b):
        return f"node type differs: {type(a).__qualname__} vs {type(b).__qualname__}"
    keys_a, keys_b = [k for k, _ in pairs_a], [k for k, _ in pairs_b]
    if keys_a != keys_b:
        missing = [jtu.keystr((k,)) for k in keys_b if k not in keys_a]
        extra = [jtu.keystr((k,)) for k in keys_a if k not in keys_b]
        if missing or extra:
            return f"children differ: only in the first {extra}, only in the second {missing}"
        return f"children are in another order: {[jtu.keystr((k,)) for k in keys_a]} vs " + str(
            [jtu.keystr((k,)) for k in keys_b]
        )
    level_a = jtu.tree_structure(a, is_leaf=lambda x: x is not a)
    level_b = jtu.tree_structure(b, is_leaf=lambda x: x is not b)
    try:
        same = level_a == level_b
    except Exception:  # metadata whose == cannot answer (an array in a static field)
        same = False
    if not same:
        field = _static_field_difference(a, b)
        if field is not None:
            return f"node metadata (static fields) differs: {field}"
        return f"node metadata (static fields) differs: {level_a} vs {level_b}"
    return None


def _static_field_difference(a: Any, b: Any) -> str | None:
    """Which static field of two Equinox modules of one type differs, and how; None when
    the nodes are not dataclasses or no single field can be named."""
    if not dataclasses.is_dataclass(a):
        return None
    for field in dataclasses.fields(a):
        if not field.metadata.get("static", False):
            continue
        x, y = getattr(a, field.name, None), getattr(b, field.name, None)
        try:
            same = x is y or bool(x == y)
        except Exception:  # an array-valued or failing __eq__
            same = False
        if not same:
            how = (
                f"another {type(x).__name__} object (equal only if the same object)"
                if type(x) is type(y) and _ADDRESS.sub("", repr(x)) == _ADDRESS.sub("", repr(y))
                else f"{short(x, squeeze=True)} vs {short(y, squeeze=True)}"
            )
            return f"static field '{field.name}': {how}"
    return None


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # in a repr: differs between equal-looking objects


def tree_differences(
    a: Any, b: Any, *, rtol: float | int = 0, atol: float | int = 0, weak_type: bool = True
) -> tuple[list[tuple[str, str, Any, Any]], int]:
    """Every difference between `a` and `b` as `(path, what differs, a's side, b's side)` in
    flattening order, and how many leaves differ in all (a subtree whose structure differs
    counts as many leaves as its larger side holds)."""

    def leaf_difference(x: Any, y: Any, path: KeyPath) -> str | None:
        if is_node(x) or is_node(y):
            return f"a {'node' if is_node(x) else 'leaf'} vs a {'node' if is_node(y) else 'leaf'}"
        return _leaf_difference(x, y, rtol, atol, weak_type)

    def node_difference(x: Any, y: Any, pairs_x: list, pairs_y: list, path: KeyPath) -> str | None:
        return _node_difference(x, y, pairs_x, pairs_y)

    found: list[tuple[str, str, Any, Any]] = []
    count = 0
    walk = differences(
        a, b, children=_children, node_difference=node_difference, leaf_difference=leaf_difference
    )
    for path, what, x, y in walk:
        found.append((jtu.keystr(path) or "<root>", what, x, y))
        leaves = not is_node(x) and not is_node(y)
        count += 1 if leaves else max(_count_leaves(x), _count_leaves(y), 1)
    return found, count


def difference_message(
    a: Any,
    b: Any,
    *,
    rtol: float | int = 0,
    atol: float | int = 0,
    weak_type: bool = True,
    names: tuple[str, str] = ("first", "second"),
) -> str | None:
    """The failure message `assert_trees_equal` raises with, or None when the trees are
    equal. `names` label the two sides."""
    found, count = tree_differences(a, b, rtol=rtol, atol=atol, weak_type=weak_type)
    if not found:
        return None
    path, what, x, y = found[0]
    total = max(_count_leaves(a), _count_leaves(b))
    width = max(len(n) for n in names)
    return (
        f"the trees differ at {path}: {what} ({count} of {total} leaves differ; this is the "
        f"first)\n  {names[0]:>{width}}: {show(x)}\n  {names[1]:>{width}}: {show(y)}"
    )


def assert_trees_equal(a: Any, b: Any, *, rtol: float | int = 0, atol: float | int = 0) -> None:
    """Asserts that two pytrees are equal, saying where and how they differ if not.

    Compared, node by node: the structure (node types, dict keys and their order, static
    fields of Equinox modules); each leaf's kind (a `jax.Array`, a NumPy array, a NumPy
    scalar, a Python scalar, a typed PRNG key, `None`); for array leaves their dtype,
    shape, sharding, committedness and weak type (where both are `jax.Array`s; shardings
    are equal when they place every element on the same devices,
    `Sharding.is_equivalent_to`; `x.committed` says whether an array was placed on its
    devices explicitly, as opposed to `jnp.zeros(())`, which jitted code may move) and
    values;
    for Python scalars their type and value; typed keys by implementation and key data;
    any other leaf (a function, a string) with `==`.

    Values are compared bit for bit by default (`rtol=atol=0`): a NaN equals a NaN with the
    same bits, and `-0.0` differs from `0.0`, as a checkpoint round trip must keep them.
    With a tolerance, inexact and integer values are close when
    `|a - b| <= atol + rtol * |b|`, NaN equals NaN, infinities equal only themselves (a
    complex with a NaN part is compared part by part, each part so); booleans, key data
    and the other checks stay exact.

    **Arguments:**

    - `a`, `b`: the pytrees to compare (in the message, "first" and "second").
    - `rtol`, `atol`: relative and absolute tolerance for values (default 0: exact).

    **Returns:**

    None.

    **Raises:**

    `AssertionError` naming the first differing pytree path (`jax.tree_util.keystr`
    notation; an `eqx.nn.State`'s entries keyed by their `StateIndex` markers, as
    checkpoints name them: `['bn_state']['Net.norm.batch_state_index'][0]`), what differs
    there, both sides, and how many leaves differ in all.

    ```python
    import jax.numpy as jnp
    import numpy as np
    from eqx_train.testing import assert_trees_equal

    assert_trees_equal({"w": jnp.ones(2), "n": 3}, {"w": jnp.ones(2), "n": 3})
    try:
        assert_trees_equal({"w": jnp.ones(2)}, {"w": jnp.ones(2, jnp.bfloat16)})
    except AssertionError as error:
        assert "['w']: dtype differs: float32 vs bfloat16" in str(error)
    assert_trees_equal(np.float32(1.0), np.float32(1.0 + 1e-7), rtol=1e-6)
    ```
    """
    message = difference_message(a, b, rtol=rtol, atol=atol)
    if message is not None:
        raise AssertionError(f"assert_trees_equal: {message}")
