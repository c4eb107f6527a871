"""Where each target leaf's values come from, by name: `rename`, a mapping of target-name
prefixes to saved-name prefixes (whole dot-separated segments, the longest matching prefix
wins, `""` is the root) or a function `target_name -> saved_name | None`; and the prefix
rules that `transform` mappings and `filter_spec`'s left-out sub-trees share with it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..._calls import call
from ..._tree import path_to_name

Rename = Mapping[str, str] | Callable[[str], str | None] | None
_LISTED_NAMES = 5  # names a message shows of a list before a count

ROOT = path_to_name(())  # the name of the one leaf of a tree that is a leaf


def under(name: str, prefix: str) -> bool:
    """Whether `prefix` is `name` or a run of its first dot-separated segments ("" is all)."""
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def replace(name: str, prefix: str, by: str) -> str:
    """`name` (under `prefix`) with `prefix` replaced by `by`."""
    rest = name[len(prefix) :].lstrip(".") if prefix else name
    return ".".join(part for part in (by, rest) if part)


def longest(name: str, prefixes: Mapping[str, Any]) -> str | None:
    """The longest of `prefixes` that target leaf `name` is under, or None. A tree that is
    one leaf has the name '<root>', which is the prefix ""."""
    path = "" if name == ROOT else name
    return max((p for p in prefixes if under(path, p)), key=len, default=None)


def prefixes_of(name: str) -> list[str]:
    """Every prefix `name` is under: "", then its dot-separated heads, then itself."""
    parts = name.split(".")
    return ["", *(".".join(parts[:i]) for i in range(1, len(parts) + 1))]


def source_of(name: str, rename: Rename) -> tuple[str | None, str | None]:
    """(the saved name target leaf `name` takes its values from, or None for none; the
    `rename` prefix that decided it, or None). The longest matching prefix wins."""
    if rename is None:
        return name, None
    if callable(rename) and not isinstance(rename, Mapping):
        try:
            source = rename(name)
        except Exception as error:
            error.add_note(f"{call()}: raised by rename('{name}'), the target leaf's name")
            raise
        if source is not None and not isinstance(source, str):
            raise TypeError(
                f"{call()}: rename('{name}') returned {source!r}; it must return a saved "
                "name (str) or None (the leaf keeps the target's value)."
            )
        return source, None
    # A root mapped to a leaf takes it, and a leaf mapped to "" takes a file of one array.
    prefix = longest(name, rename)
    if prefix is None:
        return name, None
    return replace("" if name == ROOT else name, prefix, rename[prefix]) or ROOT, prefix


def rename_problems(
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
        inside = [name for name in names if under(name, prefix)]
        if not inside:
            problems.append(
                f"rename {{{prefix!r}: {by!r}}}: no target leaf is named '{prefix}' or under it"
            )
            continue
        longer = sorted({p for p in matched if under(p, prefix)}, key=len)
        problems.append(
            f"rename {{{prefix!r}: {by!r}}}: applies to no leaf, as a longer prefix takes "
            f"each one under '{prefix}' ({some(longer)}); remove it or the longer one"
        )
    if not strict:
        problems += [
            f"rename {{{prefix!r}: {by!r}}}: the file has no tensor for any target leaf under "
            f"'{prefix}' (looked for them under '{by}')"
            for prefix, by in rename.items()
            if prefix in matched and prefix not in found
        ]
    return problems


def some(names: list[str]) -> str:
    """The first few `names`, quoted, then how many more."""
    shown = ", ".join(f"'{n}'" for n in names[:_LISTED_NAMES])
    more = len(names) - _LISTED_NAMES
    return shown + (f" and {more} more" if more > 0 else "")
