"""flax's image-classification learning-rate schedules, as jit- and vmap-safe Optax schedules.

Each factory returns an `optax.Schedule`: `schedule(step) -> learning rate`, elementwise in
`step`, so it accepts a Python int, a scalar array or an array of steps, inside or outside
`jax.jit` and `jax.vmap`, and can be passed directly to an Optax optimiser.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, ArrayLike, Float

__all__ = [
    "create_constant_learning_rate_schedule",
    "create_cosine_learning_rate_schedule",
    "create_stepped_learning_rate_schedule",
]


def _check_finite(name: str, value: object, *, positive: bool = False) -> float:
    """Returns `value` as a float after checking it is a finite real (> 0 if `positive`).
    Takes `object`: it is the check that runs on unvalidated user input."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}.")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}.")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}.")
    return float(value)


def _check_common(
    base_learning_rate: object, steps_per_epoch: object, warmup_length: object
) -> None:
    _check_finite("base_learning_rate", base_learning_rate)
    _check_finite("steps_per_epoch", steps_per_epoch, positive=True)
    if _check_finite("warmup_length", warmup_length) < 0:
        raise ValueError(f"warmup_length must be >= 0 epochs, got {warmup_length!r}.")


def _warmup(
    lr: Float[Array, "..."], step: Any, warmup_length: float | int, steps_per_epoch: int | float
) -> Float[Array, "..."]:
    # Same operation order as flax so that the float32 results agree.
    if warmup_length > 0.0:
        return lr * jnp.minimum(1.0, step / float(warmup_length) / steps_per_epoch)
    return lr


def _as_step(step: ArrayLike) -> Any:
    # A Python number stays one, so its angle/ratio is computed in float64 exactly as flax
    # does before the single rounding to float32; arrays are computed in their own dtype.
    if isinstance(step, int | float) and not isinstance(step, bool):
        return step
    return jnp.asarray(step)


def create_constant_learning_rate_schedule(
    base_learning_rate: float | int, steps_per_epoch: int | float, warmup_length: float | int = 0.0
) -> optax.Schedule:
    """Returns a constant schedule with an optional linear warm-up.

    **Arguments:**

    - `base_learning_rate`: the learning rate after warm-up.
    - `steps_per_epoch`: optimiser steps per epoch (> 0).
    - `warmup_length`: epochs over which the rate ramps linearly from 0 to
      `base_learning_rate` (0 for none). See [Goyal et al. 2017](https://arxiv.org/abs/1706.02677).

    **Returns:**

    `schedule(step) -> lr`, a float32 array with the shape of `step`.

    !!! note "Differences from flax"
        Without warm-up flax returns the Python float itself; this returns an array shaped
        like `step`. Arguments are validated when the schedule is created.
    """
    _check_common(base_learning_rate, steps_per_epoch, warmup_length)

    def schedule(step: ArrayLike) -> Float[Array, "..."]:
        step = _as_step(step)
        lr = jnp.full(jnp.shape(step), base_learning_rate, dtype=jnp.float32)
        return _warmup(lr, step, warmup_length, steps_per_epoch)

    return schedule


def create_stepped_learning_rate_schedule(
    base_learning_rate: float | int,
    steps_per_epoch: int | float,
    lr_sched_steps: Sequence[Sequence[float | int]],
    warmup_length: float | int = 0.0,
) -> optax.Schedule:
    """Returns a piecewise-constant schedule that multiplies the rate at given epochs.

    **Arguments:**

    - `base_learning_rate`: the rate before the first boundary.
    - `steps_per_epoch`: optimiser steps per epoch (> 0).
    - `lr_sched_steps`: `[[epoch, factor], ...]` with increasing epochs; from step
      `round(epoch * steps_per_epoch) + 1` on, the rate is `base_learning_rate * factor`
      (flax's boundary rule: a boundary step itself still has the previous rate). ImageNet's
      classic schedule is `[[30, 0.1], [60, 0.01], [80, 0.001]]`.
    - `warmup_length`: epochs of linear warm-up (0 for none).

    **Returns:**

    `schedule(step) -> lr`, elementwise in `step`.

    !!! note "Differences from flax"
        flax compares the whole boundary list with `step` at once, so an array of steps (or
        `jax.vmap`) gives a wrong answer; this schedule is elementwise.
    """
    _check_common(base_learning_rate, steps_per_epoch, warmup_length)
    epochs: list[float] = []
    factors: list[float] = []
    for i, entry in enumerate(lr_sched_steps):
        if len(entry) != 2:
            raise ValueError(
                f"lr_sched_steps[{i}] must be an [epoch, lr_factor] pair, got {entry!r}."
            )
        epoch, factor = entry
        _check_finite(f"lr_sched_steps[{i}][0] (epoch)", epoch)
        _check_finite(f"lr_sched_steps[{i}][1] (lr_factor)", factor)
        if epochs and epoch < epochs[-1]:
            raise ValueError(
                f"lr_sched_steps epochs must be non-decreasing, but entry {i} has epoch {epoch} "
                f"after {epochs[-1]}."
            )
        epochs.append(float(epoch))
        factors.append(float(factor))
    boundaries = jnp.asarray(
        np.round(np.asarray(epochs, dtype=np.float64) * steps_per_epoch).astype(np.int32)
    )
    values = jnp.asarray(np.asarray([1.0, *factors]) * base_learning_rate, dtype=jnp.float32)

    def schedule(step: ArrayLike) -> Float[Array, "..."]:
        step = _as_step(step)
        index = jnp.sum(boundaries < jnp.asarray(step)[..., None], axis=-1)
        return _warmup(values[index], step, warmup_length, steps_per_epoch)

    return schedule


def create_cosine_learning_rate_schedule(
    base_learning_rate: float | int,
    steps_per_epoch: int | float,
    halfcos_epochs: float | int,
    warmup_length: float | int = 0.0,
) -> optax.Schedule:
    """Returns a half-cosine decay from `base_learning_rate` to 0, with an optional warm-up.

    `lr(step) = base_learning_rate * (0.5 * cos(pi * step / (halfcos_epochs * steps_per_epoch))
    + 0.5)`, times the warm-up factor. Past the half wave the cosine rises again, as in flax.

    **Arguments:**

    - `base_learning_rate`: the rate at step 0 (before warm-up).
    - `steps_per_epoch`: optimiser steps per epoch (> 0).
    - `halfcos_epochs`: epochs to complete the half wave (> 0), usually the training length.
    - `warmup_length`: epochs of linear warm-up (0 for none).

    **Returns:**

    `schedule(step) -> lr`, elementwise in `step`.
    """
    _check_common(base_learning_rate, steps_per_epoch, warmup_length)
    _check_finite("halfcos_epochs", halfcos_epochs, positive=True)
    halfwavelength_steps = halfcos_epochs * steps_per_epoch

    def schedule(step: ArrayLike) -> Float[Array, "..."]:
        step = _as_step(step)
        scale = jnp.cos(step * jnp.pi / halfwavelength_steps) * 0.5 + 0.5
        lr = jnp.asarray(base_learning_rate * scale, dtype=jnp.float32)
        return _warmup(lr, step, warmup_length, steps_per_epoch)

    return schedule
