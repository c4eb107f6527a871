"""`AsyncManager`: background saves written one at a time, at most two snapshots queued,
errors re-raised, never lost (not even to an interrupt)."""

from __future__ import annotations

import atexit
import sys
import threading
import weakref
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

_live_managers: weakref.WeakSet[AsyncManager] = weakref.WeakSet()

MAX_QUEUED_SAVES = 2


class AsyncManager:
    """Runs checkpoint saves in a background thread, one at a time.

    Pass it as `save_checkpoint(..., async_manager=manager)`: the call snapshots the state
    (array leaves by a copy on their own devices, see `save_checkpoint`'s `snapshot`) and
    returns; the leaves are moved to the host, written, committed and old files pruned in
    the background.

    A save asked for while the previous one is still being written does not wait for it
    when the memory its snapshot takes allows (the device's for a device copy, the host's
    for a host copy; a CPU state held in place takes none): its snapshot is taken and its
    write queued behind the running one. At most two snapshots are held so, the one being
    written and one queued: a third save waits for the first, and a save that would not
    fit next to the running one's snapshot (or is not for a newer step of the same
    checkpoints, or goes to an object store or a multi-process checkpoint) waits for it;
    the rules of `snapshot` then apply to it as to any save.

    **Arguments:**

    - `max_workers`: accepted for flax compatibility; saves are always written one at a
      time.

    An exception raised by a background save is raised again by the next `save_checkpoint`
    with this manager or by `wait_previous_save()`. If the program exits with a failed save
    that nobody waited for, the error is printed to stderr rather than dropped silently. An
    interrupt (Ctrl-C) while waiting leaves every save tracked: a later
    `wait_previous_save()` still waits for it and raises its error.

    !!! note "Differences from flax"
        The state is snapshotted when `save_checkpoint` is called, so later mutation or
        buffer donation cannot leak into the file. flax blocks every save until the
        previous one is written.
    """

    def __init__(self, max_workers: int = 1):
        if max_workers < 1:
            raise ValueError(f"AsyncManager: max_workers must be >= 1, got {max_workers}.")
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eqx_train-save")
        # Saves not yet waited for, oldest first (the executor runs them in this order), each
        # with where it writes and its step (see `may_queue`).
        self._pending: list[tuple[Future[Any], tuple[Hashable, Any] | None]] = []
        self._last: Future[Any] | None = None
        self._lock = threading.Lock()
        _live_managers.add(self)

    @property
    def save_future(self) -> Future[Any] | None:
        """The `concurrent.futures.Future` of the latest background save (None before the
        first), as in flax; `save_future.result()` waits for it."""
        return self._last

    def wait_previous_save(self) -> None:
        """Blocks until every save in flight or queued is done; raises the exception of the
        first that failed."""
        self.wait_until(0)

    def wait_until(self, most: int) -> None:
        """Blocks until at most `most` saves are unfinished (oldest first), raising the
        exception of a finished one that failed."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                future = self._pending[0][0]
                if len(self._pending) <= most and not future.done():
                    return
            self._wait_for(future)

    def _wait_for(self, future: Future[Any]) -> None:
        # The save stays tracked until its outcome has been taken: an interrupt while
        # waiting (Ctrl-C) leaves it pending, so a later wait still waits and raises.
        try:
            future.result()
        except BaseException as raised:
            if future.done() and not future.cancelled() and future.exception() is raised:
                self._forget(future)  # its own error, raised to the caller now
            raise
        self._forget(future)

    def _forget(self, future: Future[Any]) -> None:
        with self._lock:
            self._pending = [p for p in self._pending if p[0] is not future]

    def in_flight(self) -> int:
        """How many saves are not yet waited for (being written, queued, or failed)."""
        with self._lock:
            return len(self._pending)

    def may_queue(self, where: Hashable, step: Any) -> bool:
        """Whether a save of `step` to checkpoints `where` may be queued behind the saves in
        flight: there is room in the queue, and every save in flight to `where` is of an
        older step (a save that is not newer is refused once those are written, so it waits
        for them and is refused then, as before)."""
        with self._lock:
            return len(self._pending) < MAX_QUEUED_SAVES and all(
                key is not None and (key[0] != where or key[1] < step) for _, key in self._pending
            )

    def save_async(self, task: Callable[[], Any], where: Hashable = None, step: Any = None) -> None:
        """Waits until fewer than two saves are unfinished (raising an error of a finished
        one), then queues `task` (a save of `step` to checkpoints `where`) behind them."""
        self.wait_until(MAX_QUEUED_SAVES - 1)
        with self._lock:
            self._last = self._executor.submit(task)
            self._pending.append((self._last, None if where is None else (where, step)))

    def _report_unwaited_failure(self) -> None:
        with self._lock:
            pending = [future for future, _ in self._pending]
        for future in pending:
            error = future.exception() if future.done() else None
            if error is not None:
                print(
                    f"eqx_train.checkpoints.AsyncManager: a background checkpoint save failed "
                    f"and was never waited for: {type(error).__name__}: {error}",
                    file=sys.stderr,
                )


@atexit.register
def _report_failures_at_exit() -> None:
    for manager in list(_live_managers):
        manager._report_unwaited_failure()
