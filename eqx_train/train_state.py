"""`TrainState`: step counter, model, optimiser state and optimiser as one Equinox module."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeAlias, TypeVar, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jaxtyping import Array, Int, PyTree

from ._tree import leaves_with_names

__all__ = ["TrainState"]


class _AnyModel(Any):
    """The model type of a `TrainState` written without one (`TrainState`, or a subclass of
    it): as permissive as `Any`, but a type of its own, so that `create` can tell "called on
    the bare class" (infer the model's type from `model=`) from "called on a subclass that
    fixed it" (return that subclass)."""


# The model's type: `TrainState[eqx.nn.MLP]` has `state.model: eqx.nn.MLP`. Covariant (a
# state is immutable), so a `TrainState[eqx.nn.MLP]` is a `TrainState[eqx.Module]`.
# The default is for type checkers only: a run-time checker (beartype under jaxtyping's
# import hook) takes a TypeVar's default as the type every model must be an instance of.
if TYPE_CHECKING:
    from typing_extensions import TypeVar as _TypeVarWithDefault

    M = _TypeVarWithDefault("M", covariant=True, default=_AnyModel)
else:
    M = TypeVar("M", covariant=True)
_Model = TypeVar("_Model")  # the model passed to `create` on the bare class
# What `create`, `replace` and `apply_gradients` return: the class they were called on, with
# its model type (a TypeVar rather than `typing.Self`, which run-time checkers refuse
# outside their own decorated classes).
_State = TypeVar("_State", bound="TrainState[Any]")
_MISSING: Any = object()  # `create`'s `model` when omitted (None is a valid pytree)
# `trainable`: a filter function, or a filter_spec pytree of bools and filter functions
# (checked as such at run time; a type checker sees jaxtyping's `PyTree` as unknown).
if TYPE_CHECKING:
    _Trainable: TypeAlias = Callable[[Any], bool] | Any
else:
    _Trainable = Callable[[Any], bool] | PyTree[bool | Callable[[Any], bool]]


def _describe_mismatch(grads: PyTree, params: PyTree) -> str:
    grad_names = {name for name, _ in leaves_with_names(grads)[0]}
    param_names = {name for name, _ in leaves_with_names(params)[0]}
    missing = sorted(param_names - grad_names)
    extra = sorted(grad_names - param_names)
    parts = []
    if missing:
        parts.append(f"no gradient for trainable leaves {missing}")
    if extra:
        parts.append(f"gradients for leaves that are not trainable {extra}")
    if not parts:
        parts.append(
            f"the trees differ in structure: grads {jax.tree.structure(grads)} "
            f"vs trainable params {jax.tree.structure(params)}"
        )
    return "; ".join(parts)


def _check_tx_and_filter(tx: Any, trainable: Any) -> None:
    if not callable(getattr(tx, "init", None)) or not callable(getattr(tx, "update", None)):
        raise TypeError(
            "TrainState: `tx` must be an optax.GradientTransformation (with `init` and "
            f"`update`), got {type(tx).__name__} {tx!r}."
        )
    if _is_filter_function(trainable):
        return
    bad = [x for x in jtu.tree_leaves(trainable) if not (isinstance(x, bool) or callable(x))]
    if bad:
        raise TypeError(
            "TrainState: `trainable` must be a filter function leaf -> bool, or a filter_spec "
            "pytree (a prefix of `model` whose leaves are bools or filter functions, e.g. "
            f"built with eqx.tree_at); it holds {type(bad[0]).__name__} {bad[0]!r}."
        )


def _is_filter_function(trainable: Any) -> bool:
    """A function applied to every leaf, as opposed to a filter_spec pytree. An Equinox
    module is callable but is a pytree (a filter_spec built from the model), as in
    `eqx.filter`."""
    return callable(trainable) and not isinstance(trainable, eqx.Module)


def _trainable_mask(trainable: Any, model: PyTree) -> PyTree:
    """A bool per leaf of `model`: whether `tx` updates it.

    A filter function decides alone (as always); a filter_spec pytree says True or False (or
    gives a function) for each of its leaves' subtrees of `model`, and of the leaves it marks
    True only floating-point arrays are trained: an activation function or an integer buffer
    under a True is left alone, as by the default filter.
    """
    if _is_filter_function(trainable):
        return jtu.tree_map(trainable, model)

    def resolve(spec: Any, subtree: PyTree) -> PyTree:
        choose = spec if callable(spec) else (lambda _: spec)
        return jtu.tree_map(lambda x: bool(choose(x)) and eqx.is_inexact_array(x), subtree)

    try:
        return jtu.tree_map(resolve, trainable, model)
    except ValueError as error:
        raise ValueError(
            "TrainState: the filter_spec `trainable` is not a prefix of `model` (build it from "
            "the model, e.g. jax.tree.map(lambda _: True, model) then eqx.tree_at to set "
            f"False where frozen): {str(error).splitlines()[0]}"
        ) from None


class TrainState(eqx.Module, Generic[M]):
    """A training state for the common case of one model and one Optax optimiser.

    The Equinox counterpart of `flax.training.train_state.TrainState`. It is a pytree, so it
    passes through `eqx.filter_jit`, `jax.lax.scan` and checkpoints as one object, and every
    number in it is an array, so a jitted training step compiles once.

    **Fields:**

    - `step`: int32 scalar array, 0 at creation, incremented by `apply_gradients`.
    - `model`: any pytree: a params dict, or an Equinox model that also holds non-array leaves
      such as activation functions.
    - `opt_state`: the state of `tx`, initialised on the trainable leaves of `model`.
    - `tx`: the `optax.GradientTransformation` (a static field).
    - `trainable`: which leaves `tx` updates (a static field): a filter function
      (`eqx.is_inexact_array` by default, so integer buffers and functions are left alone),
      or a filter_spec pytree as `eqx.filter` takes, to freeze layers (below).

    **Example:**

    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    from eqx_train import TrainState

    key = jax.random.key(0)
    state = TrainState.create(model=eqx.nn.MLP(2, 2, 32, 2, key=key), tx=optax.adam(1e-3))

    def loss_fn(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    @eqx.filter_jit
    def train_step(state, x, y):
        grads = eqx.filter_grad(loss_fn)(state.model, x, y)
        return state.apply_gradients(grads=grads)

    state = train_step(state, jnp.ones((4, 2)), jnp.zeros((4, 2)))
    assert int(state.step) == 1
    ```

    **Typed code:** `TrainState` is generic in its model: `TrainState.create(model=mlp,
    tx=tx)` is a `TrainState[eqx.nn.MLP]` for a type checker, so `state.model` keeps the
    model's type through `apply_gradients` and `replace` (see the API page's "Typed code").

    **Subclassing:** add fields for anything else the loop carries (batch statistics, an EMA
    copy of the model) and pass them to `create` as keyword arguments:

    ```python
    import equinox as eqx
    import jax
    import optax
    from jaxtyping import PyTree
    from eqx_train import TrainState

    class EMATrainState(TrainState):
        ema_model: PyTree

    model, tx = eqx.nn.Linear(2, 2, key=jax.random.key(0)), optax.sgd(0.1)
    grads = jax.tree.map(jax.numpy.ones_like, eqx.filter(model, eqx.is_array))
    state = EMATrainState.create(model=model, tx=tx, ema_model=model)
    new_ema = jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, state.ema_model, state.model)
    state = state.apply_gradients(grads=grads, ema_model=new_ema)
    ```

    **Freezing layers:** pass a filter_spec: a pytree shaped like the model (or a prefix of
    it) of bools or filter functions, False where frozen, built the Equinox way with
    `eqx.tree_at`. Frozen leaves are never updated and get no optimiser state (an Adam
    freezing half the model allocates half the moments); gradients at them are ignored.

    ```python
    import equinox as eqx
    import jax
    import optax
    from eqx_train import TrainState

    model = eqx.nn.MLP(2, 2, 8, 2, key=jax.random.key(0))
    frozen_first = eqx.tree_at(
        lambda m: m.layers[0], jax.tree.map(lambda _: True, model), replace=False
    )
    state = TrainState.create(model=model, tx=optax.adam(1e-3), trainable=frozen_first)
    grads = jax.tree.map(jax.numpy.ones_like, eqx.filter(model, eqx.is_array))
    state = state.apply_gradients(grads=grads)
    assert (state.model.layers[0].weight == model.layers[0].weight).all()
    assert state.opt_state[0].mu.layers[0].weight is None  # no moments for frozen leaves
    ```

    `optax.multi_transform` is the other way: it keeps every leaf in the optimiser and
    gives the frozen ones `optax.set_to_zero()` (their updates are zero, and a label tree
    chooses a transformation per leaf, e.g. a different learning rate per layer).
    `trainable` is the way when frozen leaves should cost nothing; `multi_transform` when
    different leaves need different optimisers.

    **`tx` is part of the state's structure.** It is a static field, so two states are the
    same pytree type only if their `tx` is the same object: two calls of `optax.adam(1e-3)`
    make two different functions. Build the optimiser once and use it for every state of
    the run: restore into a state created with the same `tx`, and do not build a new one
    inside a step (an `eqx.filter_jit` step would compile again on every call). `jit_step`,
    `pmap_step` and `apply_gradients` say so when they meet a state with another `tx`.

    !!! note "Differences from flax"
        There is no `apply_fn`: an Equinox model is callable. `params` is kept as a read-only
        alias of `model` (so `create(apply_fn=, params=, tx=)` raises, explaining the
        mapping). `state.replace(**fields)` works as in flax. `step` is an int32 array
        rather than a Python int, so `filter_jit` does not retrace every step.
    """

    step: Int[Array, ""]
    model: M
    opt_state: optax.OptState
    tx: optax.GradientTransformation = eqx.field(static=True)
    trainable: _Trainable = eqx.field(static=True)

    def __check_init__(self) -> None:
        _check_tx_and_filter(self.tx, self.trainable)

    # Called on the bare class, `create` infers the model's type from `model=`
    # (`TrainState.create(model=mlp, tx=tx)` is a `TrainState[eqx.nn.MLP]`); called on a
    # subclass, or with a subclass's extra fields, it returns that class. A type checker
    # cannot solve a class's type parameter from a classmethod's arguments, hence the two.
    @overload
    @classmethod
    def create(
        cls: type[TrainState[_AnyModel]],
        *,
        model: _Model,
        tx: optax.GradientTransformation,
        trainable: _Trainable = eqx.is_inexact_array,
    ) -> TrainState[_Model]: ...

    @overload
    @classmethod
    def create(
        cls: type[_State],
        *,
        model: Any = _MISSING,
        tx: optax.GradientTransformation,
        trainable: _Trainable = eqx.is_inexact_array,
        **kwargs: Any,
    ) -> _State: ...

    @classmethod
    def create(
        cls,
        *,
        model: Any = _MISSING,
        tx: optax.GradientTransformation,
        trainable: _Trainable = eqx.is_inexact_array,
        **kwargs: Any,
    ) -> Any:
        """Returns a new state with `step=0` and `opt_state = tx.init(trainable leaves)`.

        **Arguments:**

        - `model`: the params pytree or Equinox model to train (required).
        - `tx`: the Optax optimiser.
        - `trainable`: which leaves `tx` sees: a filter function (default
          `eqx.is_inexact_array`) or a filter_spec pytree, False where frozen (frozen leaves
          get no optimiser state).
        - `**kwargs`: values for the extra fields of a subclass.

        **Returns:**

        A `TrainState[type of model]`, or the subclass `create` was called on (see "Typed
        code" above for what a type checker infers).

        **Raises:**

        `TypeError` for flax's keywords `params=` / `apply_fn=` (saying what to pass
        instead), a missing `model`, and keywords that are not fields of the class.
        """
        _check_flax_keywords(cls, model, kwargs)
        _check_tx_and_filter(tx, trainable)
        opt_state = tx.init(eqx.filter(model, _trainable_mask(trainable, model)))
        return cls(
            step=jnp.asarray(0, dtype=jnp.int32),
            model=model,
            opt_state=opt_state,
            tx=tx,
            trainable=trainable,
            **kwargs,
        )

    def replace(self: _State, **fields: Any) -> _State:
        """Returns a copy of the state with `fields` replaced: flax's `state.replace(...)`.

        Nothing is recomputed: replacing `model` keeps `opt_state` as it is (as in flax),
        and `tx`/`trainable` are checked as at creation. Works inside `jit`.

        **Arguments:**

        - `**fields`: new values by field name (`step`, `model`, `opt_state`, `tx`,
          `trainable`, or a subclass's fields).

        **Returns:**

        A new state of the same class; `self` is unchanged.

        **Raises:**

        `TypeError` naming the unknown field(s) and listing the valid ones. flax's
        `params=` is read as `model=` would not be: it raises, saying to pass `model=`.

        ```python
        import jax, optax
        from eqx_train import TrainState

        state = TrainState.create(model={"w": jax.numpy.ones(3)}, tx=optax.sgd(0.1))
        later = state.replace(step=state.step + 10)
        assert int(later.step) == 10 and int(state.step) == 0
        ```
        """
        if "params" in fields and "params" not in _field_names(self):
            raise TypeError(
                f"{type(self).__name__}.replace: flax's `params` is the field `model` here; "
                "call state.replace(model=...)."
            )
        new = _replace(self, tuple(fields), tuple(fields.values()))
        if "tx" in fields or "trainable" in fields:
            _check_tx_and_filter(new.tx, new.trainable)
        return new

    @property
    def params(self) -> M:
        """The model, under the name flax users know (`state.params`)."""
        return self.model

    def apply_gradients(self: _State, *, grads: Any, **kwargs: Any) -> _State:
        """Returns a new state with `tx` applied to `grads` and `step + 1`.

        Runs `tx.update(grads, opt_state, params)` then `optax.apply_updates`, exactly as flax
        does, on the trainable leaves only; the other leaves of `model` are carried over.

        **Arguments:**

        - `grads`: gradients shaped like `model`: the output of `jax.grad` on a params dict,
          or of `eqx.filter_grad` on an Equinox model (with `None` at non-array leaves).
          Gradients at leaves that `trainable` rejects are ignored.
        - `**kwargs`: other fields to replace in the new state (e.g. a subclass's
          `batch_stats`).

        **Returns:**

        The updated state. Pure and jit-safe: nothing is mutated.
        """
        mask = _trainable_mask(self.trainable, self.model)
        params, frozen = eqx.partition(self.model, mask)
        try:
            trainable_grads = eqx.filter(grads, mask)
        except ValueError:
            raise ValueError(
                "TrainState.apply_gradients: `grads` does not have the structure of `model`: "
                f"{_describe_mismatch(eqx.filter(grads, eqx.is_array), params)}."
            ) from None
        if jax.tree.structure(trainable_grads) != jax.tree.structure(params):
            raise ValueError(
                "TrainState.apply_gradients: `grads` does not match the trainable leaves of "
                f"`model`: {_describe_mismatch(trainable_grads, params)}."
            )
        try:
            updates, new_opt_state = self.tx.update(trainable_grads, self.opt_state, params)
        # An optimiser's update meeting a state it did not make fails in whatever way it
        # reads it (a structure mismatch, a missing attribute such as `trace`, an index).
        except (ValueError, TypeError, AttributeError, KeyError, IndexError):
            _check_opt_state(self.tx, self.opt_state, params)
            raise
        # An update may also accept a state it did not make and return another structure
        # (Adam's moments meeting a None gradient, in some optax code paths): never let
        # that pass silently into the next step.
        if jax.tree.structure(new_opt_state) != jax.tree.structure(self.opt_state):
            _check_opt_state(self.tx, self.opt_state, params)
        new_params = optax.apply_updates(params, updates)
        new_model = eqx.combine(new_params, frozen)
        names = ("step", "model", "opt_state", *kwargs)
        values = (self.step + 1, new_model, new_opt_state, *kwargs.values())
        return _replace(self, names, values)


def _check_opt_state(tx: Any, opt_state: PyTree, params: PyTree) -> None:
    """Raises our error when `opt_state` is not the state `tx` makes for `params` (a model
    changed by `eqx.tree_at` after `create`, or an `opt_state` from another state)."""
    expected = jax.eval_shape(tx.init, params)
    if jax.tree.structure(expected) == jax.tree.structure(opt_state):
        return
    want = {f"opt_state.{n}": x for n, x in leaves_with_names(expected)[0]}
    have = {f"opt_state.{n}": x for n, x in leaves_with_names(opt_state)[0]}
    if set(want) != set(have):
        missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
        difference = f"it lacks {missing[:3]}" if missing else ""
        difference += "; " if missing and extra else ""
        difference += f"it has {extra[:3]}, which tx.init does not make" if extra else ""
    else:
        shapes = [
            f"'{n}' is {jnp.shape(have[n])}, tx.init makes {want[n].shape}"
            for n in want
            if jnp.shape(have[n]) != want[n].shape
        ]
        difference = shapes[0] if shapes else "their static fields differ"
    raise ValueError(
        "TrainState.apply_gradients: `opt_state` is not what `tx` makes for the trainable "
        f"leaves of `model` ({difference}): the model was changed after `create` (e.g. by "
        "eqx.tree_at), `tx` or `trainable` was replaced without a new `opt_state`, or the "
        "state holds another state's `opt_state`. Build the state again with "
        "TrainState.create(model=new_model, tx=tx) (a new `tx` needs its own `opt_state`)."
    )


def _field_names(cls_or_module: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(cls_or_module)]


def _check_flax_keywords(cls: type, model: Any, kwargs: dict[str, Any]) -> None:
    """flax's `create(apply_fn=, params=, tx=)` maps onto `create(model=, tx=)`: say so."""
    fields = _field_names(cls)
    flax_only = [k for k in ("apply_fn", "params") if k in kwargs and k not in fields]
    if flax_only:
        raise TypeError(
            f"{cls.__name__}.create got flax's keyword(s) {flax_only}. Here `model=` takes "
            "what flax calls `params` (a params pytree, or an Equinox model, which is its own "
            "apply function), and there is no `apply_fn`: call the model, or keep the apply "
            "function outside the state (or add a static field for it in a subclass). "
            f"Call {cls.__name__}.create(model=params_or_model, tx=tx)."
        )
    if model is _MISSING:
        raise TypeError(
            f"{cls.__name__}.create: missing the keyword argument `model` (the params pytree "
            f"or Equinox model to train): {cls.__name__}.create(model=..., tx=...)."
        )


def _replace(module: Any, names: tuple[str, ...], values: tuple[Any, ...]) -> Any:
    """A copy of `module` with fields `names` set to `values`.

    Bypasses `__init__` (a subclass may define its own with another signature) the way
    `dataclasses.replace` cannot; the module stays immutable to everyone else.
    """
    fields = _field_names(module)
    unknown = [n for n in names if n not in fields]
    if unknown:
        raise TypeError(
            f"{type(module).__name__} has no field(s) {unknown}; its fields are {fields}."
        )
    updates = dict(zip(names, values, strict=True))
    new = object.__new__(type(module))
    for name in fields:
        object.__setattr__(new, name, updates.get(name, getattr(module, name)))
    return new
