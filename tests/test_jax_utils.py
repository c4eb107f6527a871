"""jax_utils: flax's results for replicate/unreplicate/pad_shard_unpad/prefetch/partial eval."""

import warnings
from typing import cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import jax_utils as flax_jax_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eqx_train import TrainState, checkpoints, jax_utils, shard, shard_to_mesh
from tests.support.helpers import assert_trees_equal


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


def test_replicate_and_unreplicate_keep_weak_types_as_flax_does():
    # BatchNorm's batch counter is weakly typed; a strongly typed copy promotes bfloat16.
    _, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, "batch", mode="ema")
    tree = {"weak": jnp.asarray(3), "strong": jnp.asarray(3, jnp.int32), "bn": state}
    replicated = jax_utils.replicate(tree)
    flax_replicated = flax_jax_utils.replicate(tree)
    leaves = zip(jax.tree.leaves(replicated), jax.tree.leaves(flax_replicated), strict=True)
    for ours, theirs in leaves:
        assert ours.weak_type == theirs.weak_type
    assert replicated["weak"].weak_type and not replicated["strong"].weak_type
    back = jax_utils.unreplicate(replicated)
    for before, after in zip(jax.tree.leaves(tree), jax.tree.leaves(back), strict=True):
        assert after.weak_type == before.weak_type


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
    np.testing.assert_allclose(out, jax.vmap(jax.vmap(model))(jnp.asarray(x)), rtol=1e-5, atol=1e-6)


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
    assert {s.device for s in cast(jax.Array, replicated["a"]).addressable_shards} == set(devices)


def test_unreplicate_returns_one_replica_and_keeps_non_array_leaves():
    model = _model()
    restored = jax_utils.unreplicate(jax_utils.replicate(model))
    assert restored.activation is jax.nn.gelu
    assert_trees_equal(eqx.filter(restored, eqx.is_array), eqx.filter(model, eqx.is_array))


def test_unreplicate_reads_from_first_device_without_gathering():
    replicated = jax_utils.replicate({"w": np.arange(4.0)})
    one = cast(jax.Array, jax_utils.unreplicate(replicated)["w"])
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
    np.testing.assert_allclose(ours, jax.vmap(model)(jnp.asarray(x)), rtol=1e-5, atol=1e-6)


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
    np.testing.assert_allclose(out, jax.vmap(model)(jnp.asarray(x)), rtol=1e-5, atol=1e-6)
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
    out = cast(list[jax.Array], list(jax_utils.prefetch_to_device(batches, 1, sharding)))
    assert all(b.sharding == sharding for b in out)
    np.testing.assert_array_equal(out[2], batches[2])


def test_prefetch_of_shard_output_matches_flax():
    batches = [shard({"x": np.arange(16.0).reshape(16, 1) * i}) for i in range(3)]
    ours = list(jax_utils.prefetch_to_device(iter(batches), 2))
    theirs = list(flax_jax_utils.prefetch_to_device(iter(batches), 2))
    assert_trees_equal(jax.device_get(ours), jax.device_get(theirs))


@pytest.mark.parametrize("size", [0, -1, 1.5])
def test_prefetch_rejects_invalid_size(size, without_type_checks):
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


# ---------------------------------------------------------------- the mesh track


def _data_mesh():
    return Mesh(np.array(jax.devices()), ("data",))


def _data_model_mesh():
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))


def test_replicating_a_state_onto_a_mesh_is_filter_shard_with_empty_spec():
    # The documented one-liner (no wrapper): every device holds the whole of every array, and
    # the non-array leaves of an Equinox model stay in place.
    mesh = _data_model_mesh()
    state = TrainState.create(model=_model(), tx=optax.adam(1e-3))
    replicated = eqx.filter_shard(state, NamedSharding(mesh, PartitionSpec()))
    assert replicated.model.activation is jax.nn.gelu
    for before, after in zip(
        jax.tree.leaves(eqx.filter(state, eqx.is_array)),
        jax.tree.leaves(eqx.filter(replicated, eqx.is_array)),
        strict=True,
    ):
        assert after.sharding.is_fully_replicated
        assert {s.device for s in after.addressable_shards} == set(jax.devices())
        for piece in after.addressable_shards:
            np.testing.assert_array_equal(piece.data, before)


@pytest.mark.parametrize("batch_axis", [None, "data"])
def test_shard_to_mesh_gives_device_i_rows_of_block_i(batch_axis):
    mesh = _data_mesh()
    x = np.arange(24 * 3, dtype=np.float32).reshape(24, 3)
    placed = shard_to_mesh({"x": x, "name": "batch"}, mesh, batch_axis)
    assert placed["name"] == "batch"
    assert placed["x"].shape == (24, 3)
    assert placed["x"].sharding == NamedSharding(mesh, PartitionSpec(("data",)))
    for i, device in enumerate(mesh.devices.flat):
        (piece,) = [s.data for s in placed["x"].addressable_shards if s.device == device]
        np.testing.assert_array_equal(piece, x[3 * i : 3 * i + 3])


def test_shard_to_mesh_over_data_axis_replicates_rows_over_model_axis():
    mesh = _data_model_mesh()
    x = np.arange(10.0).reshape(10, 1)
    placed = cast(jax.Array, shard_to_mesh(x, mesh, "data"))
    for row in range(2):
        for col in range(4):
            device = mesh.devices[row, col]
            (piece,) = [s.data for s in placed.addressable_shards if s.device == device]
            np.testing.assert_array_equal(piece, x[5 * row : 5 * row + 5])


def test_shard_to_mesh_rejects_a_partial_batch_naming_leaf_and_sizes():
    with pytest.raises(
        ValueError, match=r"leaf 'y' has batch size 13, which is not divisible by the 8 devices"
    ):
        shard_to_mesh({"y": np.zeros(13)}, _data_mesh())


def test_shard_to_mesh_pads_a_partial_batch_with_zero_rows():
    x = np.arange(1.0, 14.0).reshape(13, 1)
    placed = shard_to_mesh({"x": x, "y": np.ones(13, np.int32)}, _data_model_mesh(), pad=True)
    expected_x = np.concatenate([x, np.zeros((3, 1))])
    np.testing.assert_array_equal(np.asarray(placed["x"]), expected_x)
    np.testing.assert_array_equal(np.asarray(placed["y"]), [1] * 13 + [0] * 3)
    assert placed["y"].dtype == np.int32


def test_shard_to_mesh_rejects_scalars_disagreeing_leaves_and_unknown_axes():
    mesh = _data_mesh()
    with pytest.raises(ValueError, match=r"leaf 'lr' is a scalar"):
        shard_to_mesh({"x": np.ones((8, 2)), "lr": np.float32(0.1)}, mesh)
    with pytest.raises(ValueError, match=r"'a' has 8, 'b' has 16"):
        shard_to_mesh({"a": np.ones(8), "b": np.ones(16)}, mesh)
    with pytest.raises(ValueError, match=r"batch_axis 'model' must name axes of the mesh"):
        shard_to_mesh(np.ones(8), mesh, "model")


def test_fsdp_sharding_splits_the_largest_divisible_dimension_over_the_axis():
    mesh = _data_model_mesh()  # model axis of size 4
    tree = {
        "kernel": np.zeros((64, 128)),
        "square": np.zeros((8, 8)),
        "tall": jax.ShapeDtypeStruct((6, 12), jnp.float32),
        "bias": np.zeros(10),
        "short": np.zeros(2),
        "step": jnp.asarray(3),
        "fn": jax.nn.relu,
    }
    expected = {
        "kernel": PartitionSpec(None, "model"),
        "square": PartitionSpec("model", None),
        "tall": PartitionSpec(None, "model"),
        "bias": PartitionSpec(),
        "short": PartitionSpec(),
        "step": PartitionSpec(),
        "fn": None,
    }
    shardings = jax_utils.fsdp_sharding(tree, mesh, "model")
    assert {k: (None if s is None else s.spec) for k, s in shardings.items()} == expected
    assert all(s is None or s.mesh == mesh for s in shardings.values())


def test_fsdp_sharding_rejects_an_axis_the_mesh_lacks():
    with pytest.raises(ValueError, match=r"axis 'model' is not an axis of the mesh.*\('data',\)"):
        jax_utils.fsdp_sharding({"w": np.zeros(8)}, _data_mesh(), "model")


def test_fsdp_sharded_train_state_steps_like_a_single_device_state():
    mesh = _data_model_mesh()
    model = eqx.nn.MLP(16, 4, 32, 2, key=jax.random.key(1))
    state = TrainState.create(model=model, tx=optax.adam(1e-2))
    sharded = eqx.filter_shard(state, jax_utils.fsdp_sharding(state, mesh, "model"))
    # Parameters and Adam's moments: each device holds a quarter of every 32-wide matrix.
    kernel, mu = sharded.model.layers[1].weight, sharded.opt_state[0].mu.layers[1].weight
    for array in (kernel, mu):
        assert array.sharding.spec == PartitionSpec("model", None)
        assert {s.data.shape for s in array.addressable_shards} == {(8, 32)}

    def loss(m, x, y):
        return jnp.mean((jax.vmap(m)(x) - y) ** 2)

    @eqx.filter_jit
    def step(state, x, y):
        new = state.apply_gradients(grads=eqx.filter_grad(loss)(state.model, x, y))
        return eqx.filter_shard(new, jax_utils.fsdp_sharding(new, mesh, "model"))

    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 16)).astype(np.float32)
    y = rng.standard_normal((32, 4)).astype(np.float32)
    single = state
    for _ in range(3):
        sharded = step(sharded, *shard_to_mesh((x, y), mesh))
        single = step.__wrapped__(single, x, y)  # pyright: ignore[reportFunctionMemberAccess]  # as functools.wraps sets it
    kernel, mu = sharded.model.layers[1].weight, sharded.opt_state[0].mu.layers[1].weight
    for array in (kernel, mu):  # still sharded after the steps
        assert {s.data.shape for s in array.addressable_shards} == {(8, 32)}
    for a, b in zip(
        jax.tree.leaves(eqx.filter(sharded, eqx.is_array)),
        jax.tree.leaves(eqx.filter(single, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)


def test_fsdp_state_saved_from_a_2d_mesh_restores_onto_a_1d_mesh_of_another_size(tmp_path):
    def make_state():
        model = eqx.nn.MLP(16, 4, 32, 2, key=jax.random.key(2))
        return TrainState.create(model=model, tx=optax.adam(1e-2))

    state = make_state()
    state = eqx.filter_shard(state, jax_utils.fsdp_sharding(state, _data_model_mesh()))
    grads = jax.tree.map(jnp.ones_like, eqx.filter(state.model, eqx.is_array))
    state = state.apply_gradients(grads=grads)  # Adam moments and count are non-zero now
    checkpoints.save_checkpoint(tmp_path, state, step=1)

    mesh_1d = Mesh(np.array(jax.devices()[:2]), ("model",))
    abstract = eqx.filter_eval_shape(make_state)
    target = jax.tree.map(
        lambda leaf, s: (
            leaf if s is None else jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s)
        ),
        abstract,
        jax_utils.fsdp_sharding(abstract, mesh_1d, "model"),
    )
    restored = checkpoints.restore_checkpoint(tmp_path, target)
    assert restored.model.activation is jax.nn.relu
    kernel = restored.model.layers[1].weight
    assert kernel.sharding.mesh == mesh_1d
    assert {s.data.shape for s in kernel.addressable_shards} == {(16, 32)}  # 32 rows over 2
    # The optimiser is a new `optax.adam` (a static field), so compare the arrays leaf by leaf.
    assert_trees_equal(
        jax.device_get(jax.tree.leaves(eqx.filter(restored, eqx.is_array))),
        jax.device_get(jax.tree.leaves(eqx.filter(state, eqx.is_array))),
    )
