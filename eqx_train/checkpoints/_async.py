"""`AsyncManager`: one background save at a time, errors re-raised, never lost."""

from __future__ import annotations

import atexit
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

_live_managers: weakref.WeakSet[AsyncManager] = weakref.WeakSet()


class AsyncManager:
    """Runs checkpoint saves in a background thread, one at a time.

    Pass it as `save_checkpoint(..., async_manager=manager)`: the call snapshots the state
    (array leaves by a copy on their own devices, see `save_checkpoint`'s `snapshot`) and
    returns; the leaves are moved to the host, written, committed and old files pruned in
    the background. A new save first waits for the previous one.

    **Arguments:**

    - `max_workers`: accepted for flax compatibility; saves always run one at a time.

    An exception raised by a background save is raised again by the next `save_checkpoint`
    with this manager or by `wait_previous_save()`. If the program exits with a failed save
    that nobody waited for, the error is printed to stderr rather than dropped silently.

    !!! note "Differences from flax"
        The state is snapshotted when `save_checkpoint` is called, so later mutation or
        buffer donation cannot leak into the file.
    """

    def __init__(self, max_workers: int = 1):
        if max_workers < 1:
            raise ValueError(f"AsyncManager: max_workers must be >= 1, got {max_workers}.")
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eqx_train-save")
        self._future: Future[Any] | None = None  # not yet waited for
        self._last: Future[Any] | None = None
        self._lock = threading.Lock()
        _live_managers.add(self)

    @property
    def save_future(self) -> Future[Any] | None:
        """The `concurrent.futures.Future` of the latest background save (None before the
        first), as in flax; `save_future.result()` waits for it."""
        return self._last

    def wait_previous_save(self) -> None:
        """Blocks until the save in flight (if any) is done; raises its exception if it failed."""
        with self._lock:
            future, self._future = self._future, None
        if future is not None:
            future.result()

    def save_async(self, task: Callable[[], Any]) -> None:
        """Waits for the previous save (raising its error), then starts `task` in the background."""
        self.wait_previous_save()
        with self._lock:
            self._future = self._last = self._executor.submit(task)

    def _report_unwaited_failure(self) -> None:
        future = self._future
        if future is None:
            return
        error = future.exception()
        if error is not None:
            print(
                f"eqx_train.checkpoints.AsyncManager: a background checkpoint save failed and "
                f"was never waited for: {type(error).__name__}: {error}",
                file=sys.stderr,
            )


@atexit.register
def _report_failures_at_exit() -> None:
    for manager in list(_live_managers):
        manager._report_unwaited_failure()
