"""What the command line's commands share: its errors, opening a path as a checkpoint (a file,
a `.shards` or Hugging Face directory, a directory of checkpoints, or a foreign one to
refuse by name), and how sizes and tensors are written."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from .checkpoints import engine
from .checkpoints.engine import FileReader
from .interop import engine as interop

LOCAL = engine.LocalStorage()


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


def show_progress(args: Any) -> bool:
    """Whether a command draws progress bars: `--progress`/`--no-progress`, else when stderr
    is a terminal (and tqdm is installed)."""
    wanted = args.progress if args.progress is not None else sys.stderr.isatty()
    if not wanted:
        return False
    try:
        import tqdm  # noqa: F401
    except ImportError:
        if args.progress:
            raise CommandError("--progress draws a tqdm bar: pip install tqdm") from None
        return False
    return True


def one_line(error: BaseException) -> str:
    """An error's message on one line (its type's name when it has none)."""
    return " ".join(str(error).split()) or type(error).__name__


def size_text(nbytes: int) -> str:
    """`nbytes` for a person: `512 B`, `1.5 MiB`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes} B" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")  # pragma: no cover


def spec_text(shape: Sequence[int], dtype: np.dtype) -> str:
    """A tensor's dtype and shape as `float32[2, 3]`."""
    return f"{dtype}[{', '.join(str(d) for d in shape)}]"


# ------------------------------------------------------------------------------ readers


def open_path(path: str, prefix: str) -> tuple[str, Any]:
    """(what the path is, its reader) for a file, a `.shards` checkpoint or a Hugging Face
    directory; ("directory", listing) for a directory of checkpoints."""
    found = engine.locate(LOCAL, path) if os.path.lexists(path) else None
    if found is None:
        raise CommandError(f"{path}: no such file or directory")
    if found.layout != "directory":
        try:
            reader = engine.open_reader(LOCAL, found)
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
    listing = engine.list_checkpoints(LOCAL, path, prefix)
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
        flax_files = flax_steps(path, prefix)
    except CommandError:
        return
    raise ForeignCheckpoint(
        path, "flax", f"a directory of {len(flax_files)} flax msgpack checkpoints"
    )


def open_one(path: str, prefix: str) -> tuple[str, Any]:
    """As `open_path`, a directory of checkpoints standing for its latest one."""
    kind, reader = open_path(path, prefix)
    if kind == "directory":
        return open_path(reader[-1].path, prefix)
    return kind, reader


def flax_steps(src: str, prefix: str) -> list[tuple[str, Any]]:
    """(file, step) of the flax checkpoints a path stands for, oldest first; the step of a
    file whose name holds none (not `<prefix><step>`) is None."""
    pattern = re.compile(re.escape(prefix) + r"(\d+(?:\.\d+)?)")
    if not os.path.lexists(src):
        raise CommandError(f"{src}: no such file or directory")
    if not os.path.isdir(src):
        match = pattern.fullmatch(os.path.basename(src))
        return [(src, engine.step_from_text(match[1]) if match else None)]
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
