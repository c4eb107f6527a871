"""Shared helpers for the benchmarks: medians of repeated runs, peak resident memory."""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable

import numpy as np

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """Samples RSS every millisecond while active; reports the peak above the start."""

    def __enter__(self) -> PeakRSS:
        self.start = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def extra_mib(self) -> float:
        return (self.peak - self.start) / 2**20


def median_seconds(run: Callable[[], object], *, repeats: int = 5, number: int = 1) -> float:
    """Median over `repeats` of the mean time of `number` back-to-back calls of `run`."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            run()
        samples.append((time.perf_counter() - start) / number)
    return statistics.median(samples)


def format_table(title: str, header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["", title, "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))
    return "\n".join(lines)


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(format_table(title, header, rows))


def write_and_fsync(path: str, arrays: Iterable[np.ndarray]) -> None:
    """The physical reference of a save: the arrays' bytes written to a new file at `path`,
    one after the other, then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for array in arrays:
            view = np.ascontiguousarray(array).reshape(-1).view(np.uint8).data
            while len(view):
                view = view[os.write(fd, view[: 1 << 30]) :]
        os.fsync(fd)
    finally:
        os.close(fd)
