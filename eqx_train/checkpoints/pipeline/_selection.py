"""Which leaves of a restore target come from the file: `filter_spec` (Equinox's convention,
as in `eqx.tree_serialise_leaves`), the rule that the Python scalars of Equinox modules are
configuration (the target's value wins), and the hint for a file saved replicated."""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import equinox as eqx
    import jax
    import jax.tree_util as jtu
else:  # imported on first use: the command line reads headers without JAX
    from ..._lazy import LazyModule

    eqx = LazyModule("equinox")
    jax = LazyModule("jax")
    jtu = LazyModule("jax.tree_util")

from ..._calls import call, outside_stacklevel
from .._errors import ConfigMismatchWarning as ConfigMismatchWarning

Config = Literal["target", "saved"]
CONFIG_CHOICES = ("target", "saved")


def check_config(config: Any) -> None:
    """Refuses a `config` that is not one of `CONFIG_CHOICES`."""
    if config not in CONFIG_CHOICES:
        raise ValueError(f"{call()}: config must be one of {CONFIG_CHOICES}, got {config!r}.")


def selected(target: Any, filter_spec: Any) -> list[bool]:
    """For each leaf of `target` (in `tree_flatten` order): whether `filter_spec` selects it.

    `filter_spec` is as for `eqx.filter`: a bool or a function `leaf -> bool`, or a pytree
    prefix of `target` of those. `None` selects every leaf."""
    leaves = jtu.tree_leaves(target)
    if filter_spec is None:
        return [True] * len(leaves)
    dropped = object()

    def judge(tree: Any) -> list[bool]:
        filtered = jtu.tree_leaves(eqx.filter(tree, filter_spec, replace=dropped))
        return [leaf is not dropped for leaf in filtered]

    if not any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves):
        return judge(target)
    # An abstract target (`eqx.filter_eval_shape`) stands for arrays: judge the filter on
    # arrays of those shapes and dtypes (tracers, so nothing is allocated), or
    # `eqx.is_array` would select none of its placeholders and restore nothing.
    abstract, rest = eqx.partition(target, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    found: list[list[bool]] = []
    jax.eval_shape(lambda arrays: found.append(judge(eqx.combine(arrays, rest))), abstract)
    return found[0]


def left_out_prefixes(names: Sequence[str], chosen: Sequence[bool]) -> set[str]:
    """The names of the largest sub-trees `filter_spec` leaves out whole, from each leaf's
    dotted name and whether it `chosen`: for every leaf left out, its shortest name prefix
    (whole segments) under which no leaf is chosen; `""` (everything) when none is."""
    if not any(chosen):
        return {""}
    heads = [name.split(".") for name in names]
    holds_chosen = {
        ".".join(parts[:i])
        for parts, pick in zip(heads, chosen, strict=True)
        if pick
        for i in range(1, len(parts) + 1)
    }
    left_out = set()
    for parts, pick in zip(heads, chosen, strict=True):
        if not pick:
            prefixes = (".".join(parts[:i]) for i in range(1, len(parts) + 1))
            left_out.add(next((p for p in prefixes if p not in holds_chosen), ".".join(parts)))
    return left_out


def filtered_for_saving(target: Any, filter_spec: Any) -> Any:
    """`target` with the leaves `filter_spec` does not select replaced by `None`: they are
    not saved, and the file records `None` in their place."""
    return target if filter_spec is None else eqx.filter(target, filter_spec)


def _child(node: Any, key: Any) -> Any:
    if isinstance(key, jtu.DictKey):
        return node[key.key]
    if isinstance(key, jtu.SequenceKey):
        return node[key.idx]
    if isinstance(key, jtu.GetAttrKey):
        return getattr(node, key.name)
    raise LookupError(key)


def is_module_field(target: Any, key_path: Sequence[Any]) -> bool:
    """Whether the leaf at `key_path` is a field of an Equinox module (its configuration,
    when it is a Python scalar) rather than an entry of a dict, list or tuple (data)."""
    if not key_path or not isinstance(key_path[-1], jtu.GetAttrKey):
        return False
    node = target
    try:
        for key in key_path[:-1]:
            node = _child(node, key)
    except (LookupError, AttributeError, TypeError):
        return False
    return isinstance(node, eqx.Module)


def _same_value(a: Any, b: Any) -> bool:
    """Python scalars equal as values of their own types (NaN equals NaN; 1 is not True)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def config_differences(found: list[tuple[str, Any, Any, Any]]) -> list[str]:
    """`'path': saved X, target Y` for each `(name, target leaf, leaf kind, file array)` whose
    saved value is not the target's (a value that does not convert exactly counts as
    different, and is shown as saved)."""
    differences = []
    for name, leaf, kind, array in found:
        try:
            saved = kind.fill(leaf, array)
        except ValueError:
            saved = array[()].item()
        if not _same_value(saved, leaf):
            differences.append(f"'{name}': saved {saved!r}, target {leaf!r}")
    return differences


def warn_config(path: str, differences: list[str]) -> None:
    listed = "\n  ".join(differences)
    warnings.warn(
        ConfigMismatchWarning(
            f"{call()}: {path} saved another configuration; the target's values are kept:\n"
            f"  {listed}\n"
            "Pass config='saved' to take the saved values instead."
        ),
        stacklevel=outside_stacklevel(sys._getframe()),
    )


def replicated_hint(pairs: list[tuple[tuple[int, ...], Any, tuple[int, ...], Any]]) -> str:
    """A hint when every array the target and the file share has, in the file, one extra
    leading axis of the same length over the target's shape (a state saved replicated).

    `pairs`: `(file shape, file dtype, target shape, target dtype)` for every array leaf of
    the target found in the file. Returns the hint, or `""`."""
    leading = {f[0] for f, fd, t, td in pairs if fd == td and len(f) == len(t) + 1 and f[1:] == t}
    if (
        not pairs
        or len(leading) != 1
        or any(fd != td or len(f) != len(t) + 1 or f[1:] != t for f, fd, t, td in pairs)
    ):
        return ""
    (n,) = leading
    return (
        f"Every array in the file has an extra leading axis of {n} over the target's shape: "
        "saved replicated? Call eqx_train.unreplicate before saving, or restore into a "
        "replicated target (eqx_train.replicate(target))."
    )
