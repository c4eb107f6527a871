"""Where Orbax checkpoints are: which directories are PyTree checkpoints, the items of a
`CheckpointManager` step, the steps of a run, and the one a path and item name."""

from __future__ import annotations

import os
import re

from ..checkpoints.engine import CheckpointFormatError, call, calling

METADATA_NAME = "_METADATA"
OCDBT_MANIFEST = "manifest.ocdbt"
LEGACY_NAME = "checkpoint"  # orbax before _METADATA: one msgpack file of the tree
_STEP_METADATA = "_CHECKPOINT_METADATA"
_TMP_MARK = ".orbax-checkpoint-tmp"
_STEP_NAME = re.compile(r"(?:.*?_)?(\d+)")


def is_pytree_checkpoint(path: str) -> bool:
    """Whether `path` is one Orbax PyTree checkpoint directory (the markers flax uses)."""
    return os.path.isdir(path) and any(
        os.path.lexists(os.path.join(path, name))
        for name in (METADATA_NAME, OCDBT_MANIFEST, LEGACY_NAME)
    )


def _items(path: str) -> list[str]:
    """The named items of a `CheckpointManager` step directory, sorted."""
    try:
        names = os.listdir(path)
    except (NotADirectoryError, FileNotFoundError):
        return []
    return sorted(
        n for n in names if _TMP_MARK not in n and is_pytree_checkpoint(os.path.join(path, n))
    )


def _steps(path: str) -> list[tuple[int, str]]:
    """(step, directory) of the committed Orbax steps in a run directory, oldest first."""
    try:
        names = os.listdir(path)
    except (NotADirectoryError, FileNotFoundError):
        return []
    found = []
    for name in names:
        match = _STEP_NAME.fullmatch(name)
        full = os.path.join(path, name)
        if match is None or _TMP_MARK in name or not os.path.isdir(full):
            continue
        if is_pytree_checkpoint(full) or _items(full):
            found.append((int(match[1]), full))
    return sorted(found)


def layout(path: str) -> tuple[str, list[str]]:
    """What an Orbax directory is: ("checkpoint", []), ("step", its item names), ("run",
    its step directories, oldest first), or ("", []) when it is not Orbax. A run whose
    steps are named in several ways raises `CheckpointFormatError`."""
    if not os.path.isdir(path):
        return "", []
    if is_pytree_checkpoint(path):
        return "checkpoint", []
    items, steps = _items(path), _steps(path)
    # A flax run directory's `checkpoint_<step>/` look like items too: a step directory
    # of a CheckpointManager is marked by its step metadata.
    if items and (os.path.lexists(os.path.join(path, _STEP_METADATA)) or not steps):
        return "step", items
    if steps:
        directories = [directory for _, directory in steps]
        _one_naming(path, directories)
        return "run", directories
    return "", []


def describe(path: str) -> str | None:
    """What kind of Orbax directory `path` is, in words (None: not an Orbax directory)."""
    kind, names = layout(path)
    if kind == "checkpoint":
        return "an Orbax PyTree checkpoint"
    if kind == "step":
        return f"an Orbax CheckpointManager step with items {', '.join(names)}"
    if kind == "run":
        return f"a directory of {len(names)} Orbax checkpoints"
    return None


def resolve(path: str, item: str | None) -> str:
    """The PyTree checkpoint directory `path` and `item` name: the directory itself, one
    item of a `CheckpointManager` step, or that within the latest step of a run."""
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{call()}: {path} does not exist.")
    if not os.path.isdir(path):
        raise CheckpointFormatError(
            f"{path} is a file, not an Orbax checkpoint directory (a flax msgpack checkpoint "
            "is one file: read it with load_flax_checkpoint)."
        )
    if _TMP_MARK in os.path.basename(path.rstrip(os.sep)):
        raise CheckpointFormatError(
            f"{path} is an unfinished Orbax save (its name has '{_TMP_MARK}'); it was never "
            "committed."
        )
    kind, names = layout(path)
    if kind == "checkpoint":
        if item is not None:
            raise ValueError(
                f"{call()}: item={item!r} was given but {path} is a single PyTree checkpoint, "
                "not a CheckpointManager step with named items; leave item out."
            )
        return path
    if kind == "step":
        if item is None and len(names) == 1:
            return os.path.join(path, names[0])
        if item is None:
            raise ValueError(
                f"{call()}: {path} holds several items ({', '.join(names)}); choose one with "
                "item=..."
            )
        if item not in names:
            raise ValueError(
                f"{call()}: {path} has no item {item!r}; its items are {', '.join(names)}."
            )
        return os.path.join(path, item)
    if kind == "run":
        return resolve(names[-1], item)
    raise CheckpointFormatError(
        f"{path} is not an Orbax checkpoint: it holds no {METADATA_NAME} or "
        f"{OCDBT_MANIFEST}, no item directories and no step directories."
    )


def _one_naming(path: str, directories: list[str]) -> None:
    """Refuses a run directory whose steps are named in several ways (`checkpoint_3` beside
    `backup_99`): which is the latest is then a guess, and a wrong guess restores the wrong
    run without a word."""
    prefixes: dict[str, str] = {}
    for directory in directories:
        name = os.path.basename(directory)
        match = _STEP_NAME.fullmatch(name)
        if match is not None:
            prefixes.setdefault(name[: match.start(1)], name)
    if len(prefixes) > 1:
        raise CheckpointFormatError(
            f"{path} holds Orbax checkpoints named in {len(prefixes)} ways "
            f"({', '.join(sorted(prefixes.values()))}): which one is the latest is "
            "ambiguous; pass the checkpoint or step directory to read."
        )


def _step_of(directory: str) -> int | None:
    match = _STEP_NAME.fullmatch(os.path.basename(directory.rstrip(os.sep)))
    return int(match[1]) if match else None


def steps_to_convert(path: str, item: str | None) -> list[tuple[int, str]]:
    """(step, PyTree checkpoint directory) of every checkpoint `path` stands for, oldest
    first: a checkpoint or a `CheckpointManager` step is one (its step from its directory's
    name, else 0), a run directory all its committed steps."""
    with calling("convert-orbax"):  # refuses what is not Orbax, checks `item`
        single = resolve(path, item)
    kind, _ = layout(path)
    if kind != "run":
        parent = os.path.dirname(os.path.abspath(path))
        step = None
        if kind == "checkpoint" and layout(parent)[0] == "step":
            step = _step_of(parent)  # an item (`ema_2`, say) of a step: the step's number
        if step is None:
            step = _step_of(path)
        return [(step or 0, single)]
    steps = _steps(path)
    with calling("convert-orbax"):
        found = [(step, resolve(directory, item)) for step, directory in steps]
    for (step, first), (other, second) in zip(found, found[1:], strict=False):
        if step == other:
            raise ValueError(f"{first} and {second} are both step {step}; keep one of them")
    return found
