"""`EarlyStopping`: flax's early-stopping rule as a jit-, scan- and vmap-safe Equinox module."""

from __future__ import annotations

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

__all__ = ["EarlyStopping"]


def _concrete(value: ArrayLike) -> np.ndarray | None:
    """The value as NumPy when it is known now (not a tracer), else None."""
    try:
        return np.asarray(value)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


class EarlyStopping(eqx.Module):
    """Stops training when a metric has stopped improving, as `flax.training.early_stopping`.

    Every numeric field is a JAX array and `update` has no Python branch on values, so a
    stopper can be updated inside `jax.jit`, carried through `jax.lax.scan`, batched with
    `jax.vmap` (e.g. several `min_delta`s at once) and saved in a checkpoint.

    **Arguments:**

    - `min_delta`: the smallest change of the metric that counts as an improvement.
    - `patience`: how many updates without improvement are tolerated before stopping.
    - `best_metric`: the best value seen so far; `inf` (`-inf` for `mode="max"`) by default.
    - `patience_count`: updates since the last improvement.
    - `should_stop`: whether the training loop should stop.
    - `has_improved`: whether the last `update` improved on `best_metric` by more than
      `min_delta`.
    - `mode`: `"min"` (a lower metric is better, flax's only behaviour) or `"max"`.

    **Example** (the flax documentation's example; it stops at epoch 7):

    ```python
    stopper = EarlyStopping(min_delta=1e-3, patience=2)
    for epoch, loss in enumerate([4, 3, 3, 3, 2, 2, 2, 2, 1, 1]):
        stopper = stopper.update(loss)
        if stopper.should_stop:
            break
    ```

    !!! note "Differences from flax"
        Fields are arrays rather than Python scalars (`bool(stopper.should_stop)` in Python
        code). `mode="max"` is new. A NaN metric never counts as an improvement and never
        becomes `best_metric` (in flax, a NaN first metric becomes the best and then nothing
        ever improves on it). Negative `patience`/`min_delta` and unknown modes are rejected.
    """

    min_delta: Float[Array, ""]
    patience: Int[Array, ""]
    best_metric: Float[Array, ""]
    patience_count: Int[Array, ""]
    should_stop: Bool[Array, ""]
    has_improved: Bool[Array, ""]
    mode: Literal["min", "max"] = eqx.field(static=True)

    def __init__(
        self,
        min_delta: ArrayLike = 0.0,
        patience: ArrayLike = 0,
        best_metric: ArrayLike | None = None,
        patience_count: ArrayLike = 0,
        should_stop: ArrayLike = False,
        has_improved: ArrayLike = False,
        *,
        mode: Literal["min", "max"] = "min",
    ):
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping: mode must be 'min' or 'max', got {mode!r}.")
        for name, value in (("min_delta", min_delta), ("patience", patience)):
            known = _concrete(value)
            if known is not None and np.any(known < 0):
                raise ValueError(f"EarlyStopping: {name} must be >= 0, got {known.tolist()}.")
        if best_metric is None:
            best_metric = jnp.inf if mode == "min" else -jnp.inf
        self.mode = mode
        self.min_delta = jnp.asarray(min_delta, dtype=float)
        self.patience = jnp.asarray(patience, dtype=jnp.int32)
        self.best_metric = jnp.asarray(best_metric, dtype=float)
        self.patience_count = jnp.asarray(patience_count, dtype=jnp.int32)
        self.should_stop = jnp.asarray(should_stop, dtype=bool)
        self.has_improved = jnp.asarray(has_improved, dtype=bool)

    def update(self, metric: ArrayLike) -> EarlyStopping:
        """Returns the stopper after observing `metric`.

        An improvement is a metric better than `best_metric` by more than `min_delta` (or any
        non-NaN metric while `best_metric` is infinite, as in flax): it becomes the best and
        resets `patience_count`. Otherwise `should_stop` becomes true once `patience_count`
        has reached `patience` (and stays true), and `patience_count` grows by one.

        **Arguments:**

        - `metric`: a scalar (Python number or array; traced values are fine).

        **Returns:**

        A new `EarlyStopping`; `self` is unchanged.
        """
        metric = jnp.asarray(metric, dtype=self.best_metric.dtype)
        gain = self.best_metric - metric if self.mode == "min" else metric - self.best_metric
        improved = (jnp.isinf(self.best_metric) | (gain > self.min_delta)) & ~jnp.isnan(metric)
        should_stop = jnp.where(
            improved, self.should_stop, (self.patience_count >= self.patience) | self.should_stop
        )
        return eqx.tree_at(
            lambda s: (s.best_metric, s.patience_count, s.should_stop, s.has_improved),
            self,
            (
                jnp.where(improved, metric, self.best_metric),
                jnp.where(improved, 0, self.patience_count + 1).astype(jnp.int32),
                should_stop,
                improved,
            ),
        )

    def reset(self) -> EarlyStopping:
        """Returns a stopper with the same settings and no history (best metric at +-inf)."""
        best = jnp.inf if self.mode == "min" else -jnp.inf
        return eqx.tree_at(
            lambda s: (s.best_metric, s.patience_count, s.should_stop, s.has_improved),
            self,
            (
                jnp.full_like(self.best_metric, best),
                jnp.zeros_like(self.patience_count),
                jnp.zeros_like(self.should_stop),
                jnp.zeros_like(self.has_improved),
            ),
        )
