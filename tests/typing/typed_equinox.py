"""Typed wrappers of the Equinox functions that strict_user.py calls, as a strictly typed
project keeps them: Equinox annotates pytrees with jaxtyping's `PyTree`, which pyright sees
as unknown, so in strict mode every call of `eqx.filter_grad` or `eqx.partition` is an
error in the user's own file. These give them Equinox's documented meaning (a gradient, or
either half of a partition, is a tree of the model's type)."""

from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

import equinox as eqx
from jax import Array

_Model = TypeVar("_Model")
_Args = ParamSpec("_Args")


def filter_grad(
    fn: Callable[Concatenate[_Model, _Args], Array],
) -> Callable[Concatenate[_Model, _Args], _Model]:
    """`eqx.filter_grad(fn)`: the gradient, a tree of the first argument's type."""
    return eqx.filter_grad(fn)


def filter_value_and_grad(
    fn: Callable[Concatenate[_Model, _Args], Array],
) -> Callable[Concatenate[_Model, _Args], tuple[Array, _Model]]:
    """`eqx.filter_value_and_grad(fn)`: `(value, gradient)`."""
    return eqx.filter_value_and_grad(fn)


def partition(tree: _Model) -> tuple[_Model, _Model]:
    """`eqx.partition(tree, eqx.is_array)`: the array half and the rest, each of its type."""
    return eqx.partition(tree, eqx.is_array)


def combine(arrays: _Model, static: _Model) -> _Model:
    """`eqx.combine(arrays, static)`: the tree again."""
    return eqx.combine(arrays, static)
