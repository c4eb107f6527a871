"""What the command line needs from the interop readers, beyond their public functions.

Not public API (undocumented, may change in any release): `eqx-train` imports these names
from here so that it never reaches into a private module. Users want `eqx_train.interop`.
"""

from ._flax_load import flax_arrays as flax_arrays, looks_like_flax as looks_like_flax
from ._orbax import OrbaxReader as OrbaxReader
from ._orbax_layout import (
    describe as describe_orbax,
    layout as orbax_layout,
    steps_to_convert as orbax_steps_to_convert,
)

__all__ = [
    "OrbaxReader",
    "describe_orbax",
    "flax_arrays",
    "looks_like_flax",
    "orbax_layout",
    "orbax_steps_to_convert",
]
