"""The flax <-> Equinox layout presets (`flax_to_equinox`, `equinox_to_flax`): every layer
they cover computes what flax computes once loaded, with every reader, and `plan_restore`
names each conversion; a flax kernel never fills an Equinox weight untransposed silently;
shapes that differ only in size-1 axes are accepted alike by every reading call."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_train.checkpoints import plan_restore, restore_checkpoint, save_checkpoint
from eqx_train.interop import (
    equinox_to_flax,
    flax_to_equinox,
    from_state_dict,
    load_orbax_checkpoint,
    load_sharded,
    save_sharded,
)

nn = pytest.importorskip("flax.linen")
ocp = pytest.importorskip("orbax.checkpoint")

KEY = jax.random.key(0)


def _save(tmp_path, tree):
    save_checkpoint(tmp_path, tree, step=1)
    return tmp_path


def _square_linen():
    x = jax.random.normal(jax.random.key(1), (5, 32))
    dense = nn.Dense(32)
    params = dense.init(KEY, x)["params"]
    return x, dense, params


# ------------------------------------------------------------------ square kernels


def test_square_flax_kernel_renamed_into_linear_weight_is_refused(tmp_path):
    _, _, params = _square_linen()
    path = _save(tmp_path, {"params": {"Dense_0": params}})
    target = eqx.nn.Linear(32, 32, key=KEY)
    rename = {"weight": "params.Dense_0.kernel", "bias": "params.Dense_0.bias"}
    plan = plan_restore(path, target, rename=rename)
    assert not plan.ok and "weight" not in plan.taken
    assert "would load untransposed" in plan.problems[0]
    assert "flax_to_equinox" in plan.problems[0]
    with pytest.raises(ValueError, match="untransposed"):
        restore_checkpoint(path, target, rename=rename)


def test_square_kernel_taken_as_saved_only_with_an_explicit_transform(tmp_path):
    _, _, params = _square_linen()
    path = _save(tmp_path, {"Dense_0": params})
    target = eqx.nn.Linear(32, 32, key=KEY)
    rename = {"weight": "Dense_0.kernel", "bias": "Dense_0.bias"}
    loaded = restore_checkpoint(path, target, rename=rename, transform={"weight": lambda a: a})
    np.testing.assert_array_equal(loaded.weight, params["kernel"])


def test_equinox_weight_into_flax_kernel_is_refused(tmp_path):
    path = _save(tmp_path, eqx.nn.Linear(32, 32, key=KEY))
    target = {"Dense_0": {"kernel": jnp.zeros((32, 32)), "bias": jnp.zeros(32)}}
    rename = {"Dense_0.kernel": "weight", "Dense_0.bias": "bias"}
    plan = plan_restore(path, target, rename=rename)
    assert any("untransposed" in p and "equinox_to_flax" in p for p in plan.problems)


def test_preset_transposes_square_kernel_and_plan_names_the_convention(tmp_path):
    x, dense, params = _square_linen()
    path = _save(tmp_path, {"params": {"Dense_0": params}})
    target = eqx.nn.Linear(32, 32, key=KEY)
    layout = flax_to_equinox(target)
    plan = plan_restore(path, target, **layout)
    assert plan.ok and plan.taken["weight"] == "params.Dense_0.kernel"
    assert "Dense kernel (in, out)" in plan.conventions["weight"]
    assert "Dense kernel (in, out)" in str(plan)
    loaded = restore_checkpoint(path, target, **layout)
    np.testing.assert_array_equal(loaded.weight, np.asarray(params["kernel"]).T)
    expected = dense.apply({"params": params}, x)
    np.testing.assert_allclose(jax.vmap(loaded)(x), expected, atol=1e-5)


# ------------------------------------------------------------------ each layer vs flax


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_conv_layers_compute_what_flax_computes(tmp_path, dims):
    size = (5, 6, 4)[:dims]
    x = jax.random.normal(jax.random.key(1), (2, *size, 3))  # N, *spatial, C
    conv = nn.Conv(4, (3,) * dims, padding="VALID")
    params = conv.init(KEY, x)["params"]
    path = _save(tmp_path, {"params": {"Conv_0": params}})
    target = eqx.nn.Conv(dims, 3, 4, 3, key=KEY)
    plan = plan_restore(path, target, **flax_to_equinox(target))
    assert "Conv kernel" in plan.conventions["weight"]
    assert "Conv bias" in plan.conventions["bias"]
    loaded = restore_checkpoint(path, target, **flax_to_equinox(target))
    ours = jax.vmap(loaded)(jnp.moveaxis(x, -1, 1))
    np.testing.assert_allclose(
        jnp.moveaxis(ours, 1, -1), conv.apply({"params": params}, x), atol=1e-5
    )


def test_embedding_and_layer_norm_compute_what_flax_computes(tmp_path):
    class Linen(nn.Module):
        @nn.compact
        def __call__(self, ids):
            return nn.LayerNorm()(nn.Embed(10, 6)(ids))

    class Eqx(eqx.Module):
        embed: eqx.nn.Embedding
        norm: eqx.nn.LayerNorm

        def __call__(self, i):
            return self.norm(self.embed(i))

    ids = jnp.arange(7) % 10
    params = Linen().init(KEY, ids)["params"]
    params = jax.tree.map(lambda a: a + jax.random.normal(KEY, a.shape), params)
    path = _save(tmp_path, {"params": params})
    target = Eqx(eqx.nn.Embedding(10, 6, key=KEY), eqx.nn.LayerNorm(6, eps=1e-6))  # flax's eps
    loaded = restore_checkpoint(path, target, **flax_to_equinox(target))
    np.testing.assert_allclose(
        jax.vmap(loaded)(ids), Linen().apply({"params": params}, ids), atol=1e-5
    )


def test_attention_computes_what_flax_computes(tmp_path):
    x = jax.random.normal(jax.random.key(1), (5, 8))
    attention = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)
    params = attention.init(KEY, x, x)["params"]
    path = _save(tmp_path, {"params": {"MultiHeadDotProductAttention_0": params}})
    target = eqx.nn.MultiheadAttention(
        2,
        8,
        use_query_bias=True,
        use_key_bias=True,
        use_value_bias=True,
        use_output_bias=True,
        key=KEY,
    )
    layout = flax_to_equinox(target)
    plan = plan_restore(path, target, **layout)
    assert "attention kernel" in plan.conventions["query_proj.weight"]
    loaded = restore_checkpoint(path, target, **layout)
    np.testing.assert_allclose(
        loaded(x, x, x), attention.apply({"params": params}, x, x), atol=1e-5
    )


def test_modules_names_layers_whose_flax_names_differ(tmp_path):
    x, dense, params = _square_linen()
    path = _save(tmp_path, {"params": {"encoder": params}})
    target = eqx.nn.Linear(32, 32, key=KEY)
    loaded = restore_checkpoint(path, target, **flax_to_equinox(target, modules={"": "encoder"}))
    np.testing.assert_allclose(jax.vmap(loaded)(x), dense.apply({"params": params}, x), atol=1e-5)


def test_modules_naming_no_layer_is_refused_listing_the_layers():
    target = eqx.nn.MLP(2, 2, 4, 1, key=KEY)
    with pytest.raises(ValueError, match=r"'layers\.7'.*layers\.0"):
        flax_to_equinox(target, modules={"layers.7": "Dense_0"})


def test_target_without_layers_is_refused():
    with pytest.raises(ValueError, match="no eqx.nn layer"):
        flax_to_equinox({"w": jnp.zeros(3)})


# ------------------------------------------------------------------ every reader


def test_preset_reads_an_orbax_checkpoint_and_a_hugging_face_layout(tmp_path):
    x, dense, params = _square_linen()
    expected = dense.apply({"params": params}, x)
    target = eqx.nn.Linear(32, 32, key=KEY)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "orbax", {"params": {"Dense_0": params}})
    checkpointer.wait_until_finished()
    from_orbax = load_orbax_checkpoint(tmp_path / "orbax", target, **flax_to_equinox(target))
    save_sharded(tmp_path / "hf", {"params": {"Dense_0": params}})
    from_hf = load_sharded(tmp_path / "hf", target, **flax_to_equinox(target))
    for loaded in (from_orbax, from_hf):
        np.testing.assert_allclose(jax.vmap(loaded)(x), expected, atol=1e-5)


def test_inverse_preset_reads_an_equinox_checkpoint_into_flax(tmp_path):
    model = eqx.nn.MLP(6, 3, 8, 2, activation=jax.nn.relu, key=KEY)
    path = _save(tmp_path, model)

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(8)(x))
            x = nn.relu(nn.Dense(8)(x))
            return nn.Dense(3)(x)

    x = jax.random.normal(jax.random.key(1), (4, 6))
    target = Linen().init(KEY, x)  # {"params": {"Dense_0": ...}}
    layout = equinox_to_flax(target, model)
    plan = plan_restore(path, target, **layout)
    assert plan.ok and plan.taken["params.Dense_1.kernel"] == "layers.1.weight"
    assert "Dense kernel" in plan.conventions["params.Dense_1.kernel"]
    variables = restore_checkpoint(path, target, **layout)
    np.testing.assert_allclose(Linen().apply(variables, x), jax.vmap(model)(x), atol=1e-5)


def test_inverse_preset_gives_flax_conv_layouts(tmp_path):
    model = eqx.nn.Conv2d(3, 4, 3, key=KEY)
    path = _save(tmp_path, model)
    x = jax.random.normal(jax.random.key(1), (2, 5, 5, 3))
    conv = nn.Conv(4, (3, 3), padding="VALID")
    target = conv.init(KEY, x)
    # A Linen module used alone has its parameters at the top: no `Conv_0`.
    layout = equinox_to_flax(target, model, modules={"": ""})
    variables = restore_checkpoint(path, target, **layout)
    ours = jnp.moveaxis(jax.vmap(model)(jnp.moveaxis(x, -1, 1)), 1, -1)
    np.testing.assert_allclose(conv.apply(variables, x), ours, atol=1e-5)


# ------------------------------------------------------------------ size-1 axes


def test_shapes_differing_in_size_one_axes_are_accepted_and_planned(tmp_path):
    bias = np.arange(8, dtype=np.float32)
    path = _save(tmp_path, {"bias": bias})
    target = {"bias": jnp.zeros((8, 1, 1))}
    plan = plan_restore(path, target)
    assert plan.ok and plan.transformed["bias"] == ((8,), (8, 1, 1))
    assert "size 1" in plan.conventions["bias"]
    restored = restore_checkpoint(path, target)
    accepted = from_state_dict(target, {"bias": bias})
    np.testing.assert_array_equal(restored["bias"], bias.reshape(8, 1, 1))
    np.testing.assert_array_equal(accepted["bias"], restored["bias"])


def test_size_one_axes_never_reorder_values(tmp_path):
    path = _save(tmp_path, {"w": np.zeros((8, 2), np.float32)})
    plan = plan_restore(path, {"w": jnp.zeros((2, 8, 1))})
    assert not plan.ok and "(8, 2)" in plan.problems[0]


def test_conv_kernel_whose_shape_hides_its_layout_is_refused(tmp_path):
    kernel = np.arange(81, dtype=np.float32).reshape(3, 3, 3, 3)  # (H, W, in, out)
    path = _save(tmp_path, {"Conv_0": {"kernel": kernel, "bias": np.zeros(3, np.float32)}})
    target = eqx.nn.Conv2d(3, 3, 3, key=KEY)
    rename = {"weight": "Conv_0.kernel", "bias": "Conv_0.bias"}
    plan = plan_restore(path, target, rename=rename)
    assert any("'weight'" in p and "untransposed" in p for p in plan.problems)


def test_non_square_flax_kernel_refusal_names_the_preset(tmp_path):
    path = _save(tmp_path, {"Dense_0": {"kernel": np.zeros((4, 8), np.float32)}})
    plan = plan_restore(path, {"weight": jnp.zeros((8, 4))}, rename={"weight": "Dense_0.kernel"})
    assert "permutation" in plan.problems[0] and "flax_to_equinox" in plan.problems[0]


@pytest.mark.parametrize("mode", ["batch", "ema"])
def test_batch_norm_statistics_give_flax_inference_outputs(tmp_path, mode):
    x = jax.random.normal(jax.random.key(1), (6, 4))
    norm = nn.BatchNorm(use_running_average=True)
    variables = norm.init(KEY, x)
    variables = jax.tree.map(lambda a: a + jax.random.uniform(KEY, a.shape), variables)
    path = _save(tmp_path, variables)  # {"params": {scale, bias}, "batch_stats": {mean, var}}

    class Eqx(eqx.Module):
        bn: eqx.nn.BatchNorm

    model, state = eqx.nn.make_with_state(Eqx)(eqx.nn.BatchNorm(4, "batch", mode=mode))
    layout = flax_to_equinox((model, state), modules={"bn": ""})
    plan = plan_restore(path, (model, state), **layout)
    assert plan.ok, plan.problems
    model, state = restore_checkpoint(path, (model, state), **layout)
    ours, _ = jax.vmap(
        lambda y: model.bn(y, state, inference=True), axis_name="batch", out_axes=(0, None)
    )(x)
    np.testing.assert_allclose(ours, norm.apply(variables, x), atol=1e-5)
