"""The metadata of an Orbax PyTree checkpoint, validated before any array is opened:
`_METADATA` (every leaf's keys and what it holds) and the files below the directory (no
FIFO, device, oversized manifest, or symbolic link leading out of it). `_orbax` reads the
arrays it names."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..checkpoints import engine
from ..checkpoints.engine import MAX_DEPTH, CheckpointFormatError, LocalSource, short
from ._orbax_layout import LEGACY_NAME, METADATA_NAME, OCDBT_MANIFEST

# About 140 bytes a leaf: room for ~470k leaves. JSON parses to up to ~20x its size in
# Python objects, so this also bounds what a hostile file can make us allocate.
_MAX_METADATA_BYTES = 64 << 20
# tensorstore reads an OCDBT manifest, and in the plain layout a chunk file, whole: a
# sparse file of any size costs nothing on disk. Real manifests are a few KiB.
_MAX_MANIFEST_BYTES = 64 << 20
SEQUENCE, DICT = 1, 2
ARRAY_TYPES = ("jax.Array", "np.ndarray", "scalar")
EMPTY = {"None": None, "Dict": dict, "List": list, "Tuple": tuple, "NamedTuple": None}


def read_json(path: str, what: str, bad: Any) -> Any:
    source = LocalSource(path, bad)  # no blocking open, regular files only
    try:
        if source.size > _MAX_METADATA_BYTES:
            raise bad(f"{what} has {source.size} bytes, more than {_MAX_METADATA_BYTES}")
        raw = bytearray(source.size)
        source.read_into(memoryview(raw), 0)
    finally:
        source.close()
    return engine.parse_json(bytes(raw), what, bad)


class Leaf:
    """One entry of `_METADATA`: its keys (with their types) and what it holds; `stored`:
    the name its array is stored under (its keys joined, before NNX's `value` was
    unwrapped)."""

    __slots__ = ("keys", "kinds", "value_type", "skip", "stored")

    def __init__(
        self,
        keys: tuple[str, ...],
        kinds: tuple[int, ...],
        value_type: str,
        skip: bool,
        stored: str | None = None,
    ):
        self.keys, self.kinds, self.value_type, self.skip = keys, kinds, value_type, skip
        self.stored = ".".join(keys) if stored is None else stored

    @property
    def name(self) -> str:
        return ".".join(self.keys)


@dataclass(frozen=True)
class OrbaxMetadata:
    """`_METADATA`, validated: where the arrays live and every leaf, by name."""

    use_ocdbt: bool  # in one OCDBT database, or as plain zarr directories
    use_zarr3: bool
    fill_missing: bool  # chunks equal to the fill value were not written
    leaves: list[Leaf]


def parse_metadata(path: str, bad: Callable[[str], CheckpointFormatError]) -> OrbaxMetadata:
    """The `_METADATA` of the checkpoint directory `path`, validated whole (`bad`: the
    error of the checkpoint)."""
    metadata_path = os.path.join(path, METADATA_NAME)
    if not os.path.lexists(metadata_path):
        legacy = os.path.lexists(os.path.join(path, LEGACY_NAME))
        raise bad(
            f"it has no {METADATA_NAME} file"
            + (
                f" (its tree is in a '{LEGACY_NAME}' msgpack file: written by an orbax "
                "older than 0.5, which this reader does not read)"
                if legacy
                else ""
            )
        )

    def bad_metadata(why: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{metadata_path} is not valid Orbax metadata: {why}.")

    meta = read_json(metadata_path, "it", bad_metadata)
    tree = meta.get("tree_metadata") if isinstance(meta, dict) else None
    if not isinstance(tree, dict):
        raise bad_metadata("it is not a JSON object with a 'tree_metadata' object")
    flags = {}
    for flag in ("use_ocdbt", "use_zarr3", "store_array_data_equal_to_fill_value"):
        value = meta.get(flag)
        if value is not None and not isinstance(value, bool):
            raise bad_metadata(f"'{flag}' is {short(value)}, not true or false")
        flags[flag] = value
    # Older orbax did not record the layout: the database's manifest tells.
    use_ocdbt = (
        flags["use_ocdbt"]
        if flags["use_ocdbt"] is not None
        else os.path.lexists(os.path.join(path, OCDBT_MANIFEST))
    )
    use_zarr3 = bool(flags["use_zarr3"])
    fill_missing = not flags["store_array_data_equal_to_fill_value"]
    leaves: list[Leaf] = []
    for label, entry in tree.items():
        leaves.append(_leaf(label, entry, bad_metadata))
    # A container saved empty and later filled by a partial save leaves its empty
    # placeholder beside its children: the children win, as in orbax.
    leaves.sort(key=lambda leaf: leaf.keys)
    kept = [
        leaf
        # Each leaf with the next one (None after the last; nothing for no leaves).
        for leaf, following in zip(leaves, [*leaves[1:], None], strict=False)
        if following is None
        or not (
            len(following.keys) > len(leaf.keys) and following.keys[: len(leaf.keys)] == leaf.keys
        )
    ]
    names: set[str] = set()
    for leaf in kept:
        if leaf.name in names:
            raise bad_metadata(f"two leaves are both named {short(leaf.name)}")
        names.add(leaf.name)
    return OrbaxMetadata(use_ocdbt, use_zarr3, fill_missing, kept)


def unwrap_nnx(leaves: list[Leaf]) -> list[Leaf]:
    """`leaves` without NNX's `value` wrapper, when every leaf holding data is one: the
    state of an NNX module (`nnx.state(model)`) saves each `Variable` as a dict holding
    only `value`, so `conv1.kernel.value` is the tensor `conv1.kernel`. Any other tree is
    returned as it is."""
    holding = [leaf for leaf in leaves if leaf.value_type not in EMPTY]
    if not holding or not all(
        len(leaf.keys) > 1 and leaf.keys[-1] == "value" and leaf.kinds[-1] == DICT
        for leaf in holding
    ):
        return leaves
    wrapped = {leaf.keys[:-1] for leaf in holding}
    if any(leaf.keys[:-1] in wrapped for leaf in leaves if leaf.value_type in EMPTY):
        return leaves  # a Variable holding something beside its value: not NNX's
    return [
        Leaf(leaf.keys[:-1], leaf.kinds[:-1], leaf.value_type, leaf.skip, leaf.stored)
        if leaf.value_type not in EMPTY
        else leaf
        for leaf in leaves
    ]


def _leaf(label: str, entry: Any, bad: Any) -> Leaf:
    where = f"entry {short(label)}"
    if not isinstance(entry, dict):
        raise bad(f"{where} is not an object")
    key_metadata, value = entry.get("key_metadata"), entry.get("value_metadata")
    if not isinstance(key_metadata, list) or not key_metadata or not isinstance(value, dict):
        raise bad(f"{where} lacks a 'key_metadata' list or a 'value_metadata' object")
    if len(key_metadata) > MAX_DEPTH:
        # Rebuilding the tree recurses once a level: refuse what no real tree is.
        raise bad(f"{where} is nested {len(key_metadata)} levels deep, more than {MAX_DEPTH}")
    keys, kinds = [], []
    for key in key_metadata:
        if (
            not isinstance(key, dict)
            or not isinstance(key.get("key"), str)
            or key.get("key_type") not in (SEQUENCE, DICT)
        ):
            raise bad(f"{where} has a key that is not {{'key': str, 'key_type': 1 or 2}}")
        if key["key_type"] == SEQUENCE and not key["key"].isdecimal():
            raise bad(f"{where} has the sequence index {short(key['key'])}")
        keys.append(key["key"])
        kinds.append(key["key_type"])
    value_type, skip = value.get("value_type"), value.get("skip_deserialize", False)
    if not isinstance(value_type, str) or not isinstance(skip, bool):
        raise bad(f"{where} has no 'value_type' string")
    if value_type not in ARRAY_TYPES and value_type != "string" and value_type not in EMPTY:
        raise bad(
            f"{where} holds a {short(value_type)}, which has no standard Orbax "
            "handler (a custom TypeHandler wrote it)"
        )
    name = ".".join(keys)
    if value_type in ARRAY_TYPES and not skip:
        # Outside OCDBT a name is a path below the directory: never let it leave it.
        parts = name.split("/")
        if "\0" in name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise bad(f"{where} names the array {short(name)}, not a plain name")
    return Leaf(tuple(keys), tuple(kinds), value_type, skip)


def walk(top: str, bad: Callable[[str], CheckpointFormatError]) -> Iterator[tuple[str, list[str]]]:
    """Each directory below `top` once, through symbolic links too (a link back to a
    directory walked already is not followed again), with its files."""
    seen: set[tuple[int, int]] = set()

    def unlisted(error: OSError) -> None:
        # A directory that cannot be listed (searchable, not readable: a crafted
        # archive can set that) would hide its links from the checks, while
        # tensorstore still opens the files in it by name.
        raise bad(
            f"{error.filename} cannot be listed ({error.strerror}), so what it holds "
            "cannot be checked; make it readable"
        )

    for root, dirs, files in os.walk(top, followlinks=True, onerror=unlisted):
        info = os.stat(root)
        if (info.st_dev, info.st_ino) in seen:
            dirs[:] = []
            continue
        seen.add((info.st_dev, info.st_ino))
        yield root, files


def check_files(path: str, bad: Callable[[str], CheckpointFormatError]) -> None:
    """Refuses what tensorstore would block on (a FIFO, a device: its reads never end)
    or read whole into memory (an oversized manifest), and symbolic links that lead out
    of the checkpoint (their target's bytes would be read as array values), anywhere
    below the directory, through symbolic links too, before anything is opened."""
    inside = os.path.realpath(path)
    for root, files in walk(path, bad):
        for name in files:
            full = os.path.join(root, name)
            try:
                info = os.stat(full)
            except OSError:  # a dangling link: tensorstore's own error names it
                continue
            if not stat.S_ISREG(info.st_mode):
                raise bad(f"{full} is not a regular file (a FIFO or a device?)")
            real = os.path.realpath(full)
            if os.path.commonpath([real, inside]) != inside:
                raise bad(
                    f"{full} leads through a symbolic link to {real}, outside the "
                    "checkpoint directory; copy the file in instead of linking it"
                )
            if name == OCDBT_MANIFEST and info.st_size > _MAX_MANIFEST_BYTES:
                raise bad(f"{full} has {info.st_size} bytes, more than {_MAX_MANIFEST_BYTES}")
