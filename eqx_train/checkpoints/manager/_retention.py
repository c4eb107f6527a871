"""Which checkpoints a `CheckpointManager` keeps: the metrics it stores in each file and
ranks them by, and the retention rule (the latest N, the best K, flax's every-N-steps)."""

from __future__ import annotations

import json
import math
import sys
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from jax.typing import ArrayLike

from .._errors import NewerFormatError, outside_stacklevel
from ..format import _format, _names
from ..format._names import METRICS_KEY as _METRICS_KEY
from ..pipeline import _directory
from ..pipeline._restore import RESTORE_ATTEMPTS
from ..storage import Storage
from ._fallback import UNREADABLE_ERRNOS, UnreadableCheckpointWarning


def check_policy(
    keep_latest: Any,
    keep_best: Any,
    best_metric: Any,
    mode: Any,
    keep_every_n_steps: Any,
) -> None:
    """Raises `ValueError` naming the first of a manager's retention options that is invalid."""
    if isinstance(keep_latest, bool) or not isinstance(keep_latest, int) or keep_latest < 1:
        raise ValueError(
            f"CheckpointManager: keep_latest must be an int >= 1 (the newest checkpoint is "
            f"what resuming needs), got {keep_latest!r}."
        )
    if isinstance(keep_best, bool) or not isinstance(keep_best, int) or keep_best < 0:
        raise ValueError(f"CheckpointManager: keep_best must be an int >= 0, got {keep_best!r}.")
    if keep_best > 0 and not best_metric:
        raise ValueError(
            f"CheckpointManager: keep_best={keep_best} needs best_metric, the name of the "
            "metric that ranks checkpoints (e.g. best_metric='val_loss')."
        )
    if mode not in ("min", "max"):
        raise ValueError(f"CheckpointManager: mode must be 'min' or 'max', got {mode!r}.")
    _directory.check_keep_every_n_steps(keep_every_n_steps, "CheckpointManager")


def metadata_of(store: Storage, entry: _directory.Entry) -> dict[str, str]:
    """A listed checkpoint's metadata (a file's, or a `.shards` index's): its header only,
    opened directly (it is known to be a file or a `.shards` directory)."""
    path = store.join(entry.path, _names.INDEX_NAME) if entry.sharded else entry.path
    with _format.FileReader(path, store.open(path)) as reader:
        return reader.metadata


def metric_of(
    store: Storage, entry: _directory.Entry, best_metric: str | None
) -> tuple[float | None, str | None]:
    """(the checkpoint's `best_metric`, or None; why it could not be read, or None).
    Raises `FileNotFoundError` if the checkpoint is gone."""
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
                f"CheckpointManager: while reading the metrics of {entry.path} to rank the "
                "checkpoints (retention, or step='best'); nothing was deleted."
            )
            raise
        return None, str(error)
    value = metrics.get(best_metric or "") if isinstance(metrics, dict) else None
    if value is None or not isinstance(value, int | float) or math.isnan(value):
        return None, None
    return float(value), None


class Ranking:
    """Ranks the checkpoints of one store by a metric, remembering what it read."""

    def __init__(self, store: Storage):
        self.store = store
        # (path, listed version) -> what `metric_of` read: on an object store, retention
        # and "best" then read only the metrics of checkpoints not seen before.
        self.cache: dict[tuple[str, Any], tuple[float | None, str | None]] = {}

    def ranked(
        self,
        entries: list[_directory.Entry],
        *,
        best_metric: str | None,
        mode: str,
        gone_ok: bool,
    ) -> list[_directory.Entry]:
        """`entries` with a usable metric, best first (ties: newer first). The metrics are
        read concurrently. A checkpoint gone meanwhile counts as having none (`gone_ok`)
        or raises `FileNotFoundError` (so that the caller lists again)."""

        cache = self.cache

        def score(entry: _directory.Entry) -> tuple[float | None, str | None]:
            # A checkpoint never changes but by being replaced, which changes the version
            # the listing reports: what was read for that version stays true.
            key = (entry.path, entry.identity)
            if entry.identity is not None and key in cache:
                return cache[key]
            try:
                found = metric_of(self.store, entry, best_metric)
            except FileNotFoundError:
                if gone_ok:
                    return None, None
                raise
            if entry.identity is not None:
                cache[key] = found
            return found

        # Concurrently: on an object store each read is a request, latency-bound.
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(entries)))) as pool:
            scores = list(pool.map(score, entries))
        listed = {(e.path, e.identity) for e in entries}
        self.cache = {k: v for k, v in cache.items() if k in listed}
        for entry, (_, problem) in zip(entries, scores, strict=True):
            if problem is not None:
                warnings.warn(
                    f"CheckpointManager: cannot read the metrics of {entry.path} ({problem}); "
                    "it counts as having none.",
                    UnreadableCheckpointWarning,
                    stacklevel=outside_stacklevel(sys._getframe()),
                )
        usable = [(m, e) for (m, _), e in zip(scores, entries, strict=True) if m is not None]
        sign = 1.0 if mode == "min" else -1.0
        usable.sort(key=lambda item: (sign * item[0], -item[1].value))
        return [e for _, e in usable]

    def best(
        self,
        list_checkpoints: Callable[[], list[_directory.Entry]],
        *,
        best_metric: str | None,
        mode: str,
    ) -> _directory.Entry | None:
        """The best checkpoint by `best_metric`, ranked on one listing; listed again if
        retention removed a checkpoint while its metric was being read."""
        for attempt in range(RESTORE_ATTEMPTS):
            try:
                ranked = self.ranked(
                    _directory.preferred(list_checkpoints()),
                    best_metric=best_metric,
                    mode=mode,
                    gone_ok=False,
                )
            except FileNotFoundError:
                if attempt + 1 == RESTORE_ATTEMPTS:
                    raise
                continue
            return ranked[0] if ranked else None
        raise AssertionError("unreachable")  # pragma: no cover


def to_delete(
    entries: list[_directory.Entry],
    *,
    keep_latest: int,
    keep_every_n_steps: int | float | None,
    keep_best: int,
    rank: Any,
) -> list[str]:
    """The step texts of `entries` (oldest first) that retention deletes: all but the newest
    `keep_latest`, those flax's `keep_every_n_steps` rule keeps, and the best `keep_best` by
    `rank(entries)` (called only when some checkpoint might go)."""
    steps = [(e.value, e.text) for e in entries]
    keep = {e.text for e in entries[-keep_latest:]}
    kept_by_flax_rule = set(text for _, text in steps[: max(len(steps) - keep_latest, 0)]) - set(
        _directory.steps_to_delete(steps, keep=keep_latest, keep_every_n_steps=keep_every_n_steps)
    )
    keep.update(kept_by_flax_rule)
    if keep_best and len(keep) < len(entries):
        # Metrics are read only when some checkpoint might go.
        keep.update(e.text for e in rank(entries)[:keep_best])
    return [e.text for e in entries if e.text not in keep]


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
                f"CheckpointManager.save: metric '{name}' must be a number, got "
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
            f"CheckpointManager.save: metadata must be JSON-serialisable ({error})."
        ) from None
