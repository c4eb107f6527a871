"""`eqx-train inspect` and `eqx-train verify`: what a checkpoint holds (headers only), and
whether every tensor still matches its checksum."""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from . import _progress
from ._cli_listing import key_lines, listing_lines
from ._cli_open import (
    CommandError,
    ForeignCheckpoint,
    flax_steps,
    one_line,
    open_one,
    open_path,
    show_progress,
    size_text,
    spec_text,
)
from ._progress import reporting
from ._text import short
from .checkpoints import engine
from .checkpoints.engine import CheckpointFormatError, IndexReader
from .interop import engine as interop


def _tree_lines(arrays: dict[str, tuple[tuple[int, ...], np.dtype]]) -> list[str]:
    """The dotted names as an indented tree, with each tensor's dtype, shape and size."""
    rows: list[tuple[str, str, str]] = []
    shown: set[tuple[str, ...]] = set()
    for name, (shape, dtype) in arrays.items():
        parts = tuple(name.split("."))
        for depth in range(1, len(parts)):
            if parts[:depth] not in shown:
                shown.add(parts[:depth])
                rows.append(("  " * (depth - 1) + parts[depth - 1], "", ""))
        nbytes = math.prod(shape) * dtype.itemsize
        rows.append(
            ("  " * (len(parts) - 1) + parts[-1], spec_text(shape, dtype), size_text(nbytes))
        )
    width = max((len(r[0]) for r in rows), default=0)
    spec_width = max((len(r[1]) for r in rows), default=0)
    return [f"  {a:<{width}}  {b:<{spec_width}}  {c}".rstrip() for a, b, c in rows]


def _prefix_lines(arrays: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> list[str]:
    """Every full dotted name, grouped under each of its prefixes with their tensor counts:
    the names a restore's `rename={target prefix: saved prefix}` is written with."""
    counts: dict[str, int] = {}
    for name in arrays:
        parts = name.split(".")
        for depth in range(1, len(parts)):
            prefix = ".".join(parts[:depth])
            counts[prefix] = counts.get(prefix, 0) + 1
    rows: list[tuple[str, str]] = []
    for name, (shape, dtype) in arrays.items():
        parts = name.split(".")
        for depth in range(1, len(parts)):
            prefix = ".".join(parts[:depth])
            count = counts.pop(prefix, None)  # a prefix's line comes once, before its names
            if count is not None:
                noun = "tensor" if count == 1 else "tensors"
                rows.append(("  " * (depth - 1) + prefix, f"{count} {noun}"))
        rows.append(("  " * (len(parts) - 1) + name, spec_text(shape, dtype)))
    width = max((len(a) for a, _ in rows), default=0)
    return [f"  {a:<{width}}  {b}" for a, b in rows]


def _metadata_lines(metadata: dict[str, str]) -> list[str]:
    lines = []
    step = metadata.get(engine.STEP_KEY)
    if step is not None:
        lines.append(f"step: {step}")
    for key, label in ((engine.METRICS_KEY, "metrics"), (engine.USER_METADATA_KEY, "metadata")):
        if key in metadata:
            lines.append(f"{label}: {metadata[key]}")
    foreign = {k: v for k, v in metadata.items() if not k.startswith(engine.OUR_KEY_PREFIX)}
    for key, value in foreign.items():
        lines.append(f"metadata {key}: {short(value, 200)}")
    return lines


def _tensor_lines(arrays: dict[str, tuple[tuple[int, ...], np.dtype]], tree: bool) -> list[str]:
    """The tensors as a tree of names, or with `--tree` every full name under its prefixes
    (the names `restore_checkpoint`'s `rename=` maps), after a line saying which."""
    if tree:
        return [
            "tensors by name prefix (restore_checkpoint's rename= maps these):",
            *_prefix_lines(arrays),
        ]
    return ["tensors:", *_tree_lines(arrays)]


def _inspect_orbax(path: str, what: str, tree: bool) -> None:
    print(f"{path}: {what}")
    kind, names = interop.orbax_layout(path)
    if kind == "run":
        for directory in names:
            print(f"  {os.path.basename(directory)}")
        path = names[-1]
        kind, names = interop.orbax_layout(path)
        print(f"latest: {path}, {interop.describe_orbax(path)}")
    shown = [(None, path)] if kind == "checkpoint" else [(n, os.path.join(path, n)) for n in names]
    for item, directory in shown:
        try:
            reader = interop.OrbaxReader(directory)
        except ImportError as error:
            print(f"(its arrays are listed once tensorstore is installed: {error})")
            return
        with reader:
            arrays = dict(reader.arrays())
        total = sum(math.prod(s) * d.itemsize for s, d in arrays.values())
        label = "" if item is None else f"item {item}: "
        print(f"{label}{len(arrays)} arrays, {size_text(total)}")
        for line in _tensor_lines(arrays, tree) if tree else _tree_lines(arrays):
            print(line)


def _inspect_foreign(error: ForeignCheckpoint, prefix: str, tree: bool) -> None:
    path = error.path
    if error.kind == "orbax":
        _inspect_orbax(path, error.what, tree)
        print(f"read it with: eqx-train convert-orbax {path} DST (or load_orbax_checkpoint)")
        return
    files = [path]
    if os.path.isdir(path):
        print(f"{path}: {error.what} (prefix '{prefix}')")
        listed = flax_steps(path, prefix)
        for file, step in listed:
            print(f"  step {step:<10} {os.path.basename(file)}")
        files = [listed[-1][0]] if tree else []  # --tree: the latest, as for our directories
    for file in files:
        arrays = interop.flax_arrays(file)
        total = sum(math.prod(s) * d.itemsize for s, d in arrays.values())
        label = "latest: " if file != path else ""
        print(f"{label}{file}: flax msgpack checkpoint, {len(arrays)} tensors, {size_text(total)}")
        for line in _tensor_lines(arrays, tree):
            print(line)
    print(f"convert it with: eqx-train convert-flax {path} DST (or load_flax_checkpoint)")


def run_inspect(args: argparse.Namespace) -> int:
    """`eqx-train inspect PATH`: prints what the checkpoint(s) at PATH hold; returns 0."""
    try:
        kind, reader = (open_one if args.tree else open_path)(args.path, args.prefix)
    except ForeignCheckpoint as foreign:
        _refuse_ranking(args, "an Orbax or flax checkpoint (no metrics to rank)")
        _inspect_foreign(foreign, args.prefix, args.tree)
        return 0
    if kind == "directory":
        print(f"{args.path}: directory of {len(reader)} checkpoints (prefix '{args.prefix}')")
        metadata_at = functools.partial(_metadata_at, prefix=args.prefix)
        with _counting(metadata_at, len(reader), show_progress(args)) as counted:
            lines = listing_lines(reader, counted, args.best_metric, args.mode or "min")
            for line in lines:
                print(line)
        return 0
    with reader:
        _refuse_ranking(args, "one checkpoint" + (" (--tree shows one)" if args.tree else ""))
        arrays = reader.arrays()
        total = sum(math.prod(s) * d.itemsize for s, d in arrays.values())
        print(f"{args.path}: {kind}, {len(arrays)} tensors, {size_text(total)}")
        for line in _metadata_lines(reader.metadata):
            print(line)
        if isinstance(reader, IndexReader):
            for path, shard in reader.files().items():
                size = sum(info.nbytes for info in shard.tensors.values())
                name = os.path.basename(path)
                print(f"file {name}: {len(shard.tensors)} tensors, {size_text(size)}")
        for line in _tensor_lines(arrays, args.tree):
            print(line)
        for line in key_lines(reader):
            print(line)
    return 0


@contextlib.contextmanager
def _counting(read: Callable[[str], Any], total: int, show: bool) -> Iterator[Callable[[str], Any]]:
    """`read`, counted on a bar of the checkpoints whose headers a listing has read (drawn
    once the listing has taken about a second: a directory of many remote checkpoints)."""
    if not show:
        yield read
        return
    from tqdm.auto import tqdm

    with tqdm(
        total=total, unit="ckpt", desc="headers", delay=_progress.BAR_DELAY_S,
        file=sys.stderr, leave=False,
    ) as bar:  # fmt: skip

        def counted(path: str) -> Any:
            try:
                return read(path)
            finally:
                bar.update(1)

        yield counted


def _refuse_ranking(args: argparse.Namespace, what: str) -> None:
    """Refuses `--best-metric`/`--mode` where there is no listing of checkpoints to rank."""
    flags = (("--best-metric", args.best_metric), ("--mode", args.mode))
    given = [flag for flag, value in flags if value is not None]
    if given:
        raise CommandError(
            f"{' and '.join(given)}: only a directory's listing of checkpoints is ranked, and "
            f"{args.path} is {what}; leave {'them' if len(given) > 1 else 'it'} out"
        )


def _metadata_at(path: str, prefix: str) -> dict[str, str]:
    """The metadata of the checkpoint at `path` (its header or index only)."""
    try:
        reader = open_path(path, prefix)[1]
    except CommandError as error:  # gone since it was listed
        raise OSError(str(error)) from None
    with reader:
        return reader.metadata


# ------------------------------------------------------------------------------ verify


def _verify_reader(reader: engine.Reader) -> Iterator[str]:
    """One line per problem; nothing when every tensor matches its checksum."""
    unchecked = []
    files = reader.files()
    _progress.expect(sum(i.nbytes for f in files.values() for i in f.tensors.values()))
    for path, file in files.items():
        if file.tensors and not any(info.checksum for info in file.tensors.values()):
            unchecked.append(path)
        for name, info in file.tensors.items():
            try:
                file.read(name, verify=True)
            except CheckpointFormatError as error:
                yield str(error)
            _progress.advance(info.nbytes)
    for path in unchecked:
        print(f"{path}: no checksums recorded (not written by eqx_train); structure checked only")


def run_verify(args: argparse.Namespace) -> int:
    """`eqx-train verify PATH`: checks every tensor against its checksum; returns 1 on any
    mismatch."""
    kind, reader = open_path(args.path, args.prefix)
    targets = [e.path for e in reader] if kind == "directory" else [args.path]
    show = show_progress(args)
    bad = 0
    for path in targets:
        try:
            opened = reader if kind != "directory" else open_path(path, args.prefix)[1]
        except (OSError, ValueError) as error:
            print(one_line(error), file=sys.stderr)
            bad += 1
            continue
        with opened, reporting(show, f"verify {os.path.basename(path.rstrip('/'))}"):
            problems = list(_verify_reader(opened))
        for line in problems:
            print(line, file=sys.stderr)
        bad += bool(problems)
        if not problems:
            print(f"{path}: ok")
    return 1 if bad else 0
