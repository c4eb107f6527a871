"""The restoring half of `CheckpointManager`: its `restore` (the latest checkpoint, a step
or the best, with the fallback and the local tiers). The manager inherits it."""

from __future__ import annotations

import time
from typing import Any, Literal, TypeVar, overload

from ..._calls import calling
from ..._progress import Progress, reporting
from ..format import _names
from ..pipeline import _directory, _matching, _transform
from ..pipeline._options import RestoreOptions
from ._checks import restore_options

T = TypeVar("T")


class Restoring:
    """`CheckpointManager.restore`: which checkpoint a call restores (the local tiers first,
    a step, the best, or the newest that verifies) and the report it leaves. The manager
    provides the steps below (its listing, the restores of a step, of the newest that
    verifies and of the local tiers) and sets the attributes in its constructor."""

    directory: str
    _options: Any  # the manager's checked `ManagerOptions`
    _ranking: Any  # a `_retention.Ranking`
    _attempts: int
    _restored: _directory.Entry | None
    _last_restore: Any  # a `_tiers.LastRestore`, or None

    def wait(self) -> None:
        raise NotImplementedError

    def _listing(self) -> list[_directory.Entry]:
        raise NotImplementedError

    def _restore_entry(self, entry: _directory.Entry, target: T, options: RestoreOptions) -> T:
        raise NotImplementedError

    def _restore_step(self, target: T, step: Any, options: RestoreOptions) -> T:
        raise NotImplementedError

    def _restore_latest(self, target: T, options: RestoreOptions) -> T:
        raise NotImplementedError

    def _restore_local(self, target: Any, began: float) -> tuple[bool, Any]:
        raise NotImplementedError

    def _persistent_report(self, tree: Any, target: Any, step: Any, began: float) -> Any:
        raise NotImplementedError

    @overload
    def restore(
        self,
        target: None,
        step: _names.Step | Literal["best"] | None = None,
        *,
        fallback: bool = True,
        config: Literal["target", "saved"] = "target",
        filter_spec: Any = None,
        strict: bool = True,
        rename: _matching.Rename = None,
        casting: _matching.Casting = "no",
        transform: _transform.Transform = None,
        progress: Progress = None,
    ) -> Any: ...

    @overload
    def restore(
        self,
        target: T,
        step: _names.Step | Literal["best"] | None = None,
        *,
        fallback: bool = True,
        config: Literal["target", "saved"] = "target",
        filter_spec: Any = None,
        strict: bool = True,
        rename: _matching.Rename = None,
        casting: _matching.Casting = "no",
        transform: _transform.Transform = None,
        progress: Progress = None,
    ) -> T: ...

    def restore(
        self,
        target: T,
        step: _names.Step | Literal["best"] | None = None,
        *,
        fallback: bool = True,
        config: Literal["target", "saved"] = "target",
        filter_spec: Any = None,
        strict: bool = True,
        rename: _matching.Rename = None,
        casting: _matching.Casting = "no",
        transform: _transform.Transform = None,
        progress: Progress = None,
    ) -> T:
        """Restores a checkpoint into the structure of `target`, as `restore_checkpoint`
        does.

        **Arguments:**

        - `target`: the pytree to fill (see `restore_checkpoint`), or None for the saved
          tree as nested dicts of arrays.
        - `step`: `None` for the latest checkpoint, `"best"` for the best by
          `best_metric`, or a step number.
        - `fallback`: only for `step=None`: if the latest checkpoint is corrupt (truncated,
          a failed checksum, a missing piece: `CheckpointFormatError`), restore the newest
          older one that reads and verifies instead, with an `UnreadableCheckpointWarning`
          naming each checkpoint skipped. A disk read error (`OSError`) of a local file
          counts as corruption. Each one skipped is moved aside, beside the others, to
          `corrupt-<its name>` (never deleted: inspect it, then delete it), so that it
          neither blocks saving its step again nor makes `should_save` take that step as
          saved. `False` raises the error instead. A checkpoint
          that reads fine but does not match `target` is never skipped (that is an error
          in the target), and a requested step or `"best"` never falls back.
        - `config`, `filter_spec`: as for `restore_checkpoint` (the target's Python
          configuration wins by default; `filter_spec` restores a part of the tree).
        - `strict`, `rename`, `casting`, `transform`: as for `restore_checkpoint`, for a
          model that changed since the save (see `plan_restore`); the fallback works with
          them too.
        - `progress`: as for `restore_checkpoint` (`True`: a tqdm bar on stderr; or a
          function `(done_bytes, total_bytes)`); one report for the whole call, however
          many checkpoints a fallback tries.

        **Returns:**

        The restored pytree; `target` unchanged when there is no checkpoint and
        `step=None`.

        **Raises:**

        `StepNotFoundError` (a `ValueError` and a `FileNotFoundError`) when `step` is
        missing or `"best"` finds no checkpoint with a usable metric; `ValueError` when
        the checkpoint does not match `target`;
        `CheckpointFormatError` when the checkpoint asked for is corrupt (with `fallback`:
        when every checkpoint is).

        A checkpoint removed by a concurrent save's retention while it was being chosen or
        read (the trainer saving while an evaluator restores) is chosen again from a fresh
        listing.

        In a multi-process job, call it on every process: the processes agree on which
        checkpoint to fall back to, so a corruption only one process reads makes all of
        them skip it.
        """
        with calling("CheckpointManager.restore"):
            options = restore_options(
                self._options,
                target,
                config=config,
                filter_spec=filter_spec,
                strict=strict,
                rename=rename,
                casting=casting,
                transform=transform,
                progress=progress,
            )
            self.wait()
            began = time.perf_counter()
            plain = target is not None and all(o is None for o in (filter_spec, rename, transform))
            if step is None and fallback and plain:
                found, tree = self._restore_local(target, began)
                if found:
                    return tree
            self._restored = None
            # One report for the whole call: a fallback's several restores share it.
            with reporting(progress, "restore"):
                if step == "best":
                    tree = self._restore_best(target, options)
                elif step is not None or not fallback:
                    tree = self._restore_step(target, step, options)
                else:
                    tree = self._restore_latest(target, options)
            self._last_restore = self._persistent_report(tree, target, step, began)
            return tree

    def _restore_best(self, target: T, options: RestoreOptions) -> T:
        return self._ranking.restore_best(
            self._listing,
            lambda entry: self._restore_entry(entry, target, options),
            directory=self.directory,
            metric=self._options.best_metric,
            mode=self._options.mode,
            attempts=self._attempts,
        )
