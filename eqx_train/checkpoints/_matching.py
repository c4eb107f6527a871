"""The matcher: which saved tensor fills each leaf of a restore target, and what would stop
the restore. One function (`match`) decides it from the checkpoint's headers alone (names,
shapes, dtypes, PRNG key implementations); `restore_from` then reads what it says, and
`plan_restore` shows it without reading any tensor data.

A target leaf's source is its own name unless `rename` says otherwise (a mapping of name
prefixes, or a function); a source whose dtype differs is cast on the host when NumPy's
`can_cast(saved, target, casting)` allows it.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    import jax
    import jax.tree_util as jtu
else:  # imported on first use: the command line reads headers without JAX
    from .._lazy import LazyModule

    jax = LazyModule("jax")
    jtu = LazyModule("jax.tree_util")

from .._tree import path_to_name
from . import _selection
from ._description import LeafKind, key_impl, key_impls, kind_of
from ._errors import outside_stacklevel
from ._leaf_names import leaf_names

Casting = Literal["no", "equiv", "safe", "same_kind", "unsafe"]
CASTINGS: tuple[Casting, ...] = ("no", "equiv", "safe", "same_kind", "unsafe")
Rename = Mapping[str, str] | Callable[[str], str | None] | None
_LISTED_NAMES = 5  # names a PartialRestoreWarning shows of each list before a count


class PartialRestoreWarning(UserWarning):
    """A restore with `strict=False` left some target leaves with the target's values (the
    checkpoint has no tensor for them) or left some saved tensors unused; or a restore into
    an abstract target (`jax.ShapeDtypeStruct` leaves) returns some of them unfilled, as
    placeholders (left out by `filter_spec` or `rename`, or missing with `strict=False`).

    The message says how many of each and names the first few. `plan_restore` lists them
    all before restoring; `warnings.simplefilter("ignore", PartialRestoreWarning)` silences
    a restore whose partiality is intended.
    """


def check_options(
    casting: Any, rename: Any, caller: str, *, target: Any = (), filter_spec: Any = None
) -> None:
    """Raises, naming `caller`, for a `casting` or `rename` of the wrong kind, and for any of
    `rename`, `casting`, `filter_spec` given with `target=None` (which loads the file as
    saved: they would be ignored)."""
    if target is None:
        given = [
            name
            for name, is_set in [
                ("rename", rename is not None),
                ("casting", casting != "no"),
                ("filter_spec", filter_spec is not None),
            ]
            if is_set
        ]
        if given:
            raise ValueError(
                f"{caller}: {', '.join(given)} applies to a target's leaves, but "
                "target=None loads the file as saved; pass the target to restore into."
            )
    if casting not in CASTINGS:
        raise ValueError(f"{caller}: casting must be one of {CASTINGS}, got {casting!r}.")
    if rename is None or callable(rename):
        return
    if not isinstance(rename, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in rename.items()
    ):
        raise TypeError(
            f"{caller}: rename must be a mapping of target name prefixes to saved name "
            f"prefixes (str -> str) or a function name -> saved name or None, got {rename!r}."
        )


_ROOT = path_to_name(())  # the name of the one leaf of a tree that is a leaf


def _under(name: str, prefix: str) -> bool:
    """Whether `prefix` is `name` or a run of its first dot-separated segments ("" is all)."""
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def _replace(name: str, prefix: str, by: str) -> str:
    rest = name[len(prefix) :].lstrip(".") if prefix else name
    return ".".join(part for part in (by, rest) if part)


def source_of(name: str, rename: Rename, caller: str) -> tuple[str | None, str | None]:
    """(the saved name target leaf `name` takes its values from, or None for none; the
    `rename` prefix that decided it, or None). The longest matching prefix wins."""
    if rename is None:
        return name, None
    if callable(rename) and not isinstance(rename, Mapping):
        try:
            source = rename(name)
        except Exception as error:
            error.add_note(f"{caller}: raised by rename('{name}'), the target leaf's name")
            raise
        if source is not None and not isinstance(source, str):
            raise TypeError(
                f"{caller}: rename('{name}') returned {source!r}; it must return a saved "
                "name (str) or None (the leaf keeps the target's value)."
            )
        return source, None
    # A tree that is one leaf has the name '<root>', which is the prefix "": a root
    # mapped to a leaf takes it, and a leaf mapped to "" takes a file of one array.
    path = "" if name == _ROOT else name
    matching = [prefix for prefix in rename if _under(path, prefix)]
    if not matching:
        return name, None
    prefix = max(matching, key=len)
    return _replace(path, prefix, rename[prefix]) or _ROOT, prefix


def loosest_needed(saved: np.dtype, target: np.dtype) -> str | None:
    """The strictest `casting` under which `saved` may be cast to `target`, or None."""
    return next((c for c in CASTINGS if np.can_cast(saved, target, c)), None)


def cast_on_host(array: np.ndarray, dtype: np.dtype | None) -> np.ndarray:
    """`array` as `dtype` (None: as it is), as NumPy casts: a value out of range becomes
    inf (a float) or wraps (an integer), and a complex loses its imaginary part, silently,
    as the `casting` asked for allows."""
    if dtype is None or array.dtype == dtype:
        return array
    with np.errstate(over="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", np.exceptions.ComplexWarning)
        return array.astype(dtype)


def saved_key_impls(reader: Any) -> dict[str, str]:
    """The implementation of every typed PRNG key the file's tree records, by tensor name."""
    return key_impls(reader.description()) if reader.has_description else {}


@dataclass(frozen=True)
class Slot:
    """One target leaf filled from one saved tensor (`cast`: the dtype to cast to on the
    host, or None)."""

    index: int
    target: str
    saved: str
    kind: LeafKind
    cast: np.dtype | None = None


@dataclass
class Match:
    """What `match` decided: the leaves to fill, and what a plan shows."""

    leaves: list[Any]
    treedef: Any
    names: list[str]  # of every leaf, as the file names them
    slots: list[Slot] = field(default_factory=list)  # arrays, taken
    config_slots: list[Slot] = field(default_factory=list)  # module scalars, compared
    taken: dict[str, str] = field(default_factory=dict)
    cast: dict[str, tuple[np.dtype, np.dtype]] = field(default_factory=dict)
    kept: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # kept: no saved tensor (strict=False)
    unused: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)  # saved names a bad header may explain
    hint: str = ""


def _describe(shape: Any, dtype: Any) -> str:
    return f"{tuple(shape)} {np.dtype(dtype)}"


def _expected(kind: LeafKind, leaf: Any) -> tuple[tuple[int, ...], np.dtype | None]:
    """What a target leaf needs from the file: its shape, and its dtype (None: a Python
    scalar, which takes any dtype whose value converts exactly)."""
    if kind.scalar_type is not None:
        return (), None
    data = kind.data(leaf)
    return tuple(data.shape), np.dtype(data.dtype)


def match(
    reader: Any,
    target: Any,
    *,
    strict: bool,
    rename: Rename = None,
    casting: Casting = "no",
    config: _selection.Config = "target",
    filter_spec: Any = None,
    caller: str = "restore_checkpoint",
) -> Match:
    """Matches every data leaf of `target` against the tensors of `reader` (headers only):
    by name through `rename`; shape equal; dtype equal or castable under `casting` (PRNG
    keys never cast, and their implementation equal); with `strict`, no leaf without a
    saved tensor and no saved tensor unused. `filter_spec` leaves out leaves (kept from the
    target); with `config="target"` the Python scalars of Equinox modules are compared, not
    taken (`_selection`). Every problem is listed, naming the leaf (and its saved name when
    `rename` changed it)."""
    available = reader.arrays()
    saved_keys = saved_key_impls(reader)
    pairs, treedef = jtu.tree_flatten_with_path(target)
    names = leaf_names(target, available, reader.path, caller)  # eqx.nn.State: by marker
    found = Match([leaf for _, leaf in pairs], treedef, names)
    chosen = _selection.selected(target, filter_spec)
    shared_arrays: list[tuple[Any, Any, Any, Any]] = []  # for the replicated-save hint
    used: set[str] = set()
    data_names: list[str] = []  # of every data leaf, for what a dead `rename` entry says
    prefixes_matched: set[str] = set()
    prefixes_found: set[str] = set()
    for index, (key_path, leaf) in enumerate(pairs):
        kind = kind_of(leaf)
        if kind is None:
            continue  # not data: kept from the target
        name = names[index]
        data_names.append(name)
        source, prefix = source_of(name, rename, caller)
        if prefix is not None:
            prefixes_matched.add(prefix)
            if source in available:
                prefixes_found.add(prefix)
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
        # Before the shape: an rbg key's data is (4,), a threefry key's (2,).
        impl = str(key_impl(leaf)) if kind.name == "prng_key" else None
        if impl is not None and saved_keys.get(source, impl) != impl:
            found.problems.append(
                f"{label}: file has a {saved_keys[source]} PRNG key, target expects {impl}"
            )
            continue
        file_shape, file_dtype = available[source]
        if dtype is not None:
            shared_arrays.append((file_shape, file_dtype, shape, dtype))
        # A Python scalar takes a saved value that converts exactly; a saved bool never
        # does into an int or a float (`_description`'s fill refuses it whatever its
        # value), which the header already says; only a Python complex takes a complex.
        numeric = file_dtype.kind in (
            "biuf" if is_config or kind.scalar_type in (None, bool) else "iuf"
        ) or (file_dtype.kind == "c" and (is_config or kind.scalar_type is complex))
        cast = dtype is not None and file_dtype != dtype
        # Key data is never cast, whether the target or the file holds the key.
        is_key = kind.name == "prng_key" or source in saved_keys
        allowed = not cast or (not is_key and np.can_cast(file_dtype, np.dtype(dtype), casting))
        if file_shape != shape or (dtype is None and not numeric) or not allowed:
            found.mismatched.append(source)
            found.problems.append(
                f"{label}: file has {_describe(file_shape, file_dtype)}, target expects "
                f"{expectation}"
                + _why_not_cast(is_key, file_shape == shape and cast, file_dtype, dtype, casting)
            )
            continue
        slot = Slot(index, name, source, kind, dtype if cast else None)
        if is_config:
            found.config_slots.append(slot)
            continue
        found.slots.append(slot)
        found.taken[name] = source
        if cast:
            found.cast[name] = (np.dtype(file_dtype), np.dtype(dtype))
    found.unused = [name for name in available if name not in used]
    if strict:
        for name in found.unused:
            shape, dtype = available[name]
            found.problems.append(
                f"'{name}': in the file as {_describe(shape, dtype)}, not in the target"
            )
    found.problems.extend(
        _rename_problems(rename, data_names, prefixes_matched, prefixes_found, strict)
    )
    if found.problems:
        found.hint = _selection.replicated_hint(shared_arrays)
    return found


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


def _rename_problems(
    rename: Rename, names: list[str], matched: set[str], found: set[str], strict: bool
) -> list[str]:
    """A `rename` entry that applies to no target leaf (none is under it, or a longer
    prefix takes each one that is), or (with `strict=False`, where a missing leaf is no
    problem of its own) whose saved prefix holds no tensor: a typo."""
    if rename is None or callable(rename) and not isinstance(rename, Mapping):
        return []
    problems = []
    for prefix, by in rename.items():
        if prefix in matched:
            continue
        under = [name for name in names if _under(name, prefix)]
        if not under:
            problems.append(
                f"rename {{{prefix!r}: {by!r}}}: no target leaf is named '{prefix}' or under it"
            )
            continue
        longer = sorted({p for p in matched if _under(p, prefix)}, key=len)
        problems.append(
            f"rename {{{prefix!r}: {by!r}}}: applies to no leaf, as a longer prefix takes "
            f"each one under '{prefix}' ({_some(longer)}); remove it or the longer one"
        )
    if not strict:
        problems += [
            f"rename {{{prefix!r}: {by!r}}}: the file has no tensor for any target leaf under "
            f"'{prefix}' (looked for them under '{by}')"
            for prefix, by in rename.items()
            if prefix in matched and prefix not in found
        ]
    return problems


def _some(names: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:_LISTED_NAMES])
    more = len(names) - _LISTED_NAMES
    return shown + (f" and {more} more" if more > 0 else "")


def warn_partial(path: str, found: Match, caller: str) -> None:
    """One `PartialRestoreWarning` for a `strict=False` restore that left target leaves
    without a saved tensor or saved tensors unused; nothing when neither."""
    lines = []
    if found.missing:
        lines.append(
            f"{len(found.missing)} target leaves kept the target's values (no saved tensor): "
            + _some(found.missing)
        )
    if found.unused:
        lines.append(f"{len(found.unused)} saved tensors went unused: " + _some(found.unused))
    if lines:
        listed = "\n  ".join(lines)
        warnings.warn(
            PartialRestoreWarning(
                f"{caller}: {path} restored partially (strict=False):\n  {listed}\n"
                "plan_restore lists them all before restoring."
            ),
            stacklevel=outside_stacklevel(sys._getframe()),
        )


def warn_placeholders(path: str, found: Match, leaves: list[Any], caller: str) -> None:
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
                f"{caller}: {len(names)} leaves of the abstract target were not restored "
                f"from {path} and come back as jax.ShapeDtypeStruct placeholders: "
                f"{_some(names)}. Give them values (e.g. eqx.combine with a concrete tree) "
                "before use, or restore them too (filter_spec, rename, strict)."
            ),
            stacklevel=outside_stacklevel(sys._getframe()),
        )
