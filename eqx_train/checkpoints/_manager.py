"""`CheckpointManager`: keep the latest N and the best K by a metric, loud async errors."""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Mapping
from decimal import Decimal
from typing import Any, Literal, TypeVar

import jax
import numpy as np
from jax.typing import ArrayLike

from . import _files, _names, _storage
from ._async import AsyncManager
from ._checkpoints import open_reader, restore_checkpoint, save_pipeline

T = TypeVar("T")
_METRICS_KEY = "eqx_train.metrics"
_USER_METADATA_KEY = "eqx_train.user_metadata"


class UnreadableCheckpointWarning(UserWarning):
    """A checkpoint in a manager's directory could not be read while ranking by metric; it
    counts as having no metric (it is kept only as one of the latest)."""


def _metadata_of(store: _storage.Storage, path: str) -> dict[str, str]:
    """A checkpoint's metadata (a file's, or a `.shards` index's); reads no tensor data."""
    with open_reader(store, path) as reader:
        return reader.metadata


class CheckpointManager:
    """Saves checkpoints into one directory and decides which to keep.

    Retention is the union of three policies, applied after each save is durable:

    - the newest `keep_latest` checkpoints are always kept, so resuming always works;
    - the best `keep_best` by `metrics[best_metric]` (lowest for `mode="min"`, highest for
      `"max"`; a NaN or missing metric never counts; ties go to the newer step);
    - flax's `keep_every_n_steps` rule over the checkpoints older than the newest
      `keep_latest`.

    Metrics and a user `metadata` dict live inside each checkpoint file (its safetensors
    metadata), so the directory has no side files to lose or get out of sync, and a new
    manager on an existing directory sees every checkpoint and its metrics.

    **Arguments:**

    - `directory`: where the checkpoints go (created if missing).
    - `keep_latest`: newest checkpoints to keep (>= 1).
    - `keep_best`: best checkpoints to keep by `best_metric` (0 for none).
    - `best_metric`: the name of the metric that ranks checkpoints; required if
      `keep_best > 0` or to `restore(..., step="best")`.
    - `mode`: `"min"` or `"max"`.
    - `keep_every_n_steps`: see above; `None` for none.
    - `prefix`: file name prefix, as for `save_checkpoint`.
    - `async_save`: write in a background thread (one save in flight). The state is
      snapshotted at `save`; an error in the background is raised by the next `save`,
      `wait` or `close` (or when leaving a `with` block).
    - `timeout_s`: in a multi-process job, how long to wait for the other processes.

    On creation the manager removes temporary files left by a killed save of this
    directory and prefix (only files named as this library names them, and only if the
    process that wrote them is gone).

    **Example:**

    ```python
    import tempfile

    import numpy as np
    from eqx_train.checkpoints import CheckpointManager

    state = {"w": np.zeros(3, np.float32)}
    directory = tempfile.mkdtemp()
    with CheckpointManager(directory, keep_latest=2, keep_best=1, best_metric="val_loss") as mgr:
        for epoch, val_loss in enumerate([0.9, 0.3, 0.5, 0.4]):
            state = {"w": state["w"] + 1}
            mgr.save(epoch, state, metrics={"val_loss": val_loss}, metadata={"lr": 1e-3})
    assert mgr.all_steps() == [1, 2, 3]  # the best (1) and the latest two
    best = mgr.restore(state, step="best")
    assert best["w"].tolist() == [2.0, 2.0, 2.0]
    ```

    **Multi-process jobs:** create the manager and call `save` on every process of a
    `jax.distributed` job with the same arguments; it then saves with
    `save_checkpoint_multiprocess` (each process writes its own shards, `timeout_s` bounds
    the waits) and process 0 applies the retention policy. Reading methods work on every
    process.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep_latest: int = 1,
        keep_best: int = 0,
        best_metric: str | None = None,
        mode: Literal["min", "max"] = "min",
        keep_every_n_steps: int | float | None = None,
        prefix: str = "checkpoint_",
        async_save: bool = False,
        timeout_s: int | float = 300.0,
        storage_options: Mapping[str, Any] | None = None,
    ):
        if isinstance(keep_latest, bool) or not isinstance(keep_latest, int) or keep_latest < 1:
            raise ValueError(
                f"CheckpointManager: keep_latest must be an int >= 1 (the newest checkpoint is "
                f"what resuming needs), got {keep_latest!r}."
            )
        if isinstance(keep_best, bool) or not isinstance(keep_best, int) or keep_best < 0:
            raise ValueError(
                f"CheckpointManager: keep_best must be an int >= 0, got {keep_best!r}."
            )
        if keep_best > 0 and not best_metric:
            raise ValueError(
                f"CheckpointManager: keep_best={keep_best} needs best_metric, the name of the "
                "metric that ranks checkpoints (e.g. best_metric='val_loss')."
            )
        if mode not in ("min", "max"):
            raise ValueError(f"CheckpointManager: mode must be 'min' or 'max', got {mode!r}.")
        _files.check_keep_every_n_steps(keep_every_n_steps, "CheckpointManager")
        if not prefix:
            raise ValueError("CheckpointManager: prefix must be a non-empty file name prefix.")
        _names.check_prefix(prefix, "CheckpointManager")
        if not isinstance(timeout_s, int | float) or not timeout_s > 0:
            raise ValueError(f"CheckpointManager: timeout_s must be > 0, got {timeout_s!r}.")
        self._store, self.directory = _storage.resolve(
            directory, storage_options, caller="CheckpointManager"
        )
        self.storage_options = storage_options
        self.keep_latest = keep_latest
        self.keep_best = keep_best
        self.best_metric = best_metric
        self.mode = mode
        self.keep_every_n_steps = keep_every_n_steps
        self.prefix = prefix
        self.timeout_s = timeout_s
        self._async = AsyncManager() if async_save else None
        self._store.makedirs(self.directory)
        _files.remove_leftovers(self._store, self.directory, self.prefix)

    # ------------------------------------------------------------------ saving

    def save(
        self,
        step: _names.Step,
        state: Any,
        *,
        metrics: Mapping[str, ArrayLike] | None = None,
        metadata: Mapping[str, Any] | None = None,
        overwrite: bool = False,
    ) -> str:
        """Saves `state` at `step` with its metrics and metadata; returns the file's path.

        **Arguments:**

        - `step`: int or float, newer than the latest checkpoint unless `overwrite=True`
          (which replaces that step and deletes every newer one, as flax does).
        - `state`: any pytree (e.g. `(train_state, early_stopping)`).
        - `metrics`: name -> number, stored in the file; used by `best_metric`.
        - `metadata`: any JSON-serialisable dict (hyperparameters, model config, git
          revision), stored in the file.

        Raises the error of a failed previous background save, if any.
        """
        extra = {
            _METRICS_KEY: self._encode_metrics(metrics),
            _USER_METADATA_KEY: self._encode_metadata(metadata),
        }
        return save_pipeline(
            self.directory,
            state,
            step,
            prefix=self.prefix,
            overwrite=overwrite,
            retention=self._to_delete,
            async_manager=self._async,
            caller="CheckpointManager.save",
            extra_metadata=extra,
            multiprocess=jax.process_count() > 1,
            timeout_s=self.timeout_s,
            storage_options=self.storage_options,
        )

    def wait(self) -> None:
        """Blocks until the background save (if any) is done; raises its error if it failed."""
        if self._async is not None:
            self._async.wait_previous_save()

    def close(self) -> None:
        """Waits for the background save and raises its error, if any."""
        self.wait()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as save_error:  # report both, without hiding the original error
            exc.add_note(f"Also, a background checkpoint save failed: {save_error!r}")

    # ------------------------------------------------------------------ reading

    def all_steps(self) -> list[int | float]:
        """Steps of the checkpoints in the directory, oldest first."""
        return list({e.value: e.step for e in self._listing()}.values())

    def latest_step(self) -> int | float | None:
        """The newest step, or None when there is no checkpoint."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | float | None:
        """The step with the best `best_metric` (None if no checkpoint has a usable one)."""
        if not self.best_metric:
            raise ValueError("CheckpointManager.best_step: the manager has no best_metric.")
        steps = list({e.value: (e.value, e.text) for e in self._listing()}.values())
        ranked = self._ranked(steps)
        return _names.step_from_text(ranked[0]) if ranked else None

    def metrics(self, step: _names.Step) -> dict[str, float] | None:
        """The metrics saved with `step` (None if it was saved without). Reads no tensor data."""
        raw = _metadata_of(self._store, self._path(step)).get(_METRICS_KEY)
        return None if raw is None else json.loads(raw)

    def metadata(self, step: _names.Step) -> dict[str, Any] | None:
        """The user metadata saved with `step` (None if none). Reads no tensor data."""
        raw = _metadata_of(self._store, self._path(step)).get(_USER_METADATA_KEY)
        return None if raw is None else json.loads(raw)

    def restore(self, target: T, step: _names.Step | Literal["best"] | None = None) -> T:
        """Restores `step` (default: the latest; `"best"`: the best by `best_metric`) into
        the structure of `target`, as `restore_checkpoint` does. With no checkpoint and
        `step=None`, returns `target` unchanged."""
        self.wait()
        if step == "best":
            best = self.best_step()
            if best is None:
                raise ValueError(
                    f"CheckpointManager.restore: no checkpoint in {self.directory} has a "
                    f"usable '{self.best_metric}' metric."
                )
            step = best
        return restore_checkpoint(
            self.directory,
            target,
            step=step,
            prefix=self.prefix,
            storage_options=self.storage_options,
        )

    # ------------------------------------------------------------------ internals

    def _listing(self) -> list[_files.Entry]:
        return _files.list_checkpoints(self._store, self.directory, self.prefix)

    def _path(self, step: _names.Step) -> str:
        found = _files.find_step(self._listing(), _names.check_step(step, "CheckpointManager"))
        if found is not None:
            return found.path
        raise ValueError(
            f"CheckpointManager: no checkpoint for step {step} in {self.directory}; "
            f"available steps: {self.all_steps()}."
        )

    def _metric_of(self, path: str) -> float | None:
        try:
            raw = _metadata_of(self._store, path).get(_METRICS_KEY)
            metrics = json.loads(raw) if raw else None
        except (OSError, ValueError) as error:
            warnings.warn(
                f"CheckpointManager: cannot read the metrics of {path} ({error}); it counts "
                "as having none.",
                UnreadableCheckpointWarning,
                stacklevel=3,
            )
            return None
        value = metrics.get(self.best_metric or "") if isinstance(metrics, dict) else None
        if value is None or not isinstance(value, int | float) or math.isnan(value):
            return None
        return float(value)

    def _ranked(self, steps: list[tuple[Decimal, str]]) -> list[str]:
        """Step texts with a usable metric, best first (ties: newer first)."""
        paths = {e.text: e.path for e in self._listing()}
        scored = [(self._metric_of(paths[text]), value, text) for value, text in steps]
        usable = [(m, value, text) for m, value, text in scored if m is not None]
        sign = 1.0 if self.mode == "min" else -1.0
        usable.sort(key=lambda item: (sign * item[0], -item[1]))
        return [text for _, _, text in usable]

    def _to_delete(self, steps: list[tuple[Decimal, str]]) -> list[str]:
        keep = {text for _, text in steps[-self.keep_latest :]}
        if self.keep_best:
            keep.update(self._ranked(steps)[: self.keep_best])
        kept_by_flax_rule = set(
            text for _, text in steps[: max(len(steps) - self.keep_latest, 0)]
        ) - set(
            _files.steps_to_delete(
                steps, keep=self.keep_latest, keep_every_n_steps=self.keep_every_n_steps
            )
        )
        keep.update(kept_by_flax_rule)
        return [text for _, text in steps if text not in keep]

    def _encode_metrics(self, metrics: Mapping[str, ArrayLike] | None) -> str:
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

    def _encode_metadata(self, metadata: Mapping[str, Any] | None) -> str:
        if metadata is None:
            return "null"
        try:
            return json.dumps(dict(metadata))
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"CheckpointManager.save: metadata must be JSON-serialisable ({error})."
            ) from None
