"""`python -m eqx_train` / `eqx-train`: look inside checkpoints, check them, compare them,
and convert flax checkpoints, from the shell.

`inspect`, `verify` and `diff` read through the library's own readers (headers first, data
only when asked) and never start a JAX backend: they work on a login node with no
accelerator and start fast. Errors are one line on stderr naming the file, exit status 1
(2 for a malformed command line, as argparse does).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ._cli_listing import key_lines, listing_lines
from ._close import close
from .checkpoints import engine
from .checkpoints.engine import CheckpointFormatError, FileReader, IndexReader, short
from .interop import engine as interop

_LOCAL = engine.LocalStorage()


class CommandError(Exception):
    """A failure to report as one line on stderr, exit status 1."""


class ForeignCheckpoint(CommandError):
    """The path is a checkpoint eqx_train reads through a converter (an Orbax directory, flax
    msgpack files), not one of its own: `inspect` shows it, other commands say how to read
    it."""

    def __init__(self, path: str, kind: str, what: str):
        self.path, self.kind, self.what = path, kind, what
        if kind == "orbax":
            how = (
                f"read it with `eqx-train convert-orbax {path} DST` or "
                "eqx_train.interop.load_orbax_checkpoint"
            )
        else:
            how = (
                f"convert it with `eqx-train convert-flax {path} DST` or read it with "
                "eqx_train.interop.load_flax_checkpoint"
            )
        super().__init__(f"{path} is {what}, not an eqx_train checkpoint; {how}")


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes} B" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")  # pragma: no cover


def _spec(shape: Sequence[int], dtype: np.dtype) -> str:
    return f"{dtype}[{', '.join(str(d) for d in shape)}]"


# ------------------------------------------------------------------------------ readers


def _open(path: str, prefix: str) -> tuple[str, Any]:
    """(what the path is, its reader) for a file, a `.shards` checkpoint or a Hugging Face
    directory; ("directory", listing) for a directory of checkpoints."""
    found = engine.locate(_LOCAL, path) if os.path.lexists(path) else None
    if found is None:
        raise CommandError(f"{path}: no such file or directory")
    if found.layout != "directory":
        try:
            reader = engine.open_reader(_LOCAL, found)
        except engine.ForeignCheckpointError as error:
            if error.kind == "flax":
                raise ForeignCheckpoint(path, "flax", "a flax msgpack checkpoint") from None
            raise
        if found.layout == "file":
            return "single file", reader
        if found.layout == "shards":
            return ".shards checkpoint", reader
        count = "1 file" if isinstance(reader, FileReader) else f"{len(reader.files())} shards"
        return f"Hugging Face layout, {count}", reader
    listing = engine.list_checkpoints(_LOCAL, path, prefix)
    if not listing:
        _refuse_foreign_directory(path, prefix)
        raise CommandError(
            f"{path}: a directory with no checkpoint in it (no {prefix}<step>.safetensors, "
            f"{prefix}<step>.shards, {engine.HF_SINGLE_NAME} or {engine.HF_INDEX_NAME})"
        )
    return "directory", listing


def _refuse_foreign_directory(path: str, prefix: str) -> None:
    """Raises `ForeignCheckpoint` for an Orbax directory or a directory of flax files."""
    what = interop.describe_orbax(path)
    if what is not None:
        raise ForeignCheckpoint(path, "orbax", what)
    try:
        flax_files = _flax_steps(path, prefix)
    except CommandError:
        return
    raise ForeignCheckpoint(
        path, "flax", f"a directory of {len(flax_files)} flax msgpack checkpoints"
    )


def _open_one(path: str, prefix: str) -> tuple[str, Any]:
    """As `_open`, a directory of checkpoints standing for its latest one."""
    kind, reader = _open(path, prefix)
    if kind == "directory":
        return _open(reader[-1].path, prefix)
    return kind, reader


# ------------------------------------------------------------------------------ inspect


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
        rows.append(("  " * (len(parts) - 1) + parts[-1], _spec(shape, dtype), _size(nbytes)))
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
        rows.append(("  " * (len(parts) - 1) + name, _spec(shape, dtype)))
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


def _inspect_orbax(path: str, what: str) -> None:
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
        print(f"{label}{len(arrays)} arrays, {_size(total)}")
        for line in _tree_lines(arrays):
            print(line)


def _inspect_foreign(error: ForeignCheckpoint, prefix: str) -> None:
    path = error.path
    if error.kind == "orbax":
        _inspect_orbax(path, error.what)
        print(f"read it with: eqx-train convert-orbax {path} DST (or load_orbax_checkpoint)")
        return
    if os.path.isdir(path):
        print(f"{path}: {error.what} (prefix '{prefix}')")
        for file, step in _flax_steps(path, prefix):
            print(f"  step {step:<10} {os.path.basename(file)}")
    else:
        arrays = interop.flax_arrays(path)
        total = sum(math.prod(s) * d.itemsize for s, d in arrays.values())
        print(f"{path}: flax msgpack checkpoint, {len(arrays)} tensors, {_size(total)}")
        print("tensors:")
        for line in _tree_lines(arrays):
            print(line)
    print(f"convert it with: eqx-train convert-flax {path} DST (or load_flax_checkpoint)")


def _inspect(args: argparse.Namespace) -> int:
    try:
        kind, reader = (_open_one if args.tree else _open)(args.path, args.prefix)
    except ForeignCheckpoint as foreign:
        _inspect_foreign(foreign, args.prefix)
        return 0
    if kind == "directory":
        print(f"{args.path}: directory of {len(reader)} checkpoints (prefix '{args.prefix}')")
        metadata_at = functools.partial(_metadata_at, prefix=args.prefix)
        for line in listing_lines(reader, metadata_at, args.best_metric, args.mode):
            print(line)
        return 0
    with reader:
        arrays = reader.arrays()
        total = sum(math.prod(s) * d.itemsize for s, d in arrays.values())
        print(f"{args.path}: {kind}, {len(arrays)} tensors, {_size(total)}")
        for line in _metadata_lines(reader.metadata):
            print(line)
        if isinstance(reader, IndexReader):
            for path, shard in reader.files().items():
                size = sum(info.nbytes for info in shard.tensors.values())
                print(f"file {os.path.basename(path)}: {len(shard.tensors)} tensors, {_size(size)}")
        if args.tree:  # full names under their prefixes, to write a rename= from
            print("tensors by name prefix (restore_checkpoint's rename= maps these):")
        else:
            print("tensors:")
        for line in _prefix_lines(arrays) if args.tree else _tree_lines(arrays):
            print(line)
        for line in key_lines(reader):
            print(line)
    return 0


def _metadata_at(path: str, prefix: str) -> dict[str, str]:
    """The metadata of the checkpoint at `path` (its header or index only)."""
    try:
        reader = _open(path, prefix)[1]
    except CommandError as error:  # gone since it was listed
        raise OSError(str(error)) from None
    with reader:
        return reader.metadata


# ------------------------------------------------------------------------------ verify


def _verify_reader(reader: engine.Reader) -> Iterator[str]:
    """One line per problem; nothing when every tensor matches its checksum."""
    unchecked = []
    for path, file in reader.files().items():
        if file.tensors and not any(info.checksum for info in file.tensors.values()):
            unchecked.append(path)
        for name in file.tensors:
            try:
                file.read(name, verify=True)
            except CheckpointFormatError as error:
                yield str(error)
    for path in unchecked:
        print(f"{path}: no checksums recorded (not written by eqx_train); structure checked only")


def _verify(args: argparse.Namespace) -> int:
    kind, reader = _open(args.path, args.prefix)
    targets = [e.path for e in reader] if kind == "directory" else [args.path]
    bad = 0
    for path in targets:
        try:
            opened = reader if kind != "directory" else _open(path, args.prefix)[1]
        except (OSError, ValueError) as error:
            print(_one_line(error), file=sys.stderr)
            bad += 1
            continue
        with opened:
            problems = list(_verify_reader(opened))
        for line in problems:
            print(line, file=sys.stderr)
        bad += bool(problems)
        if not problems:
            print(f"{path}: ok")
    return 1 if bad else 0


# ------------------------------------------------------------------------------ diff


def _parts(x: np.ndarray) -> np.ndarray:
    """A float array as `(..., 1)`; a complex one as its real and imaginary parts, `(..., 2)`."""
    if x.dtype.kind != "c":
        return x.reshape(*x.shape, 1)
    part = np.dtype(f"f{x.dtype.itemsize // 2}")
    return np.ascontiguousarray(x).reshape(-1).view(part).reshape(*x.shape, 2)


def _difference(
    a: np.ndarray, b: np.ndarray, atol: float = 0.0, rtol: float = 0.0
) -> tuple[int, float]:
    """(number of differing elements, max |a - b| among them).

    Without a tolerance, floats compare by their bits (-0.0 differs from 0.0), except that
    NaN equals NaN (for a complex, each of its parts so). With `atol`/`rtol`, a float element
    differs only when `|a - b| > atol + rtol * |b|`, as `numpy.isclose` (NaN still equals
    NaN; an infinity equals only itself). Integers and booleans always compare exactly, and
    their gap is exact (a float64 would round away a difference of 1 between int64s near
    2**62)."""
    if a.dtype.kind in "biu":
        differs = a != b
        count = int(np.count_nonzero(differs))
        if not count:
            return 0, 0.0
        if a.dtype.kind == "b":
            return count, 1.0
        # The true gap of two 64-bit integers is below 2**64: modulo 2**64 it is exact.
        high = np.maximum(a[differs], b[differs]).astype(np.uint64)
        low = np.minimum(a[differs], b[differs]).astype(np.uint64)
        return count, float(int((high - low).max()))
    wide = np.complex128 if a.dtype.kind == "c" else np.float64
    wide_a, wide_b = a.astype(wide), b.astype(wide)
    # Each part of a complex on its own: NaN in one part does not hide the other part.
    nan_a, nan_b = np.isnan(_parts(wide_a)), np.isnan(_parts(wide_b))
    # inf - inf is NaN and 1.7e308 - -1.7e308 overflows to inf: both are meant.
    with np.errstate(invalid="ignore", over="ignore"):
        if atol or rtol:
            differs = ~close(wide_a, wide_b, rtol, atol)
        else:
            part_a, part_b = _parts(a), _parts(b)
            size = part_a.dtype.itemsize
            bits_a = part_a.reshape(-1).view(np.uint8).reshape(*part_a.shape, size)
            bits_b = part_b.reshape(-1).view(np.uint8).reshape(*part_b.shape, size)
            differs = ((bits_a != bits_b).any(axis=-1) & ~(nan_a & nan_b)).any(axis=-1)
        count = int(np.count_nonzero(differs))
        if not count:
            return 0, 0.0
        gap = np.abs(wide_a[differs] - wide_b[differs])
    return count, math.nan if np.isnan(gap).all() else float(np.nanmax(gap))


def _diff(args: argparse.Namespace) -> int:
    tolerant = bool(args.atol or args.rtol)
    limits = f"atol={args.atol:g}, rtol={args.rtol:g}"
    beyond = f" beyond {limits}" if tolerant else ""
    _, a = _open_one(args.a, args.prefix)
    with a:
        _, b = _open_one(args.b, args.prefix)
        with b:
            arrays_a, arrays_b = a.arrays(), b.arrays()
            lines = []
            for name, (shape, dtype) in arrays_a.items():
                if name not in arrays_b:
                    lines.append(f"only in A: {name} {_spec(shape, dtype)}")
            for name, (shape, dtype) in arrays_b.items():
                if name not in arrays_a:
                    lines.append(f"only in B: {name} {_spec(shape, dtype)}")
            same = 0
            for name, (shape, dtype) in arrays_a.items():
                if name not in arrays_b:
                    continue
                other = arrays_b[name]
                if (shape, dtype) != other:
                    lines.append(f"differs: {name} A {_spec(shape, dtype)}, B {_spec(*other)}")
                    continue
                va, vb = a.read(name), b.read(name)
                count, gap = _difference(va, vb, args.atol, args.rtol)
                if count:
                    lines.append(
                        f"differs: {name} {_spec(shape, dtype)}: {count} of {va.size} elements"
                        f"{beyond}, max abs diff {gap:.6g}"
                    )
                else:
                    same += 1
    for line in lines:
        print(line)
    total = len(set(arrays_a) | set(arrays_b))
    if tolerant:
        print(
            f"{same} of {total} tensors equal within {limits}"
            + ("" if lines else "; A and B match")
        )
    else:
        print(f"{same} of {total} tensors identical" + ("" if lines else "; A and B are identical"))
    return 1 if lines else 0


# ------------------------------------------------------------------------------ convert-flax


def _flax_steps(src: str, prefix: str) -> list[tuple[str, int | float]]:
    """(file, step) of the flax checkpoints a path stands for, oldest first."""
    pattern = re.compile(re.escape(prefix) + r"(\d+(?:\.\d+)?)")
    if not os.path.lexists(src):
        raise CommandError(f"{src}: no such file or directory")
    if not os.path.isdir(src):
        match = pattern.fullmatch(os.path.basename(src))
        return [(src, engine.step_from_text(match[1]) if match else 0)]
    found = []
    for entry in os.listdir(src):
        match = pattern.fullmatch(entry)
        if match and os.path.isfile(os.path.join(src, entry)):
            found.append((os.path.join(src, entry), engine.step_from_text(match[1])))
    if not found:
        what = interop.describe_orbax(src)
        if what is not None:
            raise ForeignCheckpoint(src, "orbax", what)
        raise CommandError(f"{src}: no flax checkpoint ({prefix}<step> file) in this directory")
    found.sort(key=lambda item: item[1])
    for (first, step), (second, other) in zip(found, found[1:], strict=False):
        if step == other:  # checkpoint_1 and checkpoint_01: refuse before writing anything
            raise CommandError(f"{first} and {second} are both step {step}; keep one of them")
    return found


def _convert_flax(args: argparse.Namespace) -> int:
    from .interop import load_flax_checkpoint

    found = [(step, path) for path, step in _flax_steps(args.src, args.prefix)]
    return _convert_each(found, load_flax_checkpoint, args)


def _convert_each(
    found: list[tuple[Any, str]], load: Callable[[str], Any], args: argparse.Namespace
) -> int:
    """Loads each `(step, source)` in turn and saves it into DST as that step."""
    from .checkpoints import save_checkpoint

    for step, source in found:
        try:
            tree = load(source)
            # Retention off: converting must never delete what DST already holds.
            written = save_checkpoint(args.dst, tree, step, prefix=args.prefix, keep=2**62)
        except (CheckpointFormatError, CommandError):
            raise
        except (OSError, ValueError, TypeError) as error:
            raise CommandError(f"{source}: {_one_line(error)}") from error
        print(f"{source} -> {written}")
    return 0


# ------------------------------------------------------------------------------ convert-orbax


def _convert_orbax(args: argparse.Namespace) -> int:
    from .checkpoints import available_steps
    from .interop import load_orbax_checkpoint

    if not os.path.lexists(args.src):
        raise CommandError(f"{args.src}: no such file or directory")
    found = interop.orbax_steps_to_convert(args.src, args.item)
    held = (
        available_steps(args.dst, args.prefix, step_type=float) if os.path.isdir(args.dst) else []
    )
    if held and found[0][0] <= held[-1]:
        # Checkpoints are added in step order: refuse before writing anything.
        raise CommandError(
            f"{args.dst} already holds step {held[-1]:g}; the steps to convert "
            f"({', '.join(str(step) for step, _ in found)}) must all be newer (resuming an "
            "interrupted conversion? its finished steps are valid: convert into a new DST "
            "and move them over, or pass the remaining step directories one by one)"
        )
    return _convert_each(found, load_orbax_checkpoint, args)


# ------------------------------------------------------------------------------ main


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eqx-train",
        description="Look inside, check, compare and convert eqx_train checkpoints.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        sub.add_argument(
            "--prefix",
            default="checkpoint_",
            help="checkpoint file name prefix in directories (default: checkpoint_)",
        )
        return sub

    sub = command(
        "inspect",
        "Show a checkpoint's step, metrics, metadata and tensors (reads headers only); "
        "for a directory of checkpoints, list them.",
    )
    sub.add_argument("path", help="a checkpoint file, .shards or Hugging Face directory")
    sub.add_argument(
        "--tree",
        action="store_true",
        help="list every full dotted name under each of its prefixes, with tensor counts "
        "(the names restore_checkpoint's rename= takes); a directory shows its latest",
    )
    sub.add_argument(
        "--best-metric",
        help="for a directory: the metric that ranks checkpoints, as CheckpointManager's "
        "best_metric (default: the only metric the checkpoints hold)",
    )
    sub.add_argument(
        "--mode",
        choices=("min", "max"),
        default="min",
        help="for a directory: whether lower (min, the default) or higher metrics are better",
    )
    sub.set_defaults(run=_inspect)
    sub = command("verify", "Check every tensor against its checksum; exit 1 on any mismatch.")
    sub.add_argument("path", help="a checkpoint, or a directory of checkpoints (all checked)")
    sub.set_defaults(run=_verify)
    sub = command("diff", "Compare two checkpoints tensor by tensor; exit 1 if they differ.")
    sub.add_argument("a", help="first checkpoint (a directory: its latest)")
    sub.add_argument("b", help="second checkpoint (a directory: its latest)")
    for name, text in (("atol", "absolute"), ("rtol", "relative, times |B|")):
        sub.add_argument(
            f"--{name}",
            type=_tolerance,
            default=0.0,
            help=f"{text} tolerance for float and complex tensors: elements with "
            "|A - B| <= atol + rtol * |B| count as equal (default 0: compare bits); "
            "integers and booleans always compare exactly",
        )
    sub.set_defaults(run=_diff)
    sub = command(
        "convert-flax",
        "Convert flax msgpack checkpoints (one file, or a directory of <prefix><step> "
        "files) to eqx_train checkpoints in DST, keeping their steps.",
    )
    sub.add_argument("src", help="a flax checkpoint file or directory")
    sub.add_argument("dst", help="the eqx_train checkpoint directory to write")
    sub.set_defaults(run=_convert_flax)
    sub = command(
        "convert-orbax",
        "Convert Orbax checkpoints (flax's default checkpoint_<step>/ directories, orbax "
        "CheckpointManager steps, or a directory of them: every step) to eqx_train "
        "checkpoints in DST, keeping their steps; nothing in DST is deleted.",
    )
    sub.add_argument("src", help="an Orbax checkpoint, CheckpointManager step, or run directory")
    sub.add_argument("dst", help="the eqx_train checkpoint directory to write")
    sub.add_argument(
        "--item", help="the CheckpointManager item to convert (when there are several)"
    )
    sub.set_defaults(run=_convert_orbax)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except (
        CommandError,
        OSError,
        ValueError,
        TypeError,
        NotImplementedError,
        ImportError,
    ) as error:
        print(f"eqx-train {args.command}: {_one_line(error)}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
