"""Restoring a manager's newest checkpoint that verifies: a corrupt latest checkpoint
(truncated, a failed checksum, a missing piece) is skipped with a warning naming it, and
the processes of a multi-process job skip the same ones."""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import jax

from ..._calls import call, outside_stacklevel
from .._errors import (
    UNREADABLE_ERRNOS,
    CheckpointFormatError,
    NewerFormatError,
    UnreadableCheckpointWarning,
)
from ..format import _names
from ..pipeline import _coordination, _directory
from ..storage._base import Storage

T = TypeVar("T")


def restore_latest_that_verifies(
    store: Storage,
    directory: str,
    list_checkpoints: Callable[[], list[_directory.Entry]],
    restore: Callable[[_directory.Entry], T],
    target: T,
    *,
    timeout_s: int | float,
    attempts: int,
) -> T:
    """What `restore(entry)` returns for the newest checkpoint in `directory` that
    restores without a `CheckpointFormatError`, warning for each one skipped; `target`
    when there is none. `list_checkpoints` lists the directory again (up to `attempts`
    times) when a checkpoint vanishes (retention). The processes of a multi-process job
    decide together, each waiting at most `timeout_s` for the others."""
    who = call("CheckpointManager.restore")
    skipped: dict[str, Exception] = {}
    tried: dict[str, tuple[_directory.Entry, Any]] = {}
    multiprocess = jax.process_count() > 1
    relists = 0
    listing = _directory.preferred(list_checkpoints())
    while True:
        candidates = [e for e in reversed(listing) if e.path not in skipped]
        if not candidates:
            if skipped:
                listed = "; ".join(f"{p}: {e}" for p, e in skipped.items())
                raise CheckpointFormatError(
                    f"{who}: no checkpoint in {directory} verifies: {listed}"
                )
            return target
        entry = candidates[0]
        outcome, restored, failure = "ok", target, None
        try:
            restored = restore(entry)
        except NewerFormatError:
            raise  # not corrupt: never skipped, and never moved aside
        except CheckpointFormatError as error:
            skipped[entry.path] = error
            outcome = f"corrupt: {error}"
        except FileNotFoundError:
            outcome = "gone"
        except Exception as error:
            if (
                isinstance(error, OSError)
                and error.errno in UNREADABLE_ERRNOS
                and store.os_errors_mean_bad_media
            ):
                # A disk read error is what a fallback is for, as corruption is. (On an
                # object store an OSError says nothing about the checkpoint: a network
                # error must never make it skipped and moved away.)
                skipped[entry.path] = error
                outcome = f"corrupt: {error}"
            elif not multiprocess:  # e.g. a target mismatch: no fallback
                raise
            else:
                failure, outcome = error, f"failed: {type(error).__name__}: {error}"
        # The version found unreadable: only that one may be moved aside later.
        tried[entry.path] = (entry, _version(store, entry) if entry.path in skipped else None)
        if multiprocess:
            outcome = _agree(store, entry, outcome, failure, skipped, tried, timeout_s)
        if outcome == "ok":
            moved = _quarantine(store, directory, [tried[p] for p in skipped], timeout_s)
            for path, error in skipped.items():
                warnings.warn(
                    f"{who}: skipped the corrupt checkpoint {path} ({error}); restored "
                    f"step {entry.text} from {entry.path} instead. {moved[path]} Pass "
                    "fallback=False to raise instead.",
                    UnreadableCheckpointWarning,
                    stacklevel=outside_stacklevel(sys._getframe()),
                )
            return restored
        if outcome == "gone":
            relists += 1
            if relists == attempts:
                raise FileNotFoundError(
                    f"{who}: the checkpoints of {directory} kept changing while "
                    f"being restored ({entry.path} vanished)"
                )
            listing = _directory.preferred(list_checkpoints())


def _agree(
    store: Storage,
    entry: _directory.Entry,
    outcome: str,
    failure: Exception | None,
    skipped: dict[str, Exception],
    tried: dict[str, tuple[_directory.Entry, Any]],
    timeout_s: int | float,
) -> str:
    """The outcome of restoring `entry` that every process of the job agrees on, from this
    process's own (`outcome`, and the error it failed with, if any): each process reads
    only its devices' pieces, so a corruption one of them sees makes every one skip that
    checkpoint (`skipped`, `tried` updated to match); "gone" when the processes listed
    different checkpoints or one raced retention. Raises when a process failed otherwise."""
    who = call("CheckpointManager.restore")
    seen = _coordination.gather(
        _coordination.next_id("restore_fallback"),
        json.dumps([entry.path, outcome]),
        timeout_s=timeout_s,
    )
    reports = [json.loads(r) for r in seen]
    failed = [(i, o) for i, (_, o) in enumerate(reports) if o.startswith("failed")]
    if failure is not None:
        raise failure
    if failed:
        raise RuntimeError(
            f"{who}: process {failed[0][0]} could not restore {entry.path} "
            f"({failed[0][1].removeprefix('failed: ')})."
        )
    if any(path != entry.path or o == "gone" for path, o in reports):
        # Skipped only when all agree it is corrupt, so that every process's next
        # candidate stays the same.
        skipped.pop(entry.path, None)
        return "gone"
    bad = [o for _, o in reports if o != "ok"]
    if bad and outcome == "ok":
        tried[entry.path] = (entry, _version(store, entry))
        skipped[entry.path] = CheckpointFormatError(
            f"{entry.path}: another process found it {bad[0]}"
        )
        return bad[0]
    return outcome


def _version(store: Storage, entry: _directory.Entry) -> Any:
    """What tells one version of the checkpoint `entry` from another saved under its name
    (the file's, or a `.shards` index's, identity), or None if it is gone."""
    path = store.join(entry.path, _names.INDEX_NAME) if entry.sharded else entry.path
    try:
        return store.version(path)
    except OSError:
        return None


def _check_moved(store: Storage, entry: _directory.Entry, new_path: str, version: Any) -> str:
    """What to say of `entry`, just moved to `new_path`. Locally a rename keeps a file's
    identity, so a save of the same step that replaced the unreadable one between the
    check and the move shows here: it is put back under its name (unless yet another save
    took the name meanwhile)."""
    moved = dataclasses.replace(entry, path=new_path)
    if not store.atomic_rename or _version(store, moved) == version:
        return (
            f"It was moved to {new_path}, which no listing counts, so that saving its step "
            "again works; delete it once inspected."
        )
    try:
        store.move(new_path, entry.path)
    except OSError as error:
        return (
            f"A save of its step replaced it just before it was moved aside, and went to "
            f"{new_path} in its stead; putting that back failed ({error}): move it back by "
            "hand."
        )
    return (
        "It was replaced by a save of its step just before it could be moved aside (by "
        "another process), so the new save was left under its name."
    )


def _quarantine(
    store: Storage,
    directory: str,
    entries: list[tuple[_directory.Entry, Any]],
    timeout_s: int | float,
) -> dict[str, str]:
    """Moves each skipped checkpoint (with the version found unreadable) out of the
    listing (`_directory.quarantine`), so that it neither blocks the next save of its step
    nor counts as that step saved; returns, for each, a sentence saying where it went (or
    why it was not moved). One saved again under its name meanwhile (another manager moved
    the corrupt one aside and saved its step) is left alone. In a multi-process job
    process 0 moves them, and every process waits until it has."""

    def move() -> str:
        said = {}
        for entry, version in entries:
            if version is None or _version(store, entry) != version:
                said[entry.path] = (
                    "It was replaced or moved since it was found unreadable (by another "
                    "process), so it was left as it is."
                )
                continue
            try:
                new_path = _directory.quarantine(store, directory, entry)
            except OSError as error:
                said[entry.path] = (
                    f"It could not be moved aside ({error}): move or delete it by hand, or "
                    "saving its step again fails."
                )
            else:
                said[entry.path] = _check_moved(store, entry, new_path, version)
        return json.dumps(said)

    if not entries:
        return {}
    if jax.process_count() == 1:
        return json.loads(move())
    said = _coordination.decide(
        _coordination.next_id("restore_quarantine"),
        move,
        timeout_s=timeout_s,
    )
    return json.loads(str(said))
