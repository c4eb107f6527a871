"""The matcher: which saved tensor fills each leaf of a restore target, and what would stop
the restore. One function (`match`) decides it from the checkpoint's headers alone (names,
shapes, dtypes, PRNG key implementations); `restore_from` then reads what it says, and
`plan_restore` shows it without reading any tensor data.

A target leaf's source is its own name unless `rename` says otherwise (a mapping of name
prefixes, or a function, `_rename`); a `transform` may reshape the saved tensor first
(`_transform`); a source whose dtype differs is cast on the host when NumPy's
`can_cast(saved, target, casting)` allows it.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import jax
    import jax.tree_util as jtu
else:  # imported on first use: the command line reads headers without JAX
    from ..._lazy import LazyModule

    jax = LazyModule("jax")
    jtu = LazyModule("jax.tree_util")

from ..._calls import call, outside_stacklevel
from .._errors import PartialRestoreWarning as PartialRestoreWarning
from ..format._description import LeafKind, key_impl, key_impls, kind_of
from ..format._leaf_names import leaf_names
from . import _selection, _transform
from ._matched import Match as Match, Slot as Slot, cast_on_host as cast_on_host
from ._options import CASTINGS as CASTINGS, Casting as Casting, RestoreOptions
from ._rename import (
    ROOT,
    Rename as Rename,
    longest,
    prefixes_of,
    rename_problems,
    some,
    source_of as source_of,
    under,
)


def loosest_needed(saved: np.dtype, target: np.dtype) -> str | None:
    """The strictest `casting` under which `saved` may be cast to `target`, or None."""
    return next((c for c in CASTINGS if np.can_cast(saved, target, c)), None)


def saved_key_impls(reader: Any) -> dict[str, str]:
    """The implementation of every typed PRNG key the file's tree records, by tensor name."""
    return key_impls(reader.description()) if reader.has_description else {}


def _describe(shape: Any, dtype: Any) -> str:
    return f"{tuple(shape)} {np.dtype(dtype)}"


def _expected(kind: LeafKind, leaf: Any) -> tuple[tuple[int, ...], np.dtype | None]:
    """What a target leaf needs from the file: its shape, and its dtype (None: a Python
    scalar, which takes any dtype whose value converts exactly)."""
    if kind.scalar_type is not None:
        return (), None
    data = kind.data(leaf)
    return tuple(data.shape), np.dtype(data.dtype)


def match(reader: Any, target: Any, options: RestoreOptions) -> Match:
    """Matches every data leaf of `target` against the tensors of `reader` (headers only),
    as `options` say: by name through `rename`; through `transform` (evaluated on the
    saved shape and dtype, `_transform`); shape equal; dtype equal or castable under
    `casting` (PRNG keys never cast, and their implementation equal); with `strict`, no
    leaf without a saved tensor and no saved tensor unused. `filter_spec` leaves out
    leaves (kept from the target), and the saved tensors under the sub-trees it leaves out
    whole go unused as expected; with `config="target"` the Python scalars of Equinox
    modules are compared, not taken (`_selection`). A target none of whose leaves to
    restore is in the file is refused whatever `strict` says. Every problem is listed,
    naming the leaf (and its saved name when `rename` changed it)."""
    strict, rename, casting = options.strict, options.rename, options.casting
    filter_spec, transform, config = options.filter_spec, options.transform, options.config
    available = reader.arrays()
    saved_keys = saved_key_impls(reader)
    pairs, treedef = jtu.tree_flatten_with_path(target)
    names = leaf_names(target, available, reader.path)  # eqx.nn.State: by marker
    found = Match([leaf for _, leaf in pairs], treedef, names)
    chosen = _selection.selected(target, filter_spec)
    judge = _Judge(found, available, saved_keys, casting, transform)
    used = _left_out(names, chosen, rename, available) if filter_spec is not None else set()
    data_names: list[str] = []  # of every data leaf, for what a dead prefix entry says
    to_restore: list[str] = []  # data leaves the restore should fill from the file
    in_file = 0  # of them, those whose saved name the file holds
    prefixes_matched: set[str] = set()
    prefixes_found: set[str] = set()
    for index, (key_path, leaf) in enumerate(pairs):
        kind = kind_of(leaf)
        if kind is None:
            continue  # not data: kept from the target
        name = names[index]
        data_names.append(name)
        source, prefix = source_of(name, rename)
        if prefix is not None:
            prefixes_matched.add(prefix)
            if source in available:
                prefixes_found.add(prefix)
        chosen_fn = judge.transform_for(name)
        if not chosen[index] or source is None:
            # Left out by filter_spec: kept from the target, and its saved tensor (if any)
            # is never "extra". Given no source by rename: kept, and it takes no saved
            # tensor, so one of its name that no other leaf takes is unused.
            if source is not None:
                used.add(source)
            found.kept.append(name)
            continue
        is_config = (
            config == "target"
            and kind.scalar_type is not None
            and _selection.is_module_field(target, key_path)
        )
        if not is_config:
            to_restore.append(name)
        shape, dtype = _expected(kind, leaf)
        expectation = _describe(shape, dtype) if dtype is not None else f"() {type(leaf).__name__}"
        label = f"'{name}'" if source == name else f"'{name}' (from saved '{source}' by rename)"
        if source not in available:
            if strict and not is_config:
                found.problems.append(
                    f"{label}: missing from the file, target expects {expectation}"
                )
            elif not is_config:
                found.kept.append(name)
                found.missing.append(name)
            continue
        used.add(source)
        in_file += not is_config
        slot = judge(index, name, source, label, kind, leaf, is_config, expectation, chosen_fn)
        if slot is None:
            continue
        if is_config:
            found.config_slots.append(slot)
            continue
        found.take(slot, tuple(available[source][0]))
    found.unused = [name for name in available if name not in used]
    if strict:
        found.problems += [
            f"'{name}': in the file as {_describe(*available[name])}, not in the target"
            for name in found.unused
        ]
    found.problems.extend(
        rename_problems(rename, data_names, prefixes_matched, prefixes_found, strict)
    )
    found.problems.extend(judge.dead_prefixes(data_names))
    if to_restore and not in_file:
        found.nothing_found = True
        found.problems.insert(0, _nothing_found(available, to_restore, rename))
    if found.problems:
        found.hint = _selection.replicated_hint(judge.shared_arrays)
    return found


class _Judge:
    """Whether one saved tensor can fill one target leaf (through its transform, by shape,
    dtype and PRNG key implementation): a `Slot` to fill it, or a problem in `found`."""

    def __init__(
        self,
        found: Match,
        available: Mapping[str, tuple[tuple[int, ...], np.dtype]],
        saved_keys: dict[str, str],
        casting: Casting,
        transform: _transform.Transform,
    ) -> None:
        self.found, self.available, self.saved_keys = found, available, saved_keys
        self.casting: Casting = casting
        self.transform = transform
        self.shared_arrays: list[tuple[Any, Any, Any, Any]] = []  # the replicated-save hint
        self.prefixes_used: set[str] = set()  # of a transform mapping

    def transform_for(self, name: str) -> Callable[[Any], Any] | None:
        """The function to run on target leaf `name`'s saved tensor, or None."""
        if not isinstance(self.transform, Mapping):
            return _transform.bind(self.transform, name, None)
        prefix = longest(name, self.transform)
        if prefix is None:
            return None
        self.prefixes_used.add(prefix)
        return self.transform[prefix]

    def dead_prefixes(self, names: list[str]) -> list[str]:
        """A transform mapping's entries that apply to no target leaf (a typo)."""
        if not isinstance(self.transform, Mapping):
            return []
        dead = [p for p in self.transform if p not in self.prefixes_used]
        return [
            f"transform {{{p!r}: ...}}: no target leaf is named '{p}' or under it"
            if not any(under(name, p) for name in names)
            else f"transform {{{p!r}: ...}}: applies to no leaf, as a longer prefix takes "
            f"each one under '{p}'; remove it or the longer one"
            for p in dead
        ]

    def __call__(
        self,
        index: int,
        name: str,
        source: str,
        label: str,
        kind: LeafKind,
        leaf: Any,
        is_config: bool,
        expectation: str,
        fn: Callable[[Any], Any] | None,
    ) -> Slot | None:
        problems = self.found.problems
        # Before the shape: an rbg key's data is (4,), a threefry key's (2,).
        impl = str(key_impl(leaf)) if kind.name == "prng_key" else None
        if impl is not None and self.saved_keys.get(source, impl) != impl:
            problems.append(
                f"{label}: file has a {self.saved_keys[source]} PRNG key, target expects {impl}"
            )
            return None
        file_shape, file_dtype = self.available[source]
        saved = _describe(file_shape, file_dtype)
        if fn is None and _transform.layouts_differ(
            source, name, file_shape, _expected(kind, leaf)[0]
        ):
            self.found.mismatched.append(source)
            problems.append(f"{label}: {_transform.layout_refusal(source, name)}")
            return None
        if fn is not None:
            try:
                after = _transform.evaluate(
                    fn,
                    tuple(file_shape),
                    file_dtype,
                    none_ok=not isinstance(self.transform, Mapping),
                )
            except _transform.TransformError as error:
                problems.append(f"{label}: transforming saved '{source}': {error}")
                return None
            if after is None:
                fn = None  # the function form's "no transform for this leaf"
            else:
                file_shape, file_dtype = after
                saved += f", transformed to {_describe(file_shape, file_dtype)}"
        shape, dtype = _expected(kind, leaf)
        if fn is None and dtype is not None and _transform.only_unit_axes(file_shape, shape):
            fn = _transform.unit_axes(shape)  # accepted, and the plan says so
            saved += f", reshaped to {_describe(shape, file_dtype)}"
            file_shape = shape
        if dtype is not None:
            self.shared_arrays.append((file_shape, file_dtype, shape, dtype))
        # A Python scalar takes a saved value that converts exactly; a saved bool never
        # does into an int or a float (`_description`'s fill refuses it whatever its
        # value), which the header already says; only a Python complex takes a complex.
        numeric = file_dtype.kind in (
            "biuf" if is_config or kind.scalar_type in (None, bool) else "iuf"
        ) or (file_dtype.kind == "c" and (is_config or kind.scalar_type is complex))
        cast = dtype is not None and file_dtype != dtype
        # Key data is never cast, whether the target or the file holds the key.
        is_key = kind.name == "prng_key" or source in self.saved_keys
        allowed = not cast or (
            not is_key and np.can_cast(file_dtype, np.dtype(dtype), self.casting)
        )
        if file_shape != shape or (dtype is None and not numeric) or not allowed:
            self.found.mismatched.append(source)
            why = _why_not_cast(
                is_key, file_shape == shape and cast, file_dtype, dtype, self.casting
            )
            if fn is None and file_shape != shape:
                why += _transform.permutation_hint(name, tuple(file_shape), shape)
                why += _transform.layout_hint(source, name)
            problems.append(f"{label}: file has {saved}, target expects {expectation}{why}")
            return None
        return Slot(
            index,
            name,
            source,
            kind,
            np.dtype(dtype) if cast else None,
            fn,
            tuple(file_shape),
            np.dtype(file_dtype),
        )


def _left_out(
    names: list[str], chosen: list[bool], rename: Rename, available: Mapping[str, Any]
) -> set[str]:
    """The saved tensors a `filter_spec` expects to go unused: those under a sub-tree of the
    target that it leaves out whole (a fresh optimiser state), by the sub-tree's own name
    and, where a `rename` mapping entry covers the whole sub-tree, by its saved name."""
    prefixes = set(_selection.left_out_prefixes(names, chosen))
    if isinstance(rename, Mapping):
        for prefix in list(prefixes):
            source, by = source_of(prefix or ROOT, rename)
            if by is not None and source is not None:
                prefixes.add("" if source == ROOT else source)
    return {name for name in available if any(p in prefixes for p in prefixes_of(name))}


def _nothing_found(available: Mapping[str, Any], to_restore: list[str], rename: Rename) -> str:
    """The problem of a target none of whose leaves to restore is in the file."""
    return (
        f"none of the target's {len(to_restore)} leaves to restore is in the file"
        + (" (after rename)" if rename is not None else "")
        + f": the file holds {len(available)} tensors ({some(list(available))}), the target "
        f"asks for {some(to_restore)}. Map the target's names to the saved ones with "
        "rename=, and check what matches with plan_restore first"
    )


def _why_not_cast(
    is_key: bool, dtype_only: bool, saved: np.dtype, target: Any, casting: str
) -> str:
    """The end of a dtype refusal: what would allow the cast, if anything."""
    if not dtype_only:
        return ""
    if is_key:
        return " (PRNG key data is never cast)"
    needed = loosest_needed(saved, target)
    return f"; casting={needed!r} would allow it (now casting={casting!r})" if needed else ""


def warn_partial(path: str, found: Match) -> None:
    """One `PartialRestoreWarning` for a `strict=False` restore that left target leaves
    without a saved tensor or saved tensors unused; nothing when neither."""
    lines = []
    if found.missing:
        lines.append(
            f"{len(found.missing)} target leaves kept the target's values (no saved tensor): "
            + some(found.missing)
        )
    if found.unused:
        lines.append(f"{len(found.unused)} saved tensors went unused: " + some(found.unused))
    if lines:
        listed = "\n  ".join(lines)
        warnings.warn(
            PartialRestoreWarning(
                f"{call()}: {path} restored partially (strict=False):\n  {listed}\n"
                "plan_restore lists them all before restoring."
            ),
            stacklevel=outside_stacklevel(sys._getframe()),
        )


def warn_placeholders(path: str, found: Match, leaves: list[Any]) -> None:
    """One `PartialRestoreWarning` naming the leaves of an abstract target that a restore
    returns as `jax.ShapeDtypeStruct` placeholders; nothing when there are none."""
    names = [
        name
        for name, leaf in zip(found.names, leaves, strict=True)
        if isinstance(leaf, jax.ShapeDtypeStruct)
    ]
    if names:
        warnings.warn(
            PartialRestoreWarning(
                f"{call()}: {len(names)} leaves of the abstract target were not restored "
                f"from {path} and come back as jax.ShapeDtypeStruct placeholders: "
                f"{some(names)}. Give them values (e.g. eqx.combine with a concrete tree) "
                "before use, or restore them too (filter_spec, rename, strict)."
            ),
            stacklevel=outside_stacklevel(sys._getframe()),
        )
