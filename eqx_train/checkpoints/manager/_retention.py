"""What a `CheckpointManager` keeps and ranks by: the metrics it stores in each file, the
reading of them (`Ranking`), and applying a retention policy to a directory's listing."""

from __future__ import annotations

import json
import math
import sys
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any

import numpy as np
from jax.typing import ArrayLike

from .._errors import (
    UNREADABLE_ERRNOS,
    NewerFormatError,
    UnreadableCheckpointWarning,
    call,
    in_context,
    outside_stacklevel,
)
from ..format import _format, _names
from ..format._names import METRICS_KEY as _METRICS_KEY
from ..pipeline import _directory
from ..storage import _storage
from ._retention_policy import Mode, RetentionContext, RetentionPolicy

# What `metrics_of` read: (the metrics saved with a checkpoint or None, why they could not
# be read or None).
Read = tuple[dict[str, Any] | None, str | None]


def metadata_of(store: _storage.Storage, entry: _directory.Entry) -> dict[str, str]:
    """A listed checkpoint's metadata (a file's, or a `.shards` index's): its header only,
    opened directly (it is known to be a file or a `.shards` directory)."""
    path = store.join(entry.path, _names.INDEX_NAME) if entry.sharded else entry.path
    with _format.FileReader(path, store.open(path)) as reader:
        return reader.metadata


def metrics_of(store: _storage.Storage, entry: _directory.Entry) -> Read:
    """(the metrics saved with the checkpoint, or None; why they could not be read, or
    None). Raises `FileNotFoundError` if the checkpoint is gone."""
    try:
        raw = metadata_of(store, entry).get(_METRICS_KEY)
        metrics = json.loads(raw) if raw else None
    except (FileNotFoundError, NewerFormatError):
        raise  # a newer eqx_train's checkpoint is not one without a metric: never deleted
    except (OSError, ValueError) as error:
        if isinstance(error, OSError) and (
            not store.is_local or error.errno not in UNREADABLE_ERRNOS
        ):
            # An unreachable store, or an error of the process (too many open files, a
            # permission), says nothing about the checkpoint: never let it make retention
            # delete the best one.
            error.add_note(
                f"{call('CheckpointManager')}: while reading the metrics of {entry.path} to "
                "rank the checkpoints (retention, or step='best'); nothing was deleted."
            )
            raise
        return None, str(error)
    return (metrics if isinstance(metrics, dict) else None), None


def usable(metrics: dict[str, Any] | None, name: str | None) -> float | None:
    """The value of metric `name` in `metrics`, if it is a number and not NaN."""
    value = metrics.get(name or "") if metrics is not None else None
    if value is None or not isinstance(value, int | float) or math.isnan(value):
        return None
    return float(value)


class Ranking:
    """Reads and ranks the metrics of the checkpoints of one store, remembering what it
    read."""

    def __init__(self, store: _storage.Storage):
        self.store = store
        # (path, listed version) -> what `metrics_of` read: on an object store, retention
        # and "best" then read only the metrics of checkpoints not seen before.
        self.cache: dict[tuple[str, Any], Read] = {}

    def read(self, entries: list[_directory.Entry], *, gone_ok: bool) -> list[Read]:
        """What `metrics_of` reads of each of `entries`, read concurrently; a warning for
        each whose metrics are unreadable. A checkpoint gone meanwhile counts as having
        none (`gone_ok`) or raises `FileNotFoundError` (so that the caller lists again)."""
        cache = self.cache

        def read_one(entry: _directory.Entry) -> Read:
            # A checkpoint never changes but by being replaced, which changes the version
            # the listing reports: what was read for that version stays true.
            key = (entry.path, entry.identity)
            if entry.identity is not None and key in cache:
                return cache[key]
            try:
                found = metrics_of(self.store, entry)
            except FileNotFoundError:
                if gone_ok:
                    return None, None
                raise
            if entry.identity is not None:
                cache[key] = found
            return found

        # Concurrently: on an object store each read is a request, latency-bound.
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(entries)))) as pool:
            read = list(pool.map(in_context(read_one), entries))
        listed = {(e.path, e.identity) for e in entries}
        self.cache = {k: v for k, v in cache.items() if k in listed}
        for entry, (_, problem) in zip(entries, read, strict=True):
            if problem is not None:
                warnings.warn(
                    f"{call('CheckpointManager')}: cannot read the metrics of {entry.path} "
                    f"({problem}); it counts as having none.",
                    UnreadableCheckpointWarning,
                    stacklevel=outside_stacklevel(sys._getframe()),
                )
        return read

    def best(
        self,
        list_checkpoints: Callable[[], list[_directory.Entry]],
        *,
        metric: str,
        mode: Mode,
        attempts: int,
    ) -> _directory.Entry | None:
        """The best checkpoint by `metric`, ranked on one listing; listed again (up to
        `attempts` times) if retention removed a checkpoint while its metric was read."""
        for attempt in range(attempts):
            entries = _directory.preferred(list_checkpoints())
            try:
                read = self.read(entries, gone_ok=False)
            except FileNotFoundError:
                if attempt + 1 == attempts:
                    raise
                continue
            ranked = rank(entries, read, metric, mode)
            return ranked[0] if ranked else None
        raise AssertionError("unreachable")  # pragma: no cover


def rank(
    entries: list[_directory.Entry], read: list[Read], metric: str, mode: Mode
) -> list[_directory.Entry]:
    """`entries` with a usable `metric` in what was `read` of them, best first (ties: newer
    first)."""
    scored = [
        (value, entry)
        for (metrics, _), entry in zip(read, entries, strict=True)
        if (value := usable(metrics, metric)) is not None
    ]
    sign = 1.0 if mode == "min" else -1.0
    scored.sort(key=lambda item: (sign * item[0], -item[1].value))
    return [entry for _, entry in scored]


def to_delete(
    entries: list[_directory.Entry], policy: RetentionPolicy, ranking: Ranking
) -> list[str]:
    """The step texts of `entries` (one per step, oldest first) that `policy` does not
    keep. Metrics are read (through `ranking`) only if the policy asks, and then once."""
    read: list[Read] = []

    def ranked(metric: str, mode: Mode) -> list[Decimal]:
        if not read:
            read.extend(ranking.read(entries, gone_ok=True))
        return [entry.value for entry in rank(entries, read, metric, mode)]

    kept = policy.keep(RetentionContext(tuple(e.value for e in entries), ranked))
    return [e.text for e in entries if e.value not in kept]


def encode_metrics(metrics: Mapping[str, ArrayLike] | None) -> str:
    """`metrics` as the JSON stored in a checkpoint's metadata; each value must be a number."""
    if metrics is None:
        return "null"
    encoded = {}
    for name, value in metrics.items():
        try:
            encoded[str(name)] = float(np.asarray(value))
        except (TypeError, ValueError):
            raise TypeError(
                f"{call('CheckpointManager.save')}: metric '{name}' must be a number, got "
                f"{type(value).__name__} {value!r}."
            ) from None
    return json.dumps(encoded)


def encode_metadata(metadata: Mapping[str, Any] | None) -> str:
    """The user `metadata` as the JSON stored in a checkpoint's metadata."""
    if metadata is None:
        return "null"
    try:
        return json.dumps(dict(metadata))
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"{call('CheckpointManager.save')}: metadata must be JSON-serialisable ({error})."
        ) from None
