"""Checkpoint files on disk: naming, listing in numeric order, retention, atomic writes."""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import uuid
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

import numpy as np

SUFFIX = ".safetensors"
SHARDED_SUFFIX = ".shards"  # a multi-process checkpoint: a directory of shard files + index
STEP_PATTERN = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
TEMP_MARK = ".tmp-"


def checkpoint_name(prefix: str, step: int | float) -> str:
    return f"{prefix}{step}{SUFFIX}"


def _pattern(prefix: str) -> re.Pattern[str]:
    suffixes = f"(?:{re.escape(SUFFIX)}|{re.escape(SHARDED_SUFFIX)})"
    return re.compile(rf"{re.escape(prefix)}(?P<step>{STEP_PATTERN}){suffixes}")


def list_checkpoints(ckpt_dir: str, prefix: str) -> list[tuple[Decimal, str, str]]:
    """`(numeric step, step text, path)` of every checkpoint file, oldest step first.

    Only names of the exact form `{prefix}{number}.safetensors` (or `.shards`, a multi-process
    checkpoint directory) count, so notes, temporary
    files and other prefixes in the same directory are ignored. The order is numeric (Decimal,
    exact for huge ints and for floats), never lexicographic.
    """
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return []
    pattern = _pattern(prefix)
    found = []
    for name in names:
        match = pattern.fullmatch(name)
        if match is None:
            continue
        text = match.group("step")
        try:
            value = Decimal(text)
        except InvalidOperation:  # pragma: no cover - the regex admits only numbers
            continue
        found.append((value, text, os.path.join(ckpt_dir, name)))
    found.sort(key=lambda entry: (entry[0], entry[1]))
    return found


def parse_step(text: str, step_type: Callable[[str], Any]) -> Any:
    if step_type is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(
                f"checkpoint step '{text}' is not an integer; pass step_type=float."
            ) from None
    return step_type(text)


Retention = Callable[[list[tuple[Decimal, str]]], list[str]]


def check_step(step: Any, caller: str) -> None:
    if isinstance(step, bool) or not isinstance(step, int | float | np.integer | np.floating):
        raise TypeError(f"{caller}: step must be an int or float, got {step!r}.")
    if not math.isfinite(step):
        raise ValueError(f"{caller}: step must be finite, got {step!r}.")


def check_keep(keep: Any, caller: str) -> None:
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"{caller}: keep must be an int >= 1, got {keep!r}.")


def check_newer(ckpt_dir: str, prefix: str, step: Any, overwrite: bool, caller: str) -> Decimal:
    """`step` as a Decimal; raises unless it is newer than every checkpoint or `overwrite`."""
    existing = list_checkpoints(ckpt_dir, prefix)
    new_value = Decimal(str(step))
    if existing and not overwrite and new_value <= existing[-1][0]:
        raise ValueError(
            f"{caller}: a checkpoint at step {existing[-1][1]} already exists in {ckpt_dir} "
            f"and step {step} is not newer. Pass overwrite=True to replace it (this also "
            "deletes every newer checkpoint)."
        )
    return new_value


def check_keep_every_n_steps(value: Any, caller: str) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int | float) or value <= 0
    ):
        raise ValueError(
            f"{caller}: keep_every_n_steps must be a positive number or None, got {value!r}."
        )


def steps_to_delete(
    steps: list[tuple[Decimal, str]],
    *,
    keep: int,
    keep_every_n_steps: int | float | None,
) -> list[str]:
    """flax's retention rule: which of `steps` (oldest first) to delete.

    The newest `keep` are kept. Walking the older ones from the oldest, a step is also kept
    when `keep_every_n_steps` is set and the step is at least that far past the last step kept
    this way (starting from -inf). As in flax, step 0 is never kept by that second rule.
    """
    if len(steps) <= keep:
        return []
    doomed = []
    last_kept = Decimal("-Infinity")
    for value, text in steps[: len(steps) - keep]:
        if keep_every_n_steps and value and value - last_kept >= Decimal(str(keep_every_n_steps)):
            last_kept = value
            continue
        doomed.append(text)
    return doomed


def flax_retention(keep: Any, keep_every_n_steps: Any, caller: str) -> Retention:
    """Validates `keep` / `keep_every_n_steps` and returns flax's retention rule for them."""
    check_keep(keep, caller)
    check_keep_every_n_steps(keep_every_n_steps, caller)

    def retention(steps: list[tuple[Decimal, str]]) -> list[str]:
        return steps_to_delete(steps, keep=keep, keep_every_n_steps=keep_every_n_steps)

    return retention


def apply_retention(
    ckpt_dir: str, prefix: str, new_value: Decimal, *, overwrite: bool, retention: Retention
) -> None:
    """After a commit: with `overwrite`, remove steps newer than the new one; then the steps
    `retention` names. Files and multi-process checkpoint directories alike."""
    listing = list_checkpoints(ckpt_dir, prefix)
    paths = {text: path for _, text, path in listing}
    steps = [(value, text) for value, text, _ in listing]
    doomed: list[str] = []
    if overwrite:
        doomed += [text for value, text in steps if value > new_value]
        steps = [(value, text) for value, text in steps if value <= new_value]
    doomed += retention(steps)
    remove_files([paths[text] for text in doomed])


def find_step(listing: list[tuple[Decimal, str, str]], step: Any) -> str | None:
    """The path of `step` in a `list_checkpoints` result (numeric match), or None."""
    wanted = Decimal(str(step))
    return next((path for value, _, path in listing if value == wanted), None)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path_for(final_path: str) -> str:
    """A unique temporary name next to `final_path` that never matches a checkpoint name."""
    directory, name = os.path.split(final_path)
    return os.path.join(directory, f".{name}{TEMP_MARK}{os.getpid()}-{uuid.uuid4().hex}")


_TEMP_FILE = re.compile(rf"\.(?P<name>.+){re.escape(TEMP_MARK)}(?P<pid>\d+)-[0-9a-f]{{32}}")


def leftover_temporaries(directory: str, prefix: str) -> list[tuple[str, int]]:
    """`(path, writer pid)` of every temporary file `temp_path_for` made for a checkpoint
    with this prefix in `directory` (and nothing else: other names never match)."""
    found = []
    final_name = _pattern(prefix)
    for name in os.listdir(directory):
        match = _TEMP_FILE.fullmatch(name)
        if match and final_name.fullmatch(match.group("name")):
            found.append((os.path.join(directory, name), int(match.group("pid"))))
    return found


def atomic_write(final_path: str, write: Callable[[int], None]) -> None:
    """Runs `write(fd)` on a temporary file, fsyncs it, renames it to `final_path`, fsyncs the
    directory. On any error the temporary file is removed and the previous files are untouched.
    """
    directory = os.path.dirname(final_path) or "."
    temp_path = temp_path_for(final_path)
    fd = os.open(temp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            write(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp_path, final_path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temp_path)
        raise
    fsync_dir(directory)


def remove_files(paths: list[str]) -> None:
    """Removes checkpoint files and multi-process checkpoint directories."""
    for path in paths:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            continue
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
