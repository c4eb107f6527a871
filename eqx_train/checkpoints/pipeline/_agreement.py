"""What the processes of a multi-process save compare in its opening exchange: a layout of
what each is about to save, that every process computes identically for the same save, and
the first difference between two layouts in words (`_multiprocess.agree_on_token`)."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jax
else:  # imported on first use: the command line reads headers without JAX
    from ..._lazy import LazyModule

    jax = LazyModule("jax")

from ... import _tree
from .. import _errors
from ..format import _description


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def layout_of(description: Any, tensors: list[_description.Tensor]) -> dict[str, Any]:
    """What a process is about to save, in a form every process computes identically for
    the same save: the tree's description and, per leaf, its dtype, global shape and where
    it lives (host-local, or a global array with the blocks of its sharding)."""
    blocks: dict[tuple[Any, tuple[int, ...]], str] = {}  # many leaves share a sharding
    leaves = []
    for tensor in tensors:
        source = tensor.source
        if isinstance(source, jax.Array) and not source.is_fully_addressable:
            sharding = source.sharding
            key = (sharding, tensor.shape)
            if key not in blocks:
                cells = sorted(
                    (
                        device.id,
                        [list(s.indices(d)[:2]) for s, d in zip(index, tensor.shape, strict=True)],
                    )
                    for device, index in sharding.devices_indices_map(tensor.shape).items()
                )
                blocks[key] = hashlib.sha256(canonical(cells).encode()).hexdigest()[:16]
            where = {"sharding": _sharding_text(sharding), "blocks": blocks[key]}
        else:
            where = "host-local"
        leaves.append([tensor.name, str(tensor.dtype), list(tensor.shape), where])
    return {"tree": description, "leaves": leaves}


def _sharding_text(sharding: Any) -> str:
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is not None and spec is not None:
        return f"{type(sharding).__name__}(mesh {dict(mesh.shape)}, {spec})"
    return _errors.short(repr(sharding), 160)


def _describe_leaf(leaf: list[Any], with_blocks: bool = False) -> str:
    _, dtype, shape, where = leaf
    if where == "host-local":
        return f"{dtype}{shape} host-local (written by process 0)"
    blocks = f" (devices and blocks digest {where['blocks']})" if with_blocks else ""
    return f"{dtype}{shape} sharded as {where['sharding']}{blocks}"


def first_difference(layouts: list[dict[str, Any]]) -> str:
    """The first way in which a process's layout differs from process 0's, in words."""
    reference = layouts[0]
    for i, other in enumerate(layouts[1:], start=1):
        mine = {leaf[0]: leaf for leaf in reference["leaves"]}
        theirs = {leaf[0]: leaf for leaf in other["leaves"]}
        for leaf in reference["leaves"]:
            name = leaf[0]
            if name not in theirs:
                return f"leaf '{name}' is saved by process 0 but not by process {i}"
            if theirs[name] != leaf:
                a, b = leaf, theirs[name]
                blocks = _describe_leaf(a) == _describe_leaf(b)  # differ only in devices
                return (
                    f"leaf '{name}' is {_describe_leaf(a, blocks)} on process 0 but "
                    f"{_describe_leaf(b, blocks)} on process {i}"
                )
        for leaf in other["leaves"]:
            if leaf[0] not in mine:
                return f"leaf '{leaf[0]}' is saved by process {i} but not by process 0"
        if other["tree"] != reference["tree"]:
            where = _tree_difference(reference["tree"], other["tree"])
            return (
                "the tree's structure or its non-array leaves differ between process 0 and "
                f"process {i} {where} (process 0's first)"
            )
    return "their descriptions differ"


def _node_text(node: Any) -> str:
    if not isinstance(node, dict):
        return repr(node)
    if "str" in node:
        return f"the string {_errors.short(node['str'], 60)}"
    if "tensor" in node:
        return "an array"
    if "skipped" in node:
        return f"a {node['skipped']} (not saved)"
    if "node" in node:
        return f"a {node['node']}"
    kind = next(iter(node))
    return f"a {kind} of {len(node[kind])}"


def _description_children(node: Any) -> list[tuple[Any, Any]] | None:
    """One level of a tree description (`_description.describe`): a dict's, a node's, a
    list's or a tuple's children; None for anything else."""
    if not isinstance(node, dict):
        return None
    if "dict" in node:
        return list(node["dict"])
    if "node" in node:
        return list(node["children"])
    if set(node) <= {"list", "tuple"} and node:
        return list(enumerate(node[next(iter(node))]))
    return None


def _tree_difference(a: Any, b: Any) -> str:
    """Where two tree descriptions (`_description.describe`) first differ, in words ('' if they
    are equal)."""

    def node_difference(x: Any, y: Any, xs: list, ys: list, _: Any) -> str | None:
        same_kind = x.get("node", next(iter(x))) == y.get("node", next(iter(y)))
        if not same_kind or [k for k, _ in xs] != [k for k, _ in ys]:
            return "node"
        # Children alike, the nodes not: they differ in a field of their own.
        return "fields" if xs == ys and x != y else None

    def leaf_difference(x: Any, y: Any, _: Any) -> str | None:
        return None if x == y else "leaf"

    if a == b:
        return ""
    found = next(
        _tree.differences(
            a,
            b,
            children=_description_children,
            node_difference=node_difference,
            leaf_difference=leaf_difference,
        ),
        None,
    )
    if found is None:
        return ""
    keys, what, x, y = found
    where = ".".join(str(k) for k in keys)
    here = f"'{where}'" if where else "the root"
    return f"at {here}" if what == "fields" else f"at {here}: {_node_text(x)} vs {_node_text(y)}"
