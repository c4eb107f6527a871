"""`partial_eval_by_shape`: the outputs of a function that its inputs' shapes alone decide,
computed without its inputs' values."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.extend import core as jex_core


def _spec_to_struct(spec: Any) -> jax.ShapeDtypeStruct:
    if isinstance(spec, jax.ShapeDtypeStruct):
        return spec
    spec = tuple(spec)
    if len(spec) == 2 and isinstance(spec[0], Iterable):
        return jax.ShapeDtypeStruct(tuple(spec[0]), spec[1])
    return jax.ShapeDtypeStruct(spec, jnp.float32)


def _input_dependent_outputs(jaxpr: Any, dependent_inputs: Sequence[bool]) -> list[bool]:
    """Forward dataflow: which outputs of `jaxpr` depend on the inputs marked True."""
    dependent = {v for v, d in zip(jaxpr.invars, dependent_inputs, strict=True) if d}

    def depends(atom: Any) -> bool:
        return not isinstance(atom, jex_core.Literal) and atom in dependent

    for eqn in jaxpr.eqns:
        inputs = [depends(v) for v in eqn.invars]
        if not any(inputs):
            continue
        inner = eqn.params.get("jaxpr")
        inner_jaxpr = getattr(inner, "jaxpr", inner)
        if (
            isinstance(inner_jaxpr, jex_core.Jaxpr)
            and len(inner_jaxpr.invars) == len(eqn.invars)
            and len(inner_jaxpr.outvars) == len(eqn.outvars)
            and not inner_jaxpr.constvars
        ):
            outputs = _input_dependent_outputs(inner_jaxpr, inputs)
        else:
            outputs = [True] * len(eqn.outvars)
        dependent.update(v for v, d in zip(eqn.outvars, outputs, strict=True) if d)
    return [depends(v) for v in jaxpr.outvars]


def partial_eval_by_shape(
    fn: Callable[..., Any], input_spec: Iterable[Any], *args: Any, **kwargs: Any
) -> Any:
    """Evaluates `fn` knowing only the shapes of its first inputs, like `jax.eval_shape`, but
    returns concrete values for every output that does not depend on those inputs.

    **Arguments:**

    - `fn`: called as `fn(*inputs, *args, **kwargs)`.
    - `input_spec`: one entry per input: a shape (float32), a `(shape, dtype)` pair, or a
      `jax.ShapeDtypeStruct`.
    - `*args`, `**kwargs`: concrete arguments passed after the inputs.

    **Returns:**

    `fn`'s output pytree: `jax.ShapeDtypeStruct` where a leaf depends on the inputs, the
    computed array where it does not (e.g. parameters initialised without data).

    Implemented with `jax.make_jaxpr` and a dependency analysis of the traced program; the
    input-independent outputs are then computed by `jax.jit`, which drops everything else.
    """
    structs = [_spec_to_struct(spec) for spec in input_spec]

    def bound(*inputs: Any) -> Any:
        return fn(*inputs, *args, **kwargs)

    closed, out_shapes = jax.make_jaxpr(bound, return_shape=True)(*structs)
    out_structs, out_tree = jtu.tree_flatten(out_shapes)
    dependent = _input_dependent_outputs(closed.jaxpr, [True] * len(closed.jaxpr.invars))
    known = [i for i, d in enumerate(dependent) if not d]
    values: list[Any] = []
    if known:

        def known_outputs(*inputs: Any) -> list[Any]:
            flat = jtu.tree_leaves(bound(*inputs))
            return [flat[i] for i in known]

        zeros = [jnp.zeros(s.shape, s.dtype) for s in structs]
        values = jax.jit(known_outputs)(*zeros)
    results = list(out_structs)
    for i, value in zip(known, values, strict=True):
        results[i] = value
    return jtu.tree_unflatten(out_tree, results)
