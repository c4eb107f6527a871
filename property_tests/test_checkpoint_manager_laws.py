"""CheckpointManager retention laws over random save histories and random policies."""

import math
import tempfile

import numpy as np
from hypothesis import given, strategies as st

from eqx_train.checkpoints import CheckpointManager

metric = st.one_of(st.none(), st.just(float("nan")), st.floats(-5, 5, allow_nan=False))


def _reference_survivors(files, metrics, keep_latest, keep_best, mode, every_n):
    """The documented policy, written out independently: newest ∪ best ∪ flax picks."""
    files = sorted(files)
    keep = set(files[-keep_latest:])
    usable = [s for s in files if metrics[s] is not None and not math.isnan(metrics[s])]
    sign = 1 if mode == "min" else -1
    usable.sort(key=lambda s: (sign * metrics[s], -s))
    keep.update(usable[:keep_best])
    last = -math.inf
    for s in files[: max(len(files) - keep_latest, 0)]:
        if every_n and s and s - last >= every_n:
            keep.add(s)
            last = s
    return sorted(keep)


@given(
    history=st.lists(st.tuples(st.integers(1, 4), metric), min_size=1, max_size=12),
    keep_latest=st.integers(1, 3),
    keep_best=st.integers(0, 3),
    mode=st.sampled_from(["min", "max"]),
    every_n=st.one_of(st.none(), st.integers(1, 4)),
)
def test_retention_laws(history, keep_latest, keep_best, mode, every_n):
    with tempfile.TemporaryDirectory() as directory:
        manager = CheckpointManager(
            directory,
            keep_latest=keep_latest,
            keep_best=keep_best,
            best_metric="m",
            mode=mode,
            keep_every_n_steps=every_n,
        )
        files: list[int] = []
        metrics: dict[int, float | None] = {}
        ranked: list[int] = []
        survivors: list[int | float] = []
        step = 0
        for gap, value in history:
            step += gap
            manager.save(
                step, {"w": np.asarray(step)}, metrics=None if value is None else {"m": value}
            )
            metrics[step] = value
            files = _reference_survivors(
                files + [step], metrics, keep_latest, keep_best, mode, every_n
            )
            survivors = manager.all_steps()
            saved = sorted(metrics)
            # The newest keep_latest are always there (resuming never breaks).
            assert set(saved[-keep_latest:]) <= set(survivors)
            # The best keep_best by the metric are there; NaN/missing never count.
            numbers = {s: m for s, m in metrics.items() if m is not None and not math.isnan(m)}
            ranked = sorted(numbers, key=lambda s: ((1 if mode == "min" else -1) * numbers[s], -s))
            assert set(ranked[:keep_best]) <= set(survivors)
            # Nothing else survives except keep_every_n_steps picks.
            assert survivors == files
        # restore("best") gives the state saved with the best metric among those kept.
        alive = [s for s in ranked if s in survivors]
        if alive:
            best = manager.restore({"w": np.asarray(0)}, step="best")
            assert int(best["w"]) == alive[0] == manager.best_step()
        else:
            assert manager.best_step() is None
