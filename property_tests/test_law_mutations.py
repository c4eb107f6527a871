"""The laws catch a broken restore: each planted bug (a leaf left unrestored, a weak type
dropped, an uncommitted leaf committed, -0.0 or a NaN payload canonicalised) makes
`assert_checkpoint_roundtrip` fail on some tree the public strategies draw, within
hypothesis's default budget of 100 examples; and singletons pass the unbroken law."""

import tempfile

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import find, strategies as st

from eqx_train import checkpoints
from eqx_train._tree import place_like
from eqx_train.testing import assert_checkpoint_roundtrip, assert_resumes_exactly, strategies as ets
from property_tests.expected import DEFAULT_BUDGET

_RESTORE = checkpoints.restore_checkpoint


def _as_jax(x):
    """A NumPy array as a `jax.Array`, when JAX keeps its dtype: one it would narrow
    without x64 (float64, complex128, int64) stays NumPy, since narrowing a value out of
    the narrower range (a complex128 part of 1e200) warns, which the suite makes an error."""
    if isinstance(x, np.ndarray) and jax.dtypes.canonicalize_dtype(x.dtype) == x.dtype:
        return jnp.asarray(x)
    return x


TREES = {
    "pytrees": ets.pytrees(st.one_of(ets.arrays(), ets.keys(), ets.arrays().map(_as_jax))),
    "modules": ets.modules(),
    "train_states": ets.train_states(),
}


def _map_arrays(fn, tree):
    return jax.tree.map(lambda x: fn(x) if isinstance(x, jax.Array | np.ndarray) else x, tree)


def _float_bits_mutation(canonical):
    """A restore that replaces the float elements `canonical` picks (-0.0, NaNs) with their
    canonical value, keeping each array's kind, dtype, placement and weak type."""

    def mutate(x):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        values = np.asarray(x)
        fixed = np.where(canonical(values), canonical.value(values.dtype), values)
        fixed = fixed.astype(values.dtype)
        return fixed if isinstance(x, np.ndarray) else place_like(fixed, x)

    return mutate


def _negative_zero(values):
    return (values == 0) & np.signbit(values)


# The value a mutation writes where its mask holds travels on the mask's function.
_negative_zero.value = lambda dtype: np.zeros((), dtype)  # pyright: ignore[reportFunctionMemberAccess]


def _nan(values):
    return np.isnan(values)


_nan.value = lambda dtype: np.full((), np.nan, dtype)  # pyright: ignore[reportFunctionMemberAccess]


def _leave_one_unrestored(restored, target):
    """The first array leaf is the target's own (a restore that never read it)."""
    leaves, treedef = jax.tree.flatten(restored)
    target_leaves = jax.tree.leaves(target)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, jax.Array | np.ndarray):
            leaves[i] = target_leaves[i]
            break
    return jax.tree.unflatten(treedef, leaves)


def _strong(x):
    return x * np.ones((), x.dtype) if isinstance(x, jax.Array) and x.weak_type else x


def _committed(x):
    if isinstance(x, jax.Array) and not x.committed:
        return jax.device_put(x, next(iter(x.devices())))
    return x


MUTATIONS = {
    "leaves_one_leaf_unrestored": _leave_one_unrestored,
    "drops_a_weak_type": lambda restored, target: _map_arrays(_strong, restored),
    "commits_an_uncommitted_leaf": lambda restored, target: _map_arrays(_committed, restored),
    "canonicalises_negative_zero": lambda restored, target: _map_arrays(
        _float_bits_mutation(_negative_zero), restored
    ),
    "canonicalises_a_nan_payload": lambda restored, target: _map_arrays(
        _float_bits_mutation(_nan), restored
    ),
}


MUTATED_BY = {  # a strategy that draws what each mutation breaks
    "leaves_one_leaf_unrestored": ["pytrees", "modules", "train_states"],
    "drops_a_weak_type": ["modules"],
    "commits_an_uncommitted_leaf": ["pytrees", "modules", "train_states"],
    "canonicalises_negative_zero": ["pytrees"],
    "canonicalises_a_nan_payload": ["pytrees"],
}


def _law_fails(tree):
    with tempfile.TemporaryDirectory() as directory:
        try:
            assert_checkpoint_roundtrip(tree, directory)
        except AssertionError:
            return True
    return False


@pytest.mark.parametrize(
    ("mutation", "strategy"), [(m, s) for m, names in MUTATED_BY.items() for s in names]
)
def test_the_roundtrip_law_fails_on_a_broken_restore(mutation, strategy, monkeypatch):
    def broken(path, target, **options):
        restored = _RESTORE(path, target, **options)
        return restored if target is None else MUTATIONS[mutation](restored, target)

    monkeypatch.setattr(checkpoints, "restore_checkpoint", broken)
    found = find(TREES[strategy], _law_fails, settings=DEFAULT_BUDGET)
    monkeypatch.setattr(checkpoints, "restore_checkpoint", _RESTORE)
    assert_checkpoint_roundtrip(found)  # the mutation, not the tree, made it fail


@pytest.mark.parametrize(
    "tree",
    [(), None, {}, [], {"name": "text", "f": jax.nn.relu}, eqx.nn.Dropout(0.5), (1, 2.5)],
    ids=["empty_tuple", "none", "empty_dict", "empty_list", "no_arrays", "dropout", "scalars"],
)
def test_the_roundtrip_law_passes_on_trees_without_array_leaves(tree):
    assert_checkpoint_roundtrip(tree)


def test_the_resume_law_fails_on_a_restore_that_leaves_an_unchanging_leaf_unrestored(
    monkeypatch,
):
    # The step never changes `frozen`: restored into the initial state, a restore that
    # skipped it would look right.
    state = {"w": jnp.zeros(2), "frozen": jnp.arange(3.0)}

    def step(state, batch):
        return {"w": state["w"] + batch, "frozen": state["frozen"]}

    def broken(path, target, **options):
        restored = _RESTORE(path, target, **options)
        return {**restored, "frozen": target["frozen"]}

    batches = [jnp.ones(2)] * 2
    assert_resumes_exactly(step, state, batches, split_at=1)
    monkeypatch.setattr(checkpoints, "restore_checkpoint", broken)
    with pytest.raises(AssertionError, match=r"\['frozen'\]: bits differ"):
        assert_resumes_exactly(step, state, batches, split_at=1)
