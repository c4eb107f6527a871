"""Layout presets between flax (Linen and NNX) and Equinox: for every leaf of an Equinox
model that an `eqx.nn` layer holds, the flax name it is saved under and the conversion of
its layout (Dense and conv kernels transposed, conv biases given their size-1 axes,
attention projections reshaped), as the `rename=` and `transform=` that every reader takes.

The conventions, flax -> Equinox (the migration guide, docs/coming_from_flax.md, has the
table): a Dense kernel (in, out) transposed into a `Linear` weight (out, in); a conv kernel
(*spatial, in, out) into a `Conv` weight (out, in, *spatial), its bias (out,) given size-1
axes; `Embed`'s `embedding` is an `Embedding`'s `weight`; a norm's `scale` its `weight`;
attention kernels (in, heads, head_dim) reshaped into `MultiheadAttention`'s projections;
`BatchNorm`'s `mean` and `var` into its `eqx.nn.State`, with the counter set.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

import equinox as eqx
import jax.tree_util as jtu
import numpy as np

from .._tree import flatten_with_names, path_to_name

Naming = Literal["linen", "nnx"]


class FlaxLayout(TypedDict):
    """The keyword arguments a layout preset gives a reader: pass them with `**`.

    - `rename`: a function `target_name -> saved_name` (every leaf an `eqx.nn` layer holds
      gets its flax name; every other leaf keeps its name, under `roots`).
    - `transform`: target name -> the conversion of its saved tensor's layout. Each one
      carries a `convention` that `plan_restore` shows beside the leaf.
    """

    rename: Callable[[str], str | None]
    transform: dict[str, Callable[[Any], Any]]


class Convention:
    """One layout conversion of one leaf, as a `transform=` entry: `fn` on the saved
    tensor, then a reshape to the leaf's `shape` where the two differ only in size-1 axes.
    `plan_restore` shows its `convention` beside the leaf (any transform with a
    `convention` string attribute is shown so).

    **Arguments:**

    - `convention`: what it converts, e.g. "flax Dense kernel (in, out) <-> Linear weight
      (out, in)".
    - `fn`: `array -> array`, traceable (it is first evaluated by `jax.eval_shape`).
    - `shape`: the shape of the leaf it fills.
    """

    def __init__(self, convention: str, fn: Callable[[Any], Any], shape: tuple[int, ...]):
        self.convention, self.fn, self.shape = convention, fn, tuple(shape)

    def __call__(self, array: Any) -> Any:
        out = self.fn(array)
        same = [d for d in out.shape if d != 1] == [d for d in self.shape if d != 1]
        # Anything else stays as it is: the matcher then refuses it, naming both shapes.
        return out.reshape(self.shape) if out.shape != self.shape and same else out

    def __repr__(self) -> str:
        return f"Convention({self.convention!r})"


# ------------------------------------------------------------------ the conversions


def _transpose_kernel(a: Any) -> Any:
    """A flax kernel (*K, I, O) as an Equinox weight (O, I, *K) (a Dense kernel: (in, out)
    as (out, in))."""
    n = a.ndim - 2
    return a.transpose(n + 1, n, *range(n)) if a.ndim >= 2 else a


def _untranspose_kernel(a: Any) -> Any:
    """An Equinox weight (O, I, *K) as a flax kernel (*K, I, O)."""
    n = a.ndim - 2
    return a.transpose(*range(2, n + 2), 1, 0) if a.ndim >= 2 else a


def _same(a: Any) -> Any:
    return a


# kind -> (flax -> Equinox, Equinox -> flax (given the flax leaf's shape), convention)
_KINDS: dict[str, tuple[Callable[[Any], Any], Callable[[Any, tuple[int, ...]], Any], str]] = {
    "dense": (
        lambda a: a.T,
        lambda a, shape: a.T,
        "flax Dense kernel (in, out) <-> Linear weight (out, in)",
    ),
    "conv": (
        _transpose_kernel,
        lambda a, shape: _untranspose_kernel(a),
        "flax Conv kernel (*spatial, in, out) <-> Conv weight (out, in, *spatial)",
    ),
    "conv_bias": (
        _same,
        lambda a, shape: a.reshape(shape),
        "flax Conv bias (out,) <-> Conv bias (out, 1, ...)",
    ),
    "attention_in": (
        lambda a: a.reshape(a.shape[0], -1).T,
        lambda a, shape: a.T.reshape(shape),
        "flax attention kernel (in, heads, head_dim) <-> projection weight (heads*head_dim, in)",
    ),
    "attention_out": (
        lambda a: a.reshape(-1, a.shape[-1]).T,
        lambda a, shape: a.T.reshape(shape),
        "flax attention output kernel (heads, head_dim, out) <-> weight (out, heads*head_dim)",
    ),
    "attention_bias": (
        lambda a: a.reshape(-1),
        lambda a, shape: a.reshape(shape),
        "flax attention bias (heads, head_dim) <-> projection bias (heads*head_dim,)",
    ),
}

# Equinox layer -> (flax's default Linen name, {Equinox leaf: (flax leaf, kind or None)})
_NORM: dict[str, tuple[str, str | None]] = {"weight": ("scale", None), "bias": ("bias", None)}


@functools.cache
def _layers() -> dict[type, tuple[str, dict[str, tuple[str, str | None]]]]:
    nn = eqx.nn
    projections: dict[str, tuple[str, str | None]] = {}
    for ours, theirs in (("query", "query"), ("key", "key"), ("value", "value")):
        projections[f"{ours}_proj.weight"] = (f"{theirs}.kernel", "attention_in")
        projections[f"{ours}_proj.bias"] = (f"{theirs}.bias", "attention_bias")
    projections["output_proj.weight"] = ("out.kernel", "attention_out")
    projections["output_proj.bias"] = ("out.bias", None)
    return {
        nn.MultiheadAttention: ("MultiHeadDotProductAttention", projections),
        nn.Linear: ("Dense", {"weight": ("kernel", "dense"), "bias": ("bias", None)}),
        nn.Conv: ("Conv", {"weight": ("kernel", "conv"), "bias": ("bias", "conv_bias")}),
        nn.Embedding: ("Embed", {"weight": ("embedding", None)}),
        nn.LayerNorm: ("LayerNorm", _NORM),
        nn.GroupNorm: ("GroupNorm", _NORM),
        nn.BatchNorm: ("BatchNorm", _NORM),
    }


def _layer_type(x: Any) -> type | None:
    # ConvTranspose subclasses Conv but flax lays its kernel out otherwise: not covered.
    if isinstance(x, eqx.nn.ConvTranspose):
        return None
    return next((t for t in _layers() if isinstance(x, t)), None)


# ------------------------------------------------------------------ the table


@dataclass(frozen=True)
class _Entry:
    """One leaf an `eqx.nn` layer holds: its Equinox name, its flax name, how its layout
    converts (None: the same) and its Equinox shape."""

    ours: str
    theirs: str
    kind: str | None
    shape: tuple[int, ...]
    counter: int | None = None  # a BatchNorm counter, filled with this value
    dtype: Any = None


def _batch_norm_counter(momentum: float) -> int:
    """The counter for which Equinox's `BatchNorm(mode="batch")` divides its running
    statistics by exactly 1: `momentum**counter` is 0 in float32 and float64 alike."""
    return int(math.ceil(760.0 / -math.log(momentum)))


def _model_root(tree: Any) -> tuple[str, Any] | None:
    """The path and value of the model inside `tree`: the first Equinox module (not a
    `TrainState`) that is or holds an `eqx.nn` layer."""
    from ..train_state import TrainState

    def is_model(x: Any) -> bool:
        return isinstance(x, eqx.Module) and not isinstance(x, TrainState)

    for path, node in jtu.tree_flatten_with_path(tree, is_leaf=is_model)[0]:
        if is_model(node) and _find_layers(node):
            return ("" if not path else path_to_name(path)), node
    return None


def _find_layers(tree: Any) -> list[tuple[str, Any]]:
    """Every `eqx.nn` layer the conventions cover in `tree`, by path, in tree order."""
    pairs = jtu.tree_flatten_with_path(tree, is_leaf=lambda x: _layer_type(x) is not None)[0]
    return [
        (path_to_name(path) if path else "", node)
        for path, node in pairs
        if _layer_type(node) is not None
    ]


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _prefix_map(name: str, mapping: Mapping[str, str]) -> str:
    """`name` with its longest prefix in `mapping` replaced."""
    best = max(
        (p for p in mapping if p == "" or name == p or name.startswith(p + ".")),
        key=len,
        default=None,
    )
    if best is None:
        return name
    rest = name[len(best) :].lstrip(".") if best else name
    return _join(mapping[best], rest)


def _flax_names(model: Any, naming: Naming, modules: Mapping[str, str] | None) -> dict[str, str]:
    """Each layer of `model` (by its path in the model) -> its flax module's path: NNX keeps
    the attribute paths; Linen's default names number each kind in creation order
    (`Dense_0`, `Dense_1`, `Conv_0`), taken here in the Equinox model's order."""
    names: dict[str, str] = {}
    counts: dict[str, int] = {}
    for path, layer in _find_layers(model):
        default, _ = _layers()[_layer_type(layer)]  # type: ignore[index]
        if naming == "nnx":
            names[path] = path
        else:
            names[path] = f"{default}_{counts.get(default, 0)}"
            counts[default] = counts.get(default, 0) + 1
    if modules:
        unknown = [m for m in modules if m not in names]
        if unknown:
            raise ValueError(
                f"flax layout: modules= names {unknown[0]!r}, which is no eqx.nn layer of the "
                f"model; its layers are {sorted(names) or 'none'}."
            )
        names.update(modules)
    return names


def _table(
    tree: Any,
    naming: Naming,
    modules: Mapping[str, str] | None,
    roots: Mapping[str, str] | None,
    batch_stats: str | None,
) -> tuple[list[_Entry], dict[str, str]]:
    """Every leaf of `tree` that an `eqx.nn` layer holds (in every copy of the model: the
    parameters, the optimiser's moments) and every `BatchNorm` statistic of its
    `eqx.nn.State`s, with its flax name; and the root mapping for every other leaf."""
    found = _model_root(tree)
    if found is None:
        raise ValueError(
            "flax layout: the target holds no eqx.nn layer that the layout conventions cover "
            "(Linear, Conv, Embedding, LayerNorm, GroupNorm, BatchNorm, MultiheadAttention)."
        )
    model_path, model = found
    model_type = type(model)
    layer_names = _flax_names(model, naming, modules)
    root_map = dict({model_path: "params"} if naming == "linen" else {})
    root_map.update(roots or {})
    stats_root = batch_stats if naming == "linen" else None
    entries: list[_Entry] = []
    copies = jtu.tree_flatten_with_path(tree, is_leaf=lambda x: type(x) is model_type)[0]
    layers_of = dict(_find_layers(model))
    for path, copy in copies:
        if type(copy) is not model_type:
            continue
        root = path_to_name(path) if path else ""
        saved_root = _prefix_map(root, root_map)
        for layer_path, layer in _find_layers(copy):
            _, leaves = _layers()[_layer_type(layer)]  # type: ignore[index]
            for leaf_path, leaf in flatten_with_names(layer):
                inner = path_to_name(leaf_path)
                if inner not in leaves or not hasattr(leaf, "shape"):
                    continue
                theirs, kind = leaves[inner]
                entries.append(
                    _Entry(
                        _join(root, layer_path, inner),
                        _join(saved_root, layer_names[layer_path], theirs),
                        kind,
                        tuple(leaf.shape),
                    )
                )
    entries += _statistics(
        tree, layers_of, layer_names, _prefix_map(model_path, root_map), stats_root
    )
    return entries, root_map


def _statistics(
    tree: Any,
    layers: Mapping[str, Any],
    layer_names: Mapping[str, str],
    params_root: str,
    stats_root: str | None,
) -> list[_Entry]:
    """The entries of every `BatchNorm`'s running statistics in the `eqx.nn.State`s of
    `tree`, found by the layer's `StateIndex` markers."""
    markers: dict[str, tuple[str, str, Any]] = {}  # marker -> (flax module, field, layer)
    for path, layer in layers.items():
        if not isinstance(layer, eqx.nn.BatchNorm):
            continue
        module = _join(params_root if stats_root is None else stats_root, layer_names[path])
        for field in (
            "batch_state_index",
            "batch_counter",
            "ema_state_index",
            "ema_first_time_index",
        ):
            index = getattr(layer, field, None)
            if index is not None and isinstance(index.marker, str):
                markers[index.marker] = (module, field, layer)
    entries = []
    for key_path, leaf in flatten_with_names(tree):
        hit = next(
            (k.key for k in key_path if isinstance(k, jtu.DictKey) and k.key in markers), None
        )
        if hit is None or not hasattr(leaf, "shape"):
            continue
        module, field, layer = markers[hit]
        name = path_to_name(key_path)
        shape = tuple(leaf.shape)
        if field in ("batch_state_index", "ema_state_index"):
            stat = "mean" if name.endswith(".0") else "var"
            entries.append(_Entry(name, _join(module, stat), None, shape))
        elif field == "batch_counter":
            count = _batch_norm_counter(layer.momentum)
            entries.append(
                _Entry(name, _join(module, "mean"), "counter", shape, count, np.dtype(leaf.dtype))
            )
        else:  # the "ema" mode's first-time flag: the statistics are there
            entries.append(
                _Entry(name, _join(module, "mean"), "counter", shape, 0, np.dtype(leaf.dtype))
            )
    return entries


def _forward(entry: _Entry) -> Convention | None:
    """The flax -> Equinox conversion of one entry's saved tensor, or None (same layout)."""
    if entry.kind == "counter":
        value, dtype, shape = entry.counter, entry.dtype, entry.shape
        what = (
            f"BatchNorm counter set to {value}: flax's running statistics need no "
            "debiasing, and 1 - momentum**counter is then exactly 1"
            if dtype != np.dtype(bool)
            else "BatchNorm statistics present (ema mode's first-time flag False)"
        )
        return Convention(what, lambda a: np.full(shape, value, dtype), shape)
    if entry.kind is None:
        return None
    forward, _, label = _KINDS[entry.kind]
    return Convention(label, forward, entry.shape)


def _backward(entry: _Entry, shape: tuple[int, ...]) -> Convention | None:
    """The Equinox -> flax conversion of one entry's saved tensor into a flax leaf of
    `shape`, or None (the same layout)."""
    if entry.kind is None or entry.kind == "counter":
        return None
    _, backward, label = _KINDS[entry.kind]
    return Convention(label, lambda a: backward(a, shape), shape)


def flax_to_equinox(
    target: Any,
    *,
    naming: Naming = "linen",
    modules: Mapping[str, str] | None = None,
    roots: Mapping[str, str] | None = None,
    batch_stats: str | None = "batch_stats",
) -> FlaxLayout:
    """The `rename=` and `transform=` that read a flax checkpoint (Linen or NNX) into
    `target`, an Equinox model or a tree holding one (a `TrainState` and its optimiser's
    moments, an `eqx.nn.State`): pass them with `**` to any reader.

    ```python
    import equinox as eqx
    import jax
    import numpy as np
    from eqx_train.checkpoints import restore_checkpoint, save_checkpoint
    from eqx_train.interop import flax_to_equinox

    kernel = np.arange(6.0, dtype=np.float32).reshape(2, 3)  # a flax Dense kernel: (in, out)
    dense = {"kernel": kernel, "bias": np.zeros(3, np.float32)}
    save_checkpoint("weights", {"params": {"Dense_0": dense}}, step=0)

    model = eqx.nn.Linear(2, 3, key=jax.random.key(0))
    model = restore_checkpoint("weights", model, **flax_to_equinox(model))
    assert (model.weight == kernel.T).all()  # (out, in)
    ```

    Every leaf an `eqx.nn` layer holds gets its flax name and layout (the table in
    [the migration guide](../coming_from_flax.md#layouts)): a Dense kernel (in, out) is
    transposed into a `Linear` weight (out, in), a conv kernel (*spatial, in, out) into a
    `Conv` weight (out, in, *spatial), a conv bias (out,) gets its size-1 axes, attention
    kernels are reshaped into `MultiheadAttention`'s projections. `plan_restore` with the same
    arguments shows each conversion. Every other leaf keeps its name, under `roots`.

    A `BatchNorm`'s running mean and variance come from flax's `mean` and `var`; its
    counter (`mode="batch"`) is set so that Equinox's `1 - momentum**counter` is exactly 1,
    since flax's statistics are not debiased: the model computes what flax computed, in
    inference and after further training steps.

    **Arguments:**

    - `target`: the tree to restore (its shapes decide each conversion).
    - `naming`: `"linen"`: the flax modules have Linen's default names, numbered per kind
      in the order they were created (`Conv_0`, `Dense_0`, `Dense_1`), which is taken to
      be the Equinox model's field order; the model's parameters are under `params` and
      the statistics under `batch_stats`. `"nnx"`: the flax modules have the Equinox
      layers' attribute paths (`conv1`, `layers.0`), statistics beside the parameters.
    - `modules`: Equinox layer path (inside the model, e.g. `"layers.0"`) -> flax module
      path (e.g. `"Dense_0"`, `"encoder.fc"`), for the layers whose flax names differ from
      the `naming` default.
    - `roots`: target-name prefix -> saved-name prefix, for every leaf (a `rename`
      mapping applied around the layers' names). For `naming="linen"` the model's path
      maps to `"params"` unless given (`{"model": "params"}` for a `TrainState`).
    - `batch_stats`: the saved prefix of Linen's BatchNorm statistics.

    **Returns:**

    A `FlaxLayout`: `{"rename": ..., "transform": ...}`.

    **Raises:**

    `ValueError` when `target` holds no layer the conventions cover, or `modules` names a
    path that is no such layer.
    """
    entries, root_map = _table(target, naming, modules, roots, batch_stats)
    saved = {e.ours: e.theirs for e in entries}

    def rename(name: str) -> str:
        return saved[name] if name in saved else _prefix_map(name, root_map)

    transform: dict[str, Callable[[Any], Any]] = {
        e.ours: fn for e in entries if (fn := _forward(e)) is not None
    }
    return FlaxLayout(rename=rename, transform=transform)


def equinox_to_flax(
    target: Any,
    model: Any,
    *,
    naming: Naming = "linen",
    modules: Mapping[str, str] | None = None,
    roots: Mapping[str, str] | None = None,
    batch_stats: str | None = "batch_stats",
) -> FlaxLayout:
    """The inverse of `flax_to_equinox`: the `rename=` and `transform=` that read an
    Equinox checkpoint of `model` into `target`, a flax tree (a Linen `variables` dict, a
    params dict, NNX's state as nested dicts).

    **Arguments:**

    - `target`: the flax tree to fill.
    - `model`: the tree the Equinox checkpoint was saved from (or one of its structure):
      an Equinox model, or a tree holding one, as `flax_to_equinox`'s `target`.
    - `naming`, `modules`, `roots`, `batch_stats`: as for `flax_to_equinox`, describing
      the flax names.

    **Returns:**

    A `FlaxLayout` whose `rename` maps each flax name to the Equinox one saved, and whose
    `transform` converts each Equinox layout into flax's (a `BatchNorm`'s counter has no
    flax counterpart and is not read).
    """
    entries, root_map = _table(model, naming, modules, roots, batch_stats)
    by_theirs = {e.theirs: e for e in entries if e.kind != "counter"}
    inverse_roots = {v: k for k, v in root_map.items()}
    shapes = {
        path_to_name(p): tuple(leaf.shape)
        for p, leaf in flatten_with_names(target)
        if hasattr(leaf, "shape")
    }

    def rename(name: str) -> str:
        if name in by_theirs:
            return by_theirs[name].ours
        return _prefix_map(name, inverse_roots)

    transform = {
        name: fn
        for name, entry in by_theirs.items()
        if name in shapes and (fn := _backward(entry, shapes[name])) is not None
    }
    return FlaxLayout(rename=rename, transform=transform)


__all__ = ["Convention", "FlaxLayout", "equinox_to_flax", "flax_to_equinox"]
