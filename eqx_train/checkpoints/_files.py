"""Checkpoints on disk: listing in numeric order, retention, atomic writes, removal of only
what this library wrote, and cleanup of what dead writers left. Every name comes from
`_names`."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from . import _format, _names


@dataclass(frozen=True)
class Entry:
    """One committed checkpoint in a directory."""

    value: Decimal  # the step, exact
    text: str  # the step as spelled in the name
    path: str
    sharded: bool

    @property
    def step(self) -> int | float:
        return _names.step_from_text(self.text)


def list_checkpoints(ckpt_dir: str, prefix: str) -> list[Entry]:
    """Every committed checkpoint of `prefix` in `ckpt_dir`, oldest step first.

    Counted: regular files `{prefix}{step}.safetensors` and directories
    `{prefix}{step}.shards` that hold their index. Anything else (notes, temporaries, other
    prefixes, a directory or FIFO under a checkpoint name) is ignored, and so never deleted.
    Among names of the same step (an older version spelled 1.0 what is now 1), the canonical
    spelling sorts last, so it is the one `[-1]` picks.
    """
    for _ in range(_LISTING_ATTEMPTS):
        try:
            found, vanished = _scan(ckpt_dir, prefix)
        except (FileNotFoundError, NotADirectoryError):
            return []
        if not vanished:
            break
        # A checkpoint was deleted while we looked (a concurrent save's retention): its
        # successor may be missing from this scan, so look again.
    found.sort(key=lambda e: (e.value, _names.is_canonical(e.text), e.sharded, e.text))
    return found


def _scan(ckpt_dir: str, prefix: str) -> tuple[list[Entry], bool]:
    pattern = _names.checkpoint_pattern(prefix)
    found, vanished = [], False
    for item in list(os.scandir(ckpt_dir)):
        match = pattern.fullmatch(item.name)
        if match is None:
            continue
        sharded = match["suffix"] == _names.SHARDED_SUFFIX
        target = os.path.join(item.path, _names.INDEX_NAME) if sharded else item.path
        try:
            mode = os.stat(target).st_mode
            committed = stat.S_ISREG(mode) and (not sharded or item.is_dir(follow_symlinks=False))
        except FileNotFoundError:
            vanished = vanished or not os.path.lexists(item.path)
            continue
        except OSError:
            continue
        if committed:
            text = match["step"]
            found.append(Entry(_names.step_value(text), text, item.path, sharded))
    return found, vanished


def latest(listing: list[Entry]) -> Entry | None:
    return listing[-1] if listing else None


def find_step(listing: list[Entry], value: Decimal) -> Entry | None:
    """The preferred entry of step `value`, or None."""
    matches = [e for e in listing if e.value == value]
    return matches[-1] if matches else None


_LISTING_ATTEMPTS = 5
Retention = Callable[[list[tuple[Decimal, str]]], list[str]]


def check_keep(keep: Any, caller: str) -> None:
    if isinstance(keep, bool) or not isinstance(keep, int):
        raise TypeError(f"{caller}: keep must be an int >= 1, got {keep!r}.")
    if keep < 1:
        raise ValueError(f"{caller}: keep must be an int >= 1, got {keep!r}.")


def check_newer(
    ckpt_dir: str, prefix: str, value: Decimal, text: str, overwrite: bool, caller: str
) -> None:
    """Raises unless step `value` (spelled `text`) is newer than every checkpoint, or
    `overwrite`."""
    newest = latest(list_checkpoints(ckpt_dir, prefix))
    if newest is not None and not overwrite and value <= newest.value:
        raise ValueError(
            f"{caller}: a checkpoint at step {newest.text} already exists in {ckpt_dir} "
            f"and step {text} is not newer. Pass overwrite=True to replace it (this also "
            "deletes every newer checkpoint)."
        )


def check_keep_every_n_steps(value: Any, caller: str) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int | float) or not value > 0
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
    ckpt_dir: str,
    prefix: str,
    new_value: Decimal,
    just_written: str,
    *,
    overwrite: bool,
    retention: Retention,
) -> None:
    """After a commit: with `overwrite`, remove steps newer than the new one; remove other
    spellings of the new step; then the steps `retention` names. The checkpoint this save
    just wrote is never removed by it."""
    listing = list_checkpoints(ckpt_dir, prefix)
    doomed = [e for e in listing if e.value == new_value and e.path != just_written]
    if overwrite:
        doomed += [e for e in listing if e.value > new_value]
    live = [e for e in listing if e not in doomed]
    preferred: dict[Decimal, Entry] = {}
    for e in live:
        preferred[e.value] = e  # the listing's order puts the preferred spelling last
    steps = [(e.value, e.text) for e in preferred.values()]
    by_text = {e.text: e.value for e in preferred.values()}
    values = {by_text[text] for text in retention(steps)}
    doomed += [e for e in live if e.value in values]
    for entry in doomed:
        if entry.path != just_written:
            remove_checkpoint(entry)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(final_path: str, write: Callable[[int], None], *, replace: bool = True) -> None:
    """Runs `write(fd)` on a temporary file, fsyncs it, moves it to `final_path`, fsyncs the
    directory. On any error the temporary file is removed and the previous files are untouched.

    With `replace=False` the move never clobbers: if `final_path` appeared meanwhile (a
    concurrent save of the same step), `FileExistsError` is raised and nothing is changed.
    """
    directory, name = os.path.split(final_path)
    temp_path = os.path.join(directory, _names.temp_name(name))
    fd = os.open(temp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            write(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace or not _link(temp_path, final_path):
            os.replace(temp_path, final_path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temp_path)
        raise
    fsync_dir(directory or ".")


def _link(temp_path: str, final_path: str) -> bool:
    """Moves `temp_path` to `final_path` unless it exists (then FileExistsError); False
    where the file system has no hard links, to fall back on a rename."""
    try:
        os.link(temp_path, final_path)
    except FileExistsError:
        raise
    except OSError:
        return False
    os.remove(temp_path)
    return True


def _remove(path: str) -> None:
    # Best effort: a name we cannot remove (a directory, another user's file) is left, and
    # never stops a save.
    with contextlib.suppress(OSError):
        os.remove(path)


def remove_paths(paths: list[str]) -> None:
    for path in paths:
        _remove(path)


def remove_if_uncommitted_and_empty(path: str) -> None:
    if not os.path.exists(os.path.join(path, _names.INDEX_NAME)):
        with contextlib.suppress(OSError):
            os.rmdir(path)


def remove_checkpoint(entry: Entry) -> None:
    """Deletes a checkpoint: a file, or a `.shards` directory's index (which uncommits it
    first), then the files this library names there. A directory that still holds other
    files afterwards is left in place."""
    if not entry.sharded:
        _remove(entry.path)
        return
    cited = referenced_pieces(entry.path) or set()
    _remove(os.path.join(entry.path, _names.INDEX_NAME))
    # Only the pieces the removed index cited: a concurrent save's new pieces are not ours.
    remove_paths([os.path.join(entry.path, name) for name in sorted(cited)])
    clean_shards_dir(entry.path, keep_token=None)


def remove_leftovers(
    ckpt_dir: str, prefix: str, *, keep_token: str | None = None, current: str | None = None
) -> None:
    """Removes what dead writers of `prefix` left in `ckpt_dir`: temporary files of killed
    saves, and in `.shards` directories the pieces, markers and temporaries of saves that
    never committed (or were superseded). Only names this library makes, and only when the
    writer ran on this machine and its process is gone. `current` (the `.shards` directory
    a multi-process save is about to fill) is never removed, even while still empty."""
    pattern = _names.checkpoint_pattern(prefix)
    try:
        scan = list(os.scandir(ckpt_dir))
    except FileNotFoundError:
        return
    for item in scan:
        temp = _names.parse_temp(item.name)
        if temp is not None:
            final, host, pid = temp
            if pattern.fullmatch(final) and _names.writer_is_dead(host, pid):
                _remove(item.path)
            continue
        match = pattern.fullmatch(item.name)
        if (
            match
            and match["suffix"] == _names.SHARDED_SUFFIX
            and item.is_dir(follow_symlinks=False)
            and item.path != current
        ):
            clean_shards_dir(item.path, keep_token=keep_token)


def referenced_pieces(path: str) -> set[str] | None:
    """The piece files a committed `.shards` directory's index cites; None if it has no
    index; every name in the directory if the index cannot be read (then nothing goes)."""
    index = os.path.join(path, _names.INDEX_NAME)
    if not os.path.exists(index):
        return None
    try:
        with _format.FileReader(index) as reader:
            arrays = json.loads(reader.metadata[_format.ARRAYS_KEY])
        return {piece["file"] for entry in arrays.values() for piece in entry["pieces"]}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        try:
            return set(os.listdir(path))
        except OSError:
            return set()


def clean_shards_dir(path: str, *, keep_token: str | None) -> None:
    """In one `.shards` directory, removes the pieces and markers of saves other than
    `keep_token` that the index does not cite and whose writer is dead, and temporaries of
    dead writers. Removes the directory if it ends up empty and uncommitted."""
    try:
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    protected = referenced_pieces(path) or set()
    for name in names:
        parsed = _names.parse_piece_file(name) or _names.parse_done_marker(name)
        if parsed is not None:
            token = parsed[1]
            if token and token != keep_token and name not in protected:
                if _names.writer_is_dead(*_names.token_writer(token)):
                    _remove(os.path.join(path, name))
            continue
        temp = _names.parse_temp(name)
        if temp is not None and _names.writer_is_dead(temp[1], temp[2]):
            _remove(os.path.join(path, name))
    remove_if_uncommitted_and_empty(path)


def remove_replaced_pieces(path: str, replaced: set[str], keep: set[str]) -> None:
    """After process 0 commits an overwrite: the pieces the replaced index cited go, and no
    others (a concurrent save's pieces belong to it)."""
    remove_paths([os.path.join(path, name) for name in sorted(replaced - keep)])
