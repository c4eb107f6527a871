"""Weights in and out of eqx_train: flax msgpack checkpoints, PyTorch-style state dicts and
the Hugging Face sharded safetensors layout."""

from ._flax import load_flax_checkpoint as load_flax_checkpoint
from ._hf import load_sharded as load_sharded, save_sharded as save_sharded
from ._state_dict import (
    LoadReport as LoadReport,
    from_state_dict as from_state_dict,
    to_state_dict as to_state_dict,
)

__all__ = [
    "LoadReport",
    "from_state_dict",
    "load_flax_checkpoint",
    "load_sharded",
    "save_sharded",
    "to_state_dict",
]
