"""jax_utils laws over random pytrees, device subsets and batch sizes."""

import equinox as eqx
import jax
import numpy as np
from hypothesis import given, strategies as st
from jax.sharding import Mesh

from eqx_train import jax_utils, shard, shard_to_mesh
from eqx_train.testing import assert_trees_equal, strategies as ets
from property_tests.expected import JAX_DTYPES

# Random pytrees whose arrays JAX can hold as they are (no 64-bit dtypes without x64).
pytrees = ets.pytrees(ets.arrays(JAX_DTYPES))

device_subsets = st.permutations(list(range(8))).flatmap(
    lambda order: st.integers(1, 8).map(lambda k: [jax.devices()[i] for i in order[:k]])
)


@given(tree=pytrees, devices=device_subsets)
def test_unreplicate_of_replicate_is_identity(tree, devices):
    replicated = jax_utils.replicate(tree, devices=devices)
    restored = jax_utils.unreplicate(replicated)
    assert_trees_equal(jax.device_get(restored), tree)
    assert jax.tree.structure(restored) == jax.tree.structure(tree)


@given(tree=pytrees, devices=device_subsets)
def test_every_replica_equals_the_tree(tree, devices):
    replicated = jax_utils.replicate(tree, devices=devices)

    def replica_on(device, x):
        # Read the device's own buffer: indexing x[i] would run an XLA computation, which
        # on CPU turns a bfloat16 -0.0 into +0.0.
        if not isinstance(x, jax.Array):
            return x
        (buffer,) = [s.data for s in x.addressable_shards if s.device == device]
        return np.asarray(buffer)[0, ...]

    for device in devices:
        assert_trees_equal(jax.tree.map(lambda x, d=device: replica_on(d, x), replicated), tree)
    for x in jax.tree.leaves(replicated):
        if isinstance(x, jax.Array):
            assert {s.device for s in x.addressable_shards} == set(devices)


def _linear(params, x):
    return x @ params["w"] + params["b"]


_PARAMS = {
    "w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
    "b": np.arange(4, dtype=np.float32),
}
_PMAPPED = jax.pmap(jax.vmap(_linear, in_axes=(None, 0)), in_axes=(None, 0))


@given(batch=st.integers(1, 100), min_device_batch=st.one_of(st.none(), st.integers(1, 16)))
def test_pad_shard_unpad_pmap_equals_unpadded_function(batch, min_device_batch):
    x = np.random.default_rng(batch).standard_normal((batch, 3)).astype(np.float32)
    out = jax_utils.pad_shard_unpad(_PMAPPED)(_PARAMS, x, min_device_batch=min_device_batch)
    np.testing.assert_allclose(out, _linear(_PARAMS, x), rtol=1e-5, atol=1e-5)


_MESH = Mesh(np.array(jax.devices()), ("data",))
_JITTED = jax.jit(_linear)


@given(batch=st.integers(1, 100), min_device_batch=st.one_of(st.none(), st.integers(1, 16)))
def test_pad_shard_unpad_mesh_equals_unpadded_function(batch, min_device_batch):
    x = np.random.default_rng(batch).standard_normal((batch, 3)).astype(np.float32)
    wrapped = jax_utils.pad_shard_unpad(_JITTED, mesh=_MESH)
    out = wrapped(_PARAMS, x, min_device_batch=min_device_batch)
    np.testing.assert_allclose(out, _linear(_PARAMS, x), rtol=1e-5, atol=1e-5)


@given(
    per_device=st.integers(0, 4),
    rest=ets.shapes(max_dims=2),
    dtype=st.sampled_from(JAX_DTYPES),
    data=st.data(),
)
def test_shard_then_reshape_back_is_identity(per_device, rest, dtype, data):
    x = data.draw(ets.arrays([dtype], shapes=(8 * per_device, *rest)))
    sharded = shard({"x": x, "fn": eqx.nn.Identity()})
    assert sharded["x"].shape == (8, per_device, *rest)
    assert_trees_equal(np.asarray(sharded["x"]).reshape(x.shape), x)


@given(
    batches=st.lists(
        ets.pytrees(ets.arrays(JAX_DTYPES, shapes=ets.shapes(max_dims=2).map(lambda s: (8, *s)))),
        max_size=6,
    ),
    size=st.integers(1, 4),
)
def test_prefetch_yields_exactly_the_input_sequence(batches, size):
    out = list(jax_utils.prefetch_to_device(iter(batches), size))
    assert len(out) == len(batches)
    for got, expected in zip(out, batches, strict=True):
        assert_trees_equal(jax.device_get(got), expected)


_MESHES = [
    Mesh(np.array(jax.devices()), ("data",)),
    Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model")),
]


@given(
    batch=st.integers(1, 40),
    rest=ets.shapes(max_dims=2),
    dtype=st.sampled_from(JAX_DTYPES),
    mesh_index=st.integers(0, len(_MESHES) - 1),
    batch_axis=st.sampled_from([None, "data"]),
    data=st.data(),
)
def test_shard_to_mesh_pads_to_a_multiple_and_keeps_every_row(
    batch, rest, dtype, mesh_index, batch_axis, data
):
    # Law: the first `batch` rows are the input bit for bit, the rest are zeros, the padded
    # size is the smallest multiple of the devices along the batch axes, and each device
    # holds exactly the rows of its block.
    mesh = _MESHES[mesh_index]
    count = 8 if batch_axis is None else int(mesh.shape["data"])
    x = data.draw(ets.arrays([dtype], shapes=(batch, *rest)))
    placed = shard_to_mesh({"x": x, "fn": eqx.nn.Identity()}, mesh, batch_axis, pad=True)
    total = -(-batch // count) * count
    assert placed["x"].shape == (total, *rest)
    assert_trees_equal(jax.device_get(placed["x"])[:batch], x)
    padding = np.asarray(jax.device_get(placed["x"])[batch:])
    assert not padding.any()
    rows = total // count
    for piece in placed["x"].addressable_shards:
        start = piece.index[0].start or 0
        assert start % rows == 0 and piece.data.shape[0] == rows
        expected = np.concatenate([np.asarray(x), padding])[start : start + rows]
        assert np.asarray(piece.data).tobytes() == expected.tobytes()
