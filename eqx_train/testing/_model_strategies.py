"""Strategies for what a training loop holds: `eqx.nn` models with their state, and
`TrainState`s of them with Optax optimisers.

Models are built abstractly (`eqx.filter_eval_shape`) and filled with NumPy random values:
initialising a model of a new shape for real compiles JAX's random number code for that
shape, seconds per example, where filling costs microseconds.
"""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from hypothesis import strategies as st

from .._tree import as_weak
from ..train_state import TrainState
from ._array_strategies import Draw

__all__ = ["modules", "train_states"]

_LAYERS = ("linear", "mlp", "conv", "layer_norm", "batch_norm", "dropout", "sequential")
_CHAINABLE = ("linear", "layer_norm", "batch_norm", "dropout")  # features in == features out
_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))

_OPTIMISERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "sgd": lambda: optax.sgd(1e-2),
    "adam": lambda: optax.adam(1e-3),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "adamw": lambda: optax.adamw(1e-3),
    "clipped_adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
}


@contextlib.contextmanager
def _global_random_untouched() -> Iterator[None]:
    """Puts back the `random` module's state: a run-time type checker (beartype, through
    jaxtyping's import hook) checks a container by sampling its items with `random`, and
    hypothesis refuses strategies that change that state. Nothing drawn depends on it."""
    state = random.getstate()
    try:
        yield
    finally:
        random.setstate(state)


def _fill(tree: Any, rng: np.random.Generator, *, non_negative: bool = False) -> Any:
    """Every `ShapeDtypeStruct` of `tree` replaced by a JAX array of random values of its
    shape, dtype and weak type (floats normal, or uniform in [0, 1) if `non_negative`; ints
    0..9). The weak type matters: `eqx.nn.BatchNorm`'s counter is weakly typed, and a model
    drawn here must be one `eqx.nn.make_with_state` could have made."""

    def fill(x: Any) -> Any:
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        dtype = np.dtype(x.dtype)
        if dtype == np.bool_:
            values = rng.integers(0, 2, x.shape).astype(np.bool_)
        elif np.issubdtype(dtype, np.integer):
            values = rng.integers(0, 10, x.shape).astype(dtype)
        else:
            draw = rng.random if non_negative else rng.standard_normal
            values = draw(x.shape).astype(dtype)
        array = jax.device_put(values)  # a transfer; jnp.asarray would run a jitted copy
        return as_weak(array) if getattr(x, "weak_type", False) else array

    return jax.tree.map(fill, tree)


@st.composite
def _layer_spec(draw: Draw, kind: str, features: int) -> tuple[str, dict, int]:
    """The constructor arguments of one layer taking `features` inputs, and its outputs."""
    out = draw(st.integers(1, 4))
    if kind == "linear":
        use_bias = draw(st.booleans())
        return kind, {"in_features": features, "out_features": out, "use_bias": use_bias}, out
    if kind == "mlp":
        width, depth = draw(st.integers(1, 4)), draw(st.integers(0, 2))
        arguments = {"in_size": features, "out_size": out, "width_size": width, "depth": depth}
        return kind, arguments, out
    if kind == "conv":
        arguments = {
            "num_spatial_dims": draw(st.integers(1, 2)),
            "in_channels": features,
            "out_channels": out,
            "kernel_size": draw(st.integers(1, 3)),
        }
        return kind, arguments, out
    if kind == "layer_norm":
        return kind, {"shape": features, "use_weight": draw(st.booleans())}, features
    if kind == "batch_norm":
        arguments = {
            "input_size": features,
            "axis_name": "batch",
            "mode": draw(st.sampled_from(["ema", "batch"])),
            "momentum": draw(st.sampled_from([0.99, 0.9])),
        }
        return kind, arguments, features
    p, inference = draw(st.sampled_from([0.5, 0.1, 0.0])), draw(st.booleans())
    return kind, {"p": p, "inference": inference}, features


@functools.lru_cache(maxsize=512)
def _abstract_model(spec: tuple, dtype_name: str) -> Any:
    """`eqx.nn.make_with_state` of the layers `spec`, `((kind, ((argument, value), ...)),
    ...)` (one layer, or a Sequential), as `ShapeDtypeStruct`s. Cached: shrinking draws the
    same few models over and over, and tracing one costs far more than filling it."""
    specs = [(kind, dict(arguments)) for kind, arguments in spec]
    dtype = np.dtype(dtype_name)
    constructors: dict[str, Callable[..., Any]] = {
        "linear": eqx.nn.Linear,
        "mlp": eqx.nn.MLP,
        "conv": eqx.nn.Conv,
        "layer_norm": eqx.nn.LayerNorm,
        "batch_norm": eqx.nn.BatchNorm,
        "dropout": eqx.nn.Dropout,
    }
    keyed = ("linear", "mlp", "conv")
    typed = ("linear", "mlp", "conv", "layer_norm", "batch_norm")

    def layer(kind: str, arguments: dict, key: jax.Array) -> Any:
        extra = {"key": key} if kind in keyed else {}
        extra |= {"dtype": jnp.dtype(dtype)} if kind in typed else {}
        return constructors[kind](**arguments, **extra)

    def build() -> Any:
        keys = jax.random.split(jax.random.key(0), len(specs))
        pairs = zip(specs, keys, strict=True)
        layers = [layer(kind, arguments, key) for (kind, arguments), key in pairs]
        if len(layers) == 1:
            return eqx.nn.make_with_state(lambda: layers[0])()
        return eqx.nn.make_with_state(eqx.nn.Sequential)(layers)

    return eqx.filter_eval_shape(build)


@st.composite
def _model_spec(draw: Draw) -> tuple[tuple, str]:
    """A model's layers (as `_abstract_model` takes them) and its float dtype."""
    kind = draw(st.sampled_from(_LAYERS))
    features = draw(st.integers(1, 4))
    if kind == "sequential":
        kinds = draw(st.lists(st.sampled_from(_CHAINABLE), min_size=2, max_size=3))
    else:
        kinds = [kind]
    specs = []
    for layer_kind in kinds:
        layer_kind, arguments, features = draw(_layer_spec(layer_kind, features))
        specs.append((layer_kind, tuple(arguments.items())))
    return tuple(specs), draw(st.sampled_from(_FLOAT_DTYPES)).name


@st.composite
def _modules(draw: Draw) -> tuple[Any, eqx.nn.State]:
    spec, dtype_name = draw(_model_spec())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    with _global_random_untouched():
        return _fill(_abstract_model(spec, dtype_name), rng)


@functools.lru_cache(maxsize=512)
def _abstract_train_state(spec: tuple, dtype_name: str, optimiser: str) -> TrainState:
    """`TrainState.create` of a model of `spec` with the optimiser named `optimiser`, as
    `ShapeDtypeStruct`s (but `tx`). Cached, as `_abstract_model` is."""
    model, _ = _fill(_abstract_model(spec, dtype_name), np.random.default_rng(0))
    return eqx.filter_eval_shape(TrainState.create, model=model, tx=_OPTIMISERS[optimiser]())


def modules() -> st.SearchStrategy[tuple[Any, eqx.nn.State]]:
    """Random `eqx.nn` models with their state, as `eqx.nn.make_with_state` returns them:
    pairs `(model, state)`.

    The model is one of `eqx.nn.Linear`, `MLP`, `Conv` (1-d or 2-d), `LayerNorm`,
    `BatchNorm` (`mode="ema"` or `"batch"`), `Dropout`, or a `Sequential` of two or three
    of Linear, LayerNorm, BatchNorm and Dropout; float32 or bfloat16; with random values.
    `state` is an `eqx.nn.State`: BatchNorm's running statistics, or empty. Static fields
    (Linear's sizes) and Python configuration (Dropout's `p` and `inference`) vary too.
    Shrinks towards a float32 `Linear(1, 1)`.

    **Returns:**

    A strategy of `(model, state)` pairs; `.map(lambda pair: pair[0])` for the model alone.
    """
    return _modules()


@st.composite
def _train_states(draw: Draw) -> TrainState:
    spec, dtype_name = draw(_model_spec())
    optimiser = draw(st.sampled_from(list(_OPTIMISERS)))
    seed, step = draw(st.integers(0, 2**32 - 1)), draw(st.integers(0, 10_000))
    rng = np.random.default_rng(seed)
    with _global_random_untouched():
        abstract = _abstract_train_state(spec, dtype_name, optimiser)
        model, _ = _fill(_abstract_model(spec, dtype_name), rng)
        # Non-negative: Adam's second moments must be, or a step would take square roots
        # of negative numbers.
        opt_state = _fill(abstract.opt_state, rng, non_negative=True)
        step = jax.device_put(np.int32(step))
        return abstract.replace(model=model, opt_state=opt_state, step=step)


def train_states() -> st.SearchStrategy[TrainState]:
    """Random `TrainState`s of the models of `modules()` (the model of each pair; its
    `eqx.nn.State` is carried beside a `TrainState`, not in it) with an Optax optimiser
    (SGD, SGD with momentum, Adam, AdamW, gradient clipping chained with Adam), a random
    step and random optimiser statistics. Shrinks towards SGD on a float32 `Linear(1, 1)`
    at step 0.

    **Returns:**

    A strategy of `eqx_train.TrainState`s.
    """
    return _train_states()
