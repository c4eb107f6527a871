"""What a `CheckpointManager` reads of its directory and keeps: the metrics it stores in
each file, the reading and ranking of them (`Ranking`), applying a retention policy to a
listing, and the manager's reading half (`ManagedDirectory`)."""

from __future__ import annotations

import json
import math
import sys
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any, Literal, TypeVar

import numpy as np
from jax.typing import ArrayLike

from ..._calls import call, calling, in_context, outside_stacklevel
from .._errors import (
    UNREADABLE_ERRNOS,
    NewerFormatError,
    StepNotFoundError,
    UnreadableCheckpointWarning,
)
from ..format import _names
from ..format._names import (
    METRICS_KEY as _METRICS_KEY,
    USER_METADATA_KEY as _USER_METADATA_KEY,
)
from ..format._reader import FileReader
from ..pipeline import _directory
from ..pipeline._snapshot import SnapshotMode
from ..storage._base import Storage
from ._options import ManagerOptions, Option as _Option
from ._retention_policy import Mode, RetentionContext, RetentionPolicy
from ._save_policy import SavePolicy

T = TypeVar("T")

# What `metrics_of` read: (the metrics saved with a checkpoint or None, why they could not
# be read or None).
Read = tuple[dict[str, Any] | None, str | None]


def metadata_of(store: Storage, entry: _directory.Entry) -> dict[str, str]:
    """A listed checkpoint's metadata (a file's, or a `.shards` index's): its header only,
    opened directly (it is known to be a file or a `.shards` directory)."""
    path = store.join(entry.path, _names.INDEX_NAME) if entry.sharded else entry.path
    with FileReader(path, store.open(path)) as reader:
        return reader.metadata


def metrics_of(store: Storage, entry: _directory.Entry) -> Read:
    """(the metrics saved with the checkpoint, or None; why they could not be read, or
    None). Raises `FileNotFoundError` if the checkpoint is gone."""
    try:
        raw = metadata_of(store, entry).get(_METRICS_KEY)
        metrics = json.loads(raw) if raw else None
    except (FileNotFoundError, NewerFormatError):
        raise  # a newer eqx_train's checkpoint is not one without a metric: never deleted
    except (OSError, ValueError) as error:
        if isinstance(error, OSError) and (
            not store.os_errors_mean_bad_media or error.errno not in UNREADABLE_ERRNOS
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

    def __init__(self, store: Storage):
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

    def restore_best(
        self,
        list_checkpoints: Callable[[], list[_directory.Entry]],
        restore: Callable[[_directory.Entry], T],
        *,
        directory: str,
        metric: str | None,
        mode: Mode,
        attempts: int,
    ) -> T:
        """What `restore(entry)` returns for the best checkpoint by `metric` of `directory`
        (listed by `list_checkpoints`); ranked again
        (up to `attempts` times) when retention removed it meanwhile (a better one arrived).
        Raises `StepNotFoundError` when no checkpoint has a usable `metric`, and
        `ValueError` for a manager without a `best_metric`."""
        if not metric:
            raise ValueError(
                "CheckpointManager.restore(step='best') needs best_metric, the metric that "
                "ranks checkpoints: CheckpointManager(directory, best_metric='val_loss') "
                "(and mode='max' when higher is better)."
            )
        for attempt in range(attempts):
            best = self.best(list_checkpoints, metric=metric, mode=mode, attempts=attempts)
            if best is None:
                raise StepNotFoundError(
                    f"{call('CheckpointManager.restore')}: no checkpoint in {directory} has "
                    f"a usable '{metric}' metric."
                )
            try:
                return restore(best)
            except FileNotFoundError:
                if attempt + 1 == attempts:
                    raise
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


def file_metadata(
    metrics: Mapping[str, ArrayLike] | None,
    metadata: Mapping[str, Any] | None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """What a manager's save adds to the checkpoint's metadata: its metrics, the user's
    `metadata`, and `extra` entries (each process's host state)."""
    encoded = {_METRICS_KEY: encode_metrics(metrics), _USER_METADATA_KEY: encode_metadata(metadata)}
    return {**encoded, **(extra or {})}


class ManagedDirectory:
    """The reading half of `CheckpointManager`: what is in its directory. Set up by the
    manager's constructor."""

    directory: str
    _store: Storage
    _options: ManagerOptions
    _ranking: Ranking
    # How often a listing is read again when a checkpoint vanished while being read.
    _attempts: int

    prefix = _Option[str]()
    retention = _Option[RetentionPolicy]()
    save_policy = _Option[SavePolicy]()
    keep_latest = _Option[int | None]()
    keep_best = _Option[int | None]()
    best_metric = _Option[str | None]()
    mode = _Option[Literal["min", "max"]]()
    keep_every_n_steps = _Option[int | float | None]()
    save_interval_steps = _Option[int | None]()
    save_interval_seconds = _Option[int | float | None]()
    snapshot = _Option[SnapshotMode]()
    host_window_bytes = _Option[int]()
    timeout_s = _Option[int | float]()
    handle_sigterm = _Option[bool]()
    replica_parallel = _Option[bool]()
    storage_options = _Option[Mapping[str, Any] | None]()

    def all_steps(self) -> list[int | float]:
        """Steps of the checkpoints in the directory, oldest first."""
        return list({e.value: e.step for e in self._listing()}.values())

    def latest_step(self) -> int | float | None:
        """The newest step, or None when there is no checkpoint."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | float | None:
        """The step with the best `best_metric` (None if no checkpoint has a usable one)."""
        metric = self._options.best_metric
        if not metric:
            raise ValueError("CheckpointManager.best_step: the manager has no best_metric.")
        with calling("CheckpointManager.best_step"):
            best = self._ranking.best(
                self._listing, metric=metric, mode=self._options.mode, attempts=self._attempts
            )
        return None if best is None else best.step

    def metrics(self, step: _names.Step) -> dict[str, float] | None:
        """The metrics saved with `step` (None if it was saved without). Reads no tensor data."""
        raw = metadata_of(self._store, self._entry(step)).get(_METRICS_KEY)
        return None if raw is None else json.loads(raw)

    def metadata(self, step: _names.Step) -> dict[str, Any] | None:
        """The user metadata saved with `step` (None if none). Reads no tensor data."""
        raw = metadata_of(self._store, self._entry(step)).get(_USER_METADATA_KEY)
        return None if raw is None else json.loads(raw)

    def _latest(self) -> Decimal | None:
        listing = self._listing()
        return listing[-1].value if listing else None

    def _listing(self) -> list[_directory.Entry]:
        return _directory.list_checkpoints(self._store, self.directory, self._options.prefix)

    def _entry(self, step: _names.Step) -> _directory.Entry:
        with calling("CheckpointManager"):
            found = _directory.find_step(self._listing(), _names.check_step(step))
        if found is not None:
            return found
        raise StepNotFoundError(
            f"CheckpointManager: no checkpoint for step {step} in {self.directory}; "
            f"available steps: {self.all_steps()}."
        )
