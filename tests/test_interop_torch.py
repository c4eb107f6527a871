"""PyTorch weights into Equinox models and back: same outputs, torch's own strict loading.

The PyTorch blocks of docs/interop.md run here (3.13 CI has no torch): the nn.Sequential
key_map example and the export to a ModuleList-based module."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from eqx_train.interop import LoadReport, from_state_dict, to_state_dict

torch = pytest.importorskip(
    "torch", reason="install eqx_train[interop-test] on Python 3.11 to run the PyTorch tests"
)
nn = torch.nn

ATOL = 1e-5


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def run_torch(module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return module.eval()(torch.from_numpy(x)).numpy()


def to_torch(state: dict[str, np.ndarray]) -> dict:
    return {name: torch.from_numpy(value) for name, value in state.items()}


# ------------------------------------------------------------------------------------ MLP


def eqx_mlp() -> eqx.nn.MLP:
    return eqx.nn.MLP(4, 3, 8, depth=2, activation=jax.nn.relu, key=jax.random.key(0))


def test_torch_sequential_mlp_loads_with_a_key_map_and_gives_the_same_outputs():
    torch_mlp = nn.Sequential(
        nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)
    )
    # nn.Sequential counts the ReLUs: its Linear layers are 0, 2, 4; MLP's are layers.0, .1, .2.
    key_map = lambda k: f"layers.{int(k.split('.')[0]) // 2}.{k.split('.')[1]}"
    model = from_state_dict(eqx_mlp(), torch_mlp.state_dict(), key_map=key_map)
    x = np.random.default_rng(0).standard_normal((5, 4), dtype=np.float32)
    np.testing.assert_allclose(jax.vmap(model)(jnp.asarray(x)), run_torch(torch_mlp, x), atol=ATOL)


class TorchMLP(nn.Module):
    """An MLP whose parameter names are eqx.nn.MLP's: layers.0.weight, ..."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)])

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))
        return self.layers[-1](x)


def test_exported_mlp_loads_into_torch_strictly_with_the_same_outputs():
    model = eqx_mlp()
    torch_mlp = TorchMLP()
    torch_mlp.load_state_dict(to_torch(to_state_dict(model)), strict=True)
    x = np.random.default_rng(1).standard_normal((5, 4), dtype=np.float32)
    np.testing.assert_allclose(run_torch(torch_mlp, x), jax.vmap(model)(jnp.asarray(x)), atol=ATOL)


# -------------------------------------------------------------------------------- ConvNet


class ConvNet(eqx.Module):
    conv: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(3, 4, 3, padding=1, key=k1)
        self.head = eqx.nn.Linear(4 * 6 * 6, 5, key=k2)

    def __call__(self, x):
        return self.head(jnp.ravel(jax.nn.relu(self.conv(x))))


class TorchConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.head(torch.flatten(torch.relu(self.conv(x)), 1))


def test_torch_convnet_loads_and_gives_the_same_outputs():
    torch_net = TorchConvNet()
    model = from_state_dict(ConvNet(jax.random.key(0)), torch_net.state_dict())
    assert model.conv.bias is not None
    assert model.conv.bias.shape == (4, 1, 1)  # torch's (4,) reshaped to Equinox's layout
    x = np.random.default_rng(2).standard_normal((2, 3, 6, 6), dtype=np.float32)
    np.testing.assert_allclose(jax.vmap(model)(x), run_torch(torch_net, x), atol=ATOL)


def test_exported_convnet_loads_into_torch_strictly_with_the_same_outputs():
    model = ConvNet(jax.random.key(1))
    torch_net = TorchConvNet()
    torch_net.load_state_dict(to_torch(to_state_dict(model)), strict=True)
    x = np.random.default_rng(3).standard_normal((2, 3, 6, 6), dtype=np.float32)
    np.testing.assert_allclose(run_torch(torch_net, x), jax.vmap(model)(x), atol=ATOL)


# ---------------------------------------------------------------------- transformer block


class EncoderBlock(eqx.Module):
    """torch.nn.TransformerEncoderLayer (post-norm, ReLU, no dropout) in Equinox."""

    self_attn: eqx.nn.MultiheadAttention
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear
    norm1: eqx.nn.LayerNorm
    norm2: eqx.nn.LayerNorm

    def __init__(self, dim, heads, hidden, key):
        k1, k2, k3 = jax.random.split(key, 3)
        biases = dict(use_query_bias=True, use_key_bias=True, use_value_bias=True)
        self.self_attn = eqx.nn.MultiheadAttention(
            heads, dim, **biases, use_output_bias=True, key=k1
        )
        self.linear1 = eqx.nn.Linear(dim, hidden, key=k2)
        self.linear2 = eqx.nn.Linear(hidden, dim, key=k3)
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.norm2 = eqx.nn.LayerNorm(dim)

    def __call__(self, x):
        x = jax.vmap(self.norm1)(x + self.self_attn(x, x, x))
        feed_forward = jax.vmap(lambda y: self.linear2(jax.nn.relu(self.linear1(y))))
        return jax.vmap(self.norm2)(x + feed_forward(x))


def split_packed_attention(state: dict) -> dict:
    """torch packs the query, key and value projections into one in_proj tensor; Equinox
    keeps three Linear layers. Everything else is a rename."""
    state = dict(state)
    for kind in ("weight", "bias"):
        packed = state.pop(f"self_attn.in_proj_{kind}")
        for name, part in zip(("query", "key", "value"), packed.chunk(3), strict=True):
            state[f"self_attn.{name}_proj.{kind}"] = part
    return state


def test_torch_transformer_encoder_layer_loads_and_gives_the_same_outputs():
    torch_block = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    key_map = lambda k: k.replace("self_attn.out_proj.", "self_attn.output_proj.")
    state = split_packed_attention(torch_block.state_dict())
    block = from_state_dict(EncoderBlock(8, 2, 16, jax.random.key(0)), state, key_map=key_map)
    x = np.random.default_rng(4).standard_normal((1, 5, 8), dtype=np.float32)
    np.testing.assert_allclose(block(x[0]), run_torch(torch_block, x)[0], atol=ATOL)


# ------------------------------------------------------------------------- tensor handling


def test_bfloat16_tensors_load_bit_for_bit():
    tensor = torch.randn(3, 4).to(torch.bfloat16)
    loaded = from_state_dict({"w": jnp.zeros((3, 4), jnp.bfloat16)}, {"w": tensor})
    assert loaded["w"].dtype == jnp.bfloat16
    expected = tensor.view(torch.int16).numpy()
    np.testing.assert_array_equal(np.asarray(loaded["w"]).view(np.int16), expected)
    assert to_state_dict(loaded)["w"].dtype == ml_dtypes.bfloat16


@pytest.mark.parametrize(
    "name", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]
)
def test_every_float8_format_loads_bit_for_bit(name):
    tensor = torch.tensor([0.5, 1.0, 2.0, 4.0]).to(getattr(torch, name))
    loaded = from_state_dict({"w": np.zeros(4, getattr(ml_dtypes, name))}, {"w": tensor})
    assert loaded["w"].dtype == getattr(ml_dtypes, name)
    np.testing.assert_array_equal(loaded["w"].view(np.uint8), tensor.view(torch.uint8).numpy())


def test_a_tensor_without_a_numpy_equivalent_is_refused_naming_its_entry():
    with pytest.raises(TypeError, match=r"entry 'layers\.0\.weight' .*sparse_coo"):
        from_state_dict(
            {"layers": [{"weight": np.zeros((2, 2), np.float32)}]},
            {"layers.0.weight": torch.eye(2).to_sparse()},
        )


def test_non_contiguous_and_grad_tracking_tensors_load_by_value():
    weight = torch.randn(4, 3, requires_grad=True)
    loaded = from_state_dict({"w": np.zeros((3, 4), np.float32)}, {"w": weight.t()})
    np.testing.assert_array_equal(loaded["w"], weight.detach().numpy().T)


def test_loaded_leaves_do_not_change_when_torch_updates_its_tensors():
    linear = nn.Linear(2, 2)
    model = from_state_dict(eqx.nn.Linear(2, 2, key=jax.random.key(0)), linear.state_dict())
    before = np.asarray(model.weight).copy()
    with torch.no_grad():
        linear.weight.add_(1.0)
    np.testing.assert_array_equal(model.weight, before)


def test_float_tensor_into_bfloat16_target_is_a_mismatch_not_a_cast():
    _, report = from_state_dict(
        {"w": jnp.zeros(2, jnp.bfloat16)}, {"w": torch.zeros(2)}, strict=False
    )
    assert report == LoadReport(mismatched=("w",))
