"""Weights in and out of eqx_train: flax msgpack and Orbax checkpoints, PyTorch-style state
dicts and the Hugging Face sharded safetensors layout."""

from typing import TYPE_CHECKING

from .._lazy import exports

if TYPE_CHECKING:
    from ._flax_layout import (
        Convention as Convention,
        FlaxLayout as FlaxLayout,
        equinox_to_flax as equinox_to_flax,
        flax_to_equinox as flax_to_equinox,
    )
    from ._flax_load import load_flax_checkpoint as load_flax_checkpoint
    from ._hf import load_sharded as load_sharded, save_sharded as save_sharded
    from ._orbax import load_orbax_checkpoint as load_orbax_checkpoint
    from ._state_dict import (
        LoadReport as LoadReport,
        from_state_dict as from_state_dict,
        to_state_dict as to_state_dict,
    )

# Loaded on first use, so that `python -m eqx_train` starts without importing JAX.
__getattr__, __dir__ = exports(
    __name__,
    {
        "Convention": "_flax_layout",
        "FlaxLayout": "_flax_layout",
        "LoadReport": "_state_dict",
        "equinox_to_flax": "_flax_layout",
        "flax_to_equinox": "_flax_layout",
        "from_state_dict": "_state_dict",
        "load_flax_checkpoint": "_flax_load",
        "load_orbax_checkpoint": "_orbax",
        "load_sharded": "_hf",
        "save_sharded": "_hf",
        "to_state_dict": "_state_dict",
    },
)

__all__ = [
    "Convention",
    "FlaxLayout",
    "LoadReport",
    "equinox_to_flax",
    "flax_to_equinox",
    "from_state_dict",
    "load_flax_checkpoint",
    "load_orbax_checkpoint",
    "load_sharded",
    "save_sharded",
    "to_state_dict",
]
