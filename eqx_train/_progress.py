"""How long transfers show their progress (`progress=` on saves and restores).

A public call that takes `progress=` opens one report for its transfer
(`with reporting(progress, "restore"):`). The code that moves the bytes, however far below,
declares what it is about to move (`expect(nbytes)`) and what it has moved (`advance(nbytes)`);
both cost one context-variable lookup when no report is open, so a call without `progress=`
pays nothing measurable.

A report goes to a tqdm bar on stderr (`progress=True`: bytes, rate and ETA, drawn only once
the transfer has taken about a second) or to the caller's function `(done_bytes, total_bytes)`.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeAlias

from ._text import short

Progress: TypeAlias = bool | Callable[[int, int], Any] | None
"""`progress=`: None or False (no report), True (a tqdm bar on stderr), or a function called
as `fn(done_bytes, total_bytes)` as the transfer goes."""

# A bar is drawn only for a transfer that is still running after this many seconds.
BAR_DELAY_S = 1.0


def check_progress(progress: Any, call: str) -> None:
    """Refuses a `progress=` that is neither None, a bool nor a callable, and `True` where
    tqdm is not installed; `call` names the public call in the message."""
    if progress is None or isinstance(progress, bool) or callable(progress):
        if progress is True:
            try:
                import tqdm  # noqa: F401
            except ImportError:
                raise ImportError(
                    f"{call}: progress=True draws a tqdm bar, and tqdm is not installed: "
                    "pip install tqdm, or pass a function (done_bytes, total_bytes) -> None."
                ) from None
        return
    raise TypeError(
        f"{call}: progress must be None, True/False or a function (done_bytes, total_bytes) "
        f"-> None, got {short(progress)}."
    )


class _Report:
    """One transfer's counts, shared by the threads that move its bytes."""

    def __init__(self, sink: Callable[[int, int], Any]):
        self._sink = sink
        self._lock = threading.Lock()
        self.done = 0
        self.total = 0

    def expect(self, nbytes: int) -> None:
        with self._lock:
            self.total += nbytes
            done, total = self.done, self.total
        self._sink(done, total)

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            done, total = self.done, self.total
        self._sink(done, total)


_REPORT: contextvars.ContextVar[_Report | None] = contextvars.ContextVar(
    "eqx_train_progress", default=None
)


def _bar_sink(what: str) -> tuple[Callable[[int, int], None], Callable[[], None]]:
    from tqdm.auto import tqdm

    bar = tqdm(
        desc=what,
        total=0,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        delay=BAR_DELAY_S,
        file=sys.stderr,
        leave=False,
    )

    def sink(done: int, total: int) -> None:
        bar.total = total  # shown with the next update, once the bar is drawn at all
        bar.update(done - bar.n)

    return sink, bar.close


@contextlib.contextmanager
def reporting(progress: Progress, what: str) -> Iterator[None]:
    """Within this block (in this thread), `expect` and `advance` report to `progress`
    (checked by `check_progress` first). An outer report wins, so that a manager's restore
    and the restore it runs show one bar."""
    if progress is None or progress is False or _REPORT.get() is not None:
        yield
        return
    if progress is True:
        sink, close = _bar_sink(what)
    else:
        sink, close = progress, lambda: None
    token = _REPORT.set(_Report(sink))
    try:
        yield
    finally:
        _REPORT.reset(token)
        close()


def expect(nbytes: int) -> None:
    """Adds `nbytes` about to be moved to the open report's total (nothing if none)."""
    report = _REPORT.get()
    if report is not None:
        report.expect(nbytes)


def advance(nbytes: int) -> None:
    """Counts `nbytes` moved in the open report (nothing if none)."""
    report = _REPORT.get()
    if report is not None:
        report.advance(nbytes)
