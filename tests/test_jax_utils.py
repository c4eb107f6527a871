"""jax_utils: flax's results for replicate/unreplicate/pad_shard_unpad/prefetch/partial eval."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import jax_utils as flax_jax_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eqx_train import jax_utils, shard
from tests.helpers import assert_trees_equal


def _model():
    return eqx.nn.MLP(3, 2, 8, 1, activation=jax.nn.gelu, key=jax.random.key(0))


# ---------------------------------------------------------------- replicate / unreplicate


def test_replicate_adds_device_axis_in_pmap_order():
    tree = {"w": np.arange(6.0).reshape(2, 3), "b": jnp.ones(3, jnp.bfloat16)}
    replicated = jax_utils.replicate(tree)
    devices = jax.local_devices()
    assert replicated["w"].shape == (8, 2, 3)
    for i, shard_ in enumerate(
        sorted(replicated["w"].addressable_shards, key=lambda s: s.index[0].start)
    ):
        assert shard_.device == devices[i]
        np.testing.assert_array_equal(shard_.data[0], tree["w"])
    assert replicated["b"].dtype == jnp.bfloat16


def test_replicate_matches_flax_values_and_layout():
    tree = {"w": np.arange(6.0).reshape(2, 3), "i": np.arange(4, dtype=np.int8)}
    ours, theirs = jax_utils.replicate(tree), flax_jax_utils.replicate(tree)
    assert_trees_equal(jax.device_get(ours), jax.device_get(theirs))
    for key in tree:
        assert [s.device for s in ours[key].addressable_shards] == [
            s.device for s in theirs[key].addressable_shards
        ]


def test_replicate_keeps_non_array_leaves_of_equinox_model():
    model = _model()
    replicated = jax_utils.replicate(model)
    assert replicated.activation is jax.nn.gelu
    assert replicated.layers[0].weight.shape == (8, *model.layers[0].weight.shape)


def test_replicated_model_runs_under_filter_pmap():
    model = _model()
    x = np.random.default_rng(0).standard_normal((8, 5, 3)).astype(np.float32)

    @eqx.filter_pmap
    def forward(model, x):
        return jax.vmap(model)(x)

    out = forward(jax_utils.replicate(model), x)
    np.testing.assert_allclose(out, jax.vmap(jax.vmap(model))(x), rtol=1e-5, atol=1e-6)


def test_replicated_arrays_feed_jax_pmap_with_partitioned_model():
    model = _model()
    params, static = eqx.partition(model, eqx.is_array)
    replicated = jax_utils.replicate(params)

    @jax.pmap
    def forward(params, x):
        return jax.vmap(eqx.combine(params, static))(x)

    x = np.ones((8, 2, 3), np.float32)
    np.testing.assert_allclose(forward(replicated, x)[3], jax.vmap(model)(x[3]), rtol=1e-6)


def test_replicate_to_device_subset():
    devices = jax.local_devices()[2:5]
    replicated = jax_utils.replicate({"a": np.ones(2)}, devices=devices)
    assert replicated["a"].shape == (3, 2)
    assert {s.device for s in replicated["a"].addressable_shards} == set(devices)


def test_unreplicate_returns_one_replica_and_keeps_non_array_leaves():
    model = _model()
    restored = jax_utils.unreplicate(jax_utils.replicate(model))
    assert restored.activation is jax.nn.gelu
    assert_trees_equal(eqx.filter(restored, eqx.is_array), eqx.filter(model, eqx.is_array))


def test_unreplicate_reads_from_first_device_without_gathering():
    replicated = jax_utils.replicate({"w": np.arange(4.0)})
    one = jax_utils.unreplicate(replicated)["w"]
    assert one.devices() == {jax.local_devices()[0]}


def test_unreplicate_matches_flax_on_pmap_outputs():
    out = jax.pmap(lambda x: {"v": x * 2, "s": jnp.sum(x)})(np.arange(16.0).reshape(8, 2))
    assert_trees_equal(
        jax.device_get(jax_utils.unreplicate(out)), jax.device_get(flax_jax_utils.unreplicate(out))
    )


def test_replicate_and_unreplicate_typed_keys():
    keys = jax_utils.replicate({"k": jax.random.key(3)})
    assert keys["k"].shape == (8,)
    assert_trees_equal(jax_utils.unreplicate(keys)["k"], jax.random.key(3))


# ---------------------------------------------------------------- pad_shard_unpad


def _forward_pmap():
    model = _model()
    params, static = eqx.partition(model, eqx.is_array)

    @jax.pmap
    def forward(params, x):
        return jax.vmap(eqx.combine(params, static))(x)

    return model, params, forward


@pytest.mark.parametrize("batch", [1, 5, 8, 13, 100])
def test_pad_shard_unpad_matches_unpadded_function_and_flax(batch):
    model, params, forward = _forward_pmap()
    x = np.random.default_rng(batch).standard_normal((batch, 3)).astype(np.float32)
    replicated = jax_utils.replicate(params)
    ours = jax_utils.pad_shard_unpad(forward)(replicated, x)
    theirs = flax_jax_utils.pad_shard_unpad(forward)(replicated, x)
    assert ours.shape == (batch, 2)
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_allclose(ours, jax.vmap(model)(x), rtol=1e-5, atol=1e-6)


def test_min_device_batch_pads_every_call_to_one_shape():
    seen_shapes = []

    def record(x):
        seen_shapes.append(x.shape)
        return x * 2

    wrapped = jax_utils.pad_shard_unpad(record, static_argnums=())
    for batch in (3, 17, 30):
        out = wrapped(np.ones((batch, 2)), min_device_batch=4)
        np.testing.assert_array_equal(out, np.full((batch, 2), 2.0))
    assert seen_shapes == [(8, 4, 2)] * 3


def test_pytree_arguments_kwargs_and_static_argnames():
    @jax.pmap
    def f(batch, scale):
        return {"y": batch["x"] * scale, "z": (batch["x"].sum(-1),)}

    wrapped = jax_utils.pad_shard_unpad(
        lambda batch, *, scale: f(batch, scale), static_argnums=(), static_argnames=("scale",)
    )
    x = np.arange(22.0).reshape(11, 2)
    out = wrapped({"x": x}, scale=jnp.full((8,), 3.0))
    np.testing.assert_array_equal(out["y"], x * 3)
    np.testing.assert_array_equal(out["z"][0], x.sum(-1))


def test_per_device_outputs_are_returned_unpadded_as_is():
    @jax.pmap
    def count(x):
        return {"per_device": jnp.sum(x), "rows": x}

    out = jax_utils.pad_shard_unpad(count, static_argnums=())(np.ones((10, 1)))
    assert out["per_device"].shape == (8,)
    # 10 rows padded to 16 and split 2 per device: devices 0-4 hold real rows, 5-7 padding.
    np.testing.assert_array_equal(out["per_device"], [2, 2, 2, 2, 2, 0, 0, 0])
    assert out["rows"].shape == (10, 1)


def test_static_return_passes_output_through():
    f = jax.pmap(lambda x: jax.lax.psum(jnp.sum(x), "i"), axis_name="i")
    out = jax_utils.pad_shard_unpad(f, static_argnums=(), static_return=True)(np.ones((5, 2)))
    np.testing.assert_array_equal(out, np.full(8, 10.0))


def test_mismatched_batch_sizes_name_arguments_and_leaves():
    wrapped = jax_utils.pad_shard_unpad(jax.pmap(lambda a, b: a), static_argnums=())
    with pytest.raises(
        ValueError,
        match=r"inconsistent batch sizes.*argument 0 \('a'\) leaf "
        r"'<root>' has batch size 4.*leaf 'y' has batch size 5",
    ):
        wrapped(np.ones((4, 1)), {"y": np.ones((5, 1))})


def test_leaf_without_batch_axis_is_named():
    wrapped = jax_utils.pad_shard_unpad(lambda p, batch: batch)
    with pytest.raises(ValueError, match=r"argument 1 \('batch'\) leaf 'lr' is a scalar"):
        wrapped(None, {"x": np.ones((4, 2)), "lr": np.float32(0.1)})


@pytest.mark.parametrize("batch", [1, 7, 8, 29])
def test_mesh_path_runs_jit_with_batch_sharded_input(batch):
    mesh = Mesh(np.array(jax.devices()), ("data",))
    model = _model()
    seen = []

    @jax.jit
    def forward(model_arrays, x):
        seen.append(x.shape)
        return jax.vmap(eqx.combine(model_arrays, eqx.filter(model, eqx.is_array, inverse=True)))(x)

    wrapped = jax_utils.pad_shard_unpad(forward, mesh=mesh)
    x = np.random.default_rng(batch).standard_normal((batch, 3)).astype(np.float32)
    out = wrapped(eqx.filter(model, eqx.is_array), x)
    assert out.shape == (batch, 2)
    np.testing.assert_allclose(out, jax.vmap(model)(x), rtol=1e-5, atol=1e-6)
    assert seen[-1][0] % 8 == 0


def test_mesh_path_places_inputs_with_batch_sharding():
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    shardings = []

    def forward(x):
        shardings.append(x.sharding)
        return x + 1

    out = jax_utils.pad_shard_unpad(forward, static_argnums=(), mesh=mesh, batch_axis="data")(
        np.zeros((6, 3))
    )
    assert shardings[0] == NamedSharding(mesh, PartitionSpec(("data",)))
    np.testing.assert_array_equal(out, np.ones((6, 3)))


# ---------------------------------------------------------------- prefetch_to_device


def test_prefetch_yields_input_sequence_sharded_in_order():
    batches = [{"x": np.full((8, 2), i, np.float32), "tag": f"b{i}"} for i in range(5)]
    out = list(jax_utils.prefetch_to_device(iter(batches), 2))
    assert [b["tag"] for b in out] == [f"b{i}" for i in range(5)]
    for i, batch in enumerate(out):
        assert len(batch["x"].addressable_shards) == 8
        np.testing.assert_array_equal(batch["x"], batches[i]["x"])


def test_prefetch_keeps_at_most_size_batches_ahead():
    pulled = []

    def source():
        for i in range(10):
            pulled.append(i)
            yield np.full((8, 1), i)

    iterator = jax_utils.prefetch_to_device(source(), 3)
    for consumed in range(1, 11):
        next(iterator)
        assert len(pulled) - consumed <= 3
    with pytest.raises(StopIteration):
        next(iterator)


def test_prefetch_with_a_sharding_for_jit_style_batches():
    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    batches = [np.arange(16.0).reshape(16, 1) + i for i in range(3)]
    out = list(jax_utils.prefetch_to_device(batches, 1, sharding))
    assert all(b.sharding == sharding for b in out)
    np.testing.assert_array_equal(out[2], batches[2])


def test_prefetch_of_shard_output_matches_flax():
    batches = [shard({"x": np.arange(16.0).reshape(16, 1) * i}) for i in range(3)]
    ours = list(jax_utils.prefetch_to_device(iter(batches), 2))
    theirs = list(flax_jax_utils.prefetch_to_device(iter(batches), 2))
    assert_trees_equal(jax.device_get(ours), jax.device_get(theirs))


@pytest.mark.parametrize("size", [0, -1, 1.5])
def test_prefetch_rejects_invalid_size(size):
    with pytest.raises(ValueError, match="size must be an int >= 1"):
        next(jax_utils.prefetch_to_device(iter([np.ones((8, 1))]), size))


# ---------------------------------------------------------------- pmean, partial eval


def test_pmean_averages_over_axis_without_deprecation_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = jax.pmap(lambda x: jax_utils.pmean(x, "i"), axis_name="i")(jnp.arange(8.0))
    np.testing.assert_array_equal(out, np.full(8, 3.5))


def test_partial_eval_by_shape_matches_flax():
    def fn(x, w, *, offset):
        return {"y": x @ w, "w2": w * 2 + offset, "const": jnp.arange(3), "shape": x.shape[0]}

    spec = [((4, 3), jnp.float32)]
    w = jnp.ones((3, 2))
    ours = jax_utils.partial_eval_by_shape(fn, spec, w, offset=1.0)
    theirs = flax_jax_utils.partial_eval_by_shape(fn, spec, w, offset=1.0)
    assert ours["y"] == jax.ShapeDtypeStruct((4, 2), jnp.float32) == theirs["y"]
    np.testing.assert_array_equal(ours["w2"], theirs["w2"])
    np.testing.assert_array_equal(ours["const"], np.arange(3))
    assert ours["shape"] == 4 == theirs["shape"]


def test_partial_eval_by_shape_initialises_equinox_model_without_data():
    def init_and_apply(x, key):
        model = eqx.nn.Linear(3, 2, key=key)
        return eqx.filter(model, eqx.is_array), jax.vmap(model)(x)

    params, y = jax_utils.partial_eval_by_shape(init_and_apply, [(5, 3)], jax.random.key(0))
    assert isinstance(params.weight, jax.Array) and params.weight.shape == (2, 3)
    np.testing.assert_array_equal(params.weight, eqx.nn.Linear(3, 2, key=jax.random.key(0)).weight)
    assert y == jax.ShapeDtypeStruct((5, 2), jnp.float32)


def test_partial_eval_spec_forms():
    out = jax_utils.partial_eval_by_shape(
        lambda a, b, c: (a, b, c), [(2,), ((3,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.bool_)]
    )
    assert out == (
        jax.ShapeDtypeStruct((2,), jnp.float32),
        jax.ShapeDtypeStruct((3,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.bool_),
    )


def test_replicate_is_isolated_from_later_mutation_of_numpy_input():
    array = np.arange(6.0)
    replicated = jax_utils.replicate({"a": array})
    array[:] = -1.0
    np.testing.assert_array_equal(jax.device_get(replicated["a"]), np.tile(np.arange(6.0), (8, 1)))


def test_replicated_state_survives_donating_pmap_steps():
    replicated = jax_utils.replicate({"w": np.ones(1024, np.float32)})
    kept = jax_utils.unreplicate(replicated)
    step = jax.pmap(lambda s: {"w": s["w"] * 2}, donate_argnums=0)
    state = replicated
    for _ in range(3):
        state = step(state)
    np.testing.assert_array_equal(jax_utils.unreplicate(state)["w"], np.full(1024, 8.0))
    np.testing.assert_array_equal(kept["w"], np.ones(1024))
