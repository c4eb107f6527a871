"""What `eqx-train inspect` adds to its listings: each checkpoint of a directory with the
metrics its header holds and the best one marked, and the implementation of each typed
PRNG key (a key's tensor holds only its data)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

from ._text import short
from .checkpoints import engine
from .checkpoints.engine import CheckpointFormatError

Metrics = dict[str, Any] | str | None  # a checkpoint's metrics, or why they are unreadable


def key_lines(reader: engine.Reader) -> list[str]:
    """`typed PRNG keys:` and one line per key: its tensor name and implementation."""
    impls = engine.key_impls(reader.description()) if reader.has_description else {}
    if not impls:
        return []
    width = max(len(name) for name in impls)
    return ["typed PRNG keys:", *(f"  {n:<{width}}  {impl}" for n, impl in sorted(impls.items()))]


def listing_lines(
    listing: list[Any],
    metadata_at: Callable[[str], dict[str, str]],
    best_metric: str | None,
    mode: str,
) -> list[str]:
    """One line per checkpoint of a directory listing: step, layout, name and metrics, the
    best marked `*` by `best_metric` (default: the only metric the checkpoints hold), lowest
    first for `mode="min"`; ties go to the latest step, as `CheckpointManager` ranks them.

    `metadata_at(path)` reads a checkpoint's metadata (its header only)."""
    metrics = [_metrics(metadata_at, entry.path) for entry in listing]
    names = {name for m in metrics if isinstance(m, dict) for name in m}
    metric = best_metric or (next(iter(names)) if len(names) == 1 else None)
    sign = -1.0 if mode == "max" else 1.0

    def score(m: Metrics) -> float:
        value = m.get(metric) if isinstance(m, dict) and metric else None
        if not isinstance(value, int | float) or isinstance(value, bool) or value != value:
            return math.inf  # no such metric, or not a number: never the best
        return sign * float(value)

    scores = [score(m) for m in metrics]
    best = min(range(len(scores)), key=lambda i: (scores[i], -i)) if scores else None
    if best is not None and scores[best] == math.inf:
        best = None
    lines = []
    for i, (entry, m) in enumerate(zip(listing, metrics, strict=True)):
        layout = ".shards" if entry.sharded else "file"
        shown = m if isinstance(m, str) else " ".join(_shown(k, v) for k, v in (m or {}).items())
        mark = "*" if i == best else " "
        line = f"{mark} step {entry.text:<10} {layout:<8} {os.path.basename(entry.path)}  {shown}"
        lines.append(line.rstrip())
    if best is not None:
        lines.append(f"* best by '{metric}' ({mode}): step {listing[best].text}")
    elif names and metric is None:
        lines.append(f"metrics {sorted(names)}: choose the best with --best-metric NAME")
    return lines


def _shown(name: str, value: Any) -> str:
    """`name=value`, a number in `:g` form; anything else a header may hold (written by
    another tool or version) as its repr, rather than failing the whole listing."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return f"{name}={value:g}" if number else f"{name}={short(value, 40)}"


def _metrics(metadata_at: Callable[[str], dict[str, str]], path: str) -> Metrics:
    try:
        raw = metadata_at(path).get(engine.METRICS_KEY)
        value = None if raw is None else engine.parse_json(raw, "the metrics", ValueError)
    except (OSError, ValueError, CheckpointFormatError) as error:
        return f"(unreadable: {short(' '.join(str(error).split()), 80)})"
    return value if isinstance(value, dict) else None
