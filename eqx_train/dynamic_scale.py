"""`DynamicScale`: dynamic loss scaling for mixed-precision gradients, as an Equinox module."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int

__all__ = ["DynamicScale"]

# `value_and_grad` keeps `fun`'s signature; the gradients have the type of its first argument
# (the Equinox convention, as `eqx.filter_grad`).
_X = TypeVar("_X")
_Args = ParamSpec("_Args")

_FLOAT32_MAX = float(jnp.finfo(jnp.float32).max)
_FLOAT32_TINY = float(jnp.finfo(jnp.float32).tiny)


def _float32(x: ArrayLike) -> Array:
    return jnp.asarray(x, dtype=jnp.float32)


def _int32(x: ArrayLike) -> Array:
    return jnp.asarray(x, dtype=jnp.int32)


class DynamicScale(eqx.Module):
    """Dynamic loss scaling: the largest loss multiplier whose gradients stay finite.

    In float16 small gradients flush to zero. Multiplying the loss by a large `scale` before
    differentiating, then dividing the gradients by it, keeps them representable; when the
    scaled gradients overflow (a non-finite value anywhere), the step is reported as not
    finite and the scale shrinks. After `growth_interval` finite steps in a row it grows
    again. The numbers are those of `flax.training.dynamic_scale.DynamicScale`.

    **Fields:**

    - `scale`: float32 scalar array, the current loss multiplier (default `65536.0`).
    - `fin_steps`: int32 scalar array, how many finite steps in a row since the last change.
    - `growth_factor`: multiply `scale` by this after a finite run (static; default 2).
    - `backoff_factor`: multiply `scale` by this after a non-finite step (static; default 0.5).
    - `growth_interval`: grow when a step is finite and `fin_steps` has reached this (static;
      default 2000).
    - `minimum_scale`: `scale` never backs off below this; `None` for no floor (static;
      default the smallest normal float32).

    Every number that changes is an array and every decision is a `jnp.where`, so a
    `DynamicScale` passes through `jax.jit`, `eqx.filter_jit` and `lax.scan` as a carry
    without recompiling.

    **Example:**

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, optax
    import eqx_train

    def to_half(a):
        return a.astype(jnp.float16) if eqx.is_inexact_array(a) else a

    def loss_fn(model, x, y):  # the forward pass in float16, the parameters kept in float32
        half = jax.tree.map(to_half, model)
        return jnp.mean((jax.vmap(half)(x.astype(jnp.float16)) - y) ** 2)

    @eqx.filter_jit
    def train_step(state, scaler, x, y):
        scaler, is_finite, loss, grads = scaler.value_and_grad(loss_fn)(state.model, x, y)
        new_state = state.apply_gradients(grads=grads)
        # Skip the update when the gradients overflowed; the scale has already backed off.
        keep = lambda new, old: jnp.where(is_finite, new, old) if eqx.is_array(new) else new
        return jax.tree.map(keep, new_state, state), scaler, loss

    model = eqx.nn.MLP(4, 1, 32, 2, key=jax.random.key(0))
    state = eqx_train.TrainState.create(model=model, tx=optax.sgd(1e-2))
    scaler = eqx_train.DynamicScale()
    x, y = jnp.ones((64, 4)), jnp.zeros((64, 1))
    for _ in range(20):
        state, scaler, loss = train_step(state, scaler, x, y)
    ```

    !!! note "Differences from flax"
        `value_and_grad` differentiates with respect to the first argument, filtered like
        `eqx.filter_value_and_grad` (so an Equinox model with functions and integer buffers
        can be passed whole), instead of taking `argnums`. The result is a plain tuple in
        flax's order `(dynamic_scale, is_finite, value, grads)`. Bad configuration is refused
        at construction.
    """

    scale: Float[Array, ""] = eqx.field(converter=_float32, default=65536.0)
    fin_steps: Int[Array, ""] = eqx.field(converter=_int32, default=0)
    growth_factor: float | int = eqx.field(static=True, default=2.0)
    backoff_factor: float | int = eqx.field(static=True, default=0.5)
    growth_interval: int = eqx.field(static=True, default=2000)
    minimum_scale: float | int | None = eqx.field(static=True, default=_FLOAT32_TINY)

    def __check_init__(self) -> None:
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int):
            raise TypeError(
                f"DynamicScale: growth_interval must be an int, got {self.growth_interval!r}."
            )
        problems = []
        if not self.growth_factor >= 1:
            problems.append(f"growth_factor must be >= 1, got {self.growth_factor!r}")
        if not 0 < self.backoff_factor <= 1:
            problems.append(f"backoff_factor must be in (0, 1], got {self.backoff_factor!r}")
        if self.growth_interval < 0:
            problems.append(f"growth_interval must be >= 0, got {self.growth_interval!r}")
        if self.minimum_scale is not None and not self.minimum_scale > 0:
            problems.append(f"minimum_scale must be > 0 or None, got {self.minimum_scale!r}")
        if problems:
            raise ValueError("DynamicScale: " + "; ".join(problems) + ".")

    def value_and_grad(
        self,
        fun: Callable[Concatenate[_X, _Args], Any],
        *,
        has_aux: bool = False,
        axis_name: Any = None,
    ) -> Callable[Concatenate[_X, _Args], tuple[DynamicScale, Bool[Array, ""], Any, _X]]:
        """Returns a function computing `fun`'s value and its loss-scaled gradients.

        Like `eqx.filter_value_and_grad`: gradients are taken with respect to the first
        argument, for its floating-point array leaves (other leaves get `None`).

        **Arguments:**

        - `fun`: `fun(x, *args, **kwargs)` returning a scalar loss, or `(loss, aux)` with
          `has_aux=True`.
        - `has_aux`: whether `fun` returns auxiliary output.
        - `axis_name`: average the gradients over this named axis with `lax.pmean` (inside
          `jax.pmap` or `jax.shard_map`). Not needed under `jax.jit` over a mesh, where XLA
          inserts the reduction.

        **Returns:**

        `wrapped(x, *args, **kwargs) -> (dynamic_scale, is_finite, value, grads)`:

        - `dynamic_scale`: the updated `DynamicScale` (new `scale` and `fin_steps`);
        - `is_finite`: boolean scalar array, whether every gradient is finite;
        - `value`: the loss (computed scaled, then divided by `scale`), or `(loss, aux)`;
        - `grads`: the gradients as float32, divided by `scale`, shaped like `x`.

        Jit-safe: no Python branch on any traced value.
        """
        scale = self.scale

        def scaled_fun(x: Any, *args: Any, **kwargs: Any) -> tuple[Array, Any]:
            out = fun(x, *args, **kwargs)
            loss, aux = out if has_aux else (out, None)
            return scale * loss, aux

        grad_fn = eqx.filter_value_and_grad(scaled_fun, has_aux=True)

        def wrapped(x: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
            (scaled_loss, aux), scaled_grads = grad_fn(x, *args, **kwargs)
            loss = scaled_loss / scale
            grads = jax.tree.map(lambda g: _float32(g) / scale, scaled_grads)
            if axis_name is not None:
                grads = jax.lax.pmean(grads, axis_name)
            is_finite = jnp.asarray(True)
            for g in jax.tree.leaves(grads):
                is_finite = is_finite & jnp.all(jnp.isfinite(g))
            value = (loss, aux) if has_aux else loss
            return self._update(is_finite), is_finite, value, grads

        return cast(Any, wrapped)

    def _update(self, is_finite: Bool[Array, ""]) -> DynamicScale:
        """The next scale and finite-step count after a step that was `is_finite`."""
        grow = self.fin_steps == self.growth_interval
        grown = jnp.minimum(self.scale * self.growth_factor, _FLOAT32_MAX)
        on_finite = jnp.where(grow & is_finite, grown, self.scale)
        on_overflow = self.scale * self.backoff_factor
        if self.minimum_scale is not None:  # static configuration, not a traced value
            on_overflow = jnp.maximum(on_overflow, self.minimum_scale)
        new_scale = jnp.where(is_finite, on_finite, on_overflow)
        new_fin_steps = jnp.where(grow | ~is_finite, 0, self.fin_steps + 1)
        return eqx.tree_at(
            lambda s: (s.scale, s.fin_steps),
            self,
            (_float32(new_scale), _int32(new_fin_steps)),
        )
