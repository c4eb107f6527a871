"""The checkpoint engine as eqx_train's own interop layer and command line use it.

Not public API (it is not documented and may change in any release): the names here are
what `eqx_train.interop` and `eqx-train` need from the checkpoint code, exported in one
place so that they never reach into a private module. Users want `eqx_train.checkpoints`.

Importing this module does not import JAX (the command line starts without it).
"""

from collections.abc import Sequence
from typing import Any

from .._calls import call as call, calling as calling
from .._text import short as short
from ._errors import CheckpointFormatError as CheckpointFormatError
from ._options import RestoreOptions as RestoreOptions, restore_with as restore_with
from .format import _format
from .format._checksums import text_digest as text_digest
from .format._description import (
    MAX_DEPTH as MAX_DEPTH,
    Tensor as Tensor,
    describe as describe,
    is_prng_key as is_prng_key,
    key_impls as key_impls,
    parse_json as parse_json,
)
from .format._format import check_header_size as check_header_size, write_all as write_all
from .format._hf_layout import IndexReader as IndexReader
from .format._layouts import (
    FOREIGN_READERS as FOREIGN_READERS,
    ForeignCheckpointError as ForeignCheckpointError,
    Location as Location,
    hf_file as hf_file,
    is_orbax as is_orbax,
    locate as locate,
    open_reader as open_reader,
)
from .format._leaf_kinds import _place_key
from .format._names import (
    FORMAT_KEY as FORMAT_KEY,
    FORMAT_NAME as FORMAT_NAME,
    FORMAT_VERSION as FORMAT_VERSION,
    FORMAT_VERSION_KEY as FORMAT_VERSION_KEY,
    HF_FORMAT_KEY as HF_FORMAT_KEY,
    HF_FORMAT_PT as HF_FORMAT_PT,
    HF_INDEX_FORMAT as HF_INDEX_FORMAT,
    HF_INDEX_NAME as HF_INDEX_NAME,
    HF_SAVE_KEY as HF_SAVE_KEY,
    HF_SHARD_PATTERN as HF_SHARD_PATTERN,
    HF_SINGLE_NAME as HF_SINGLE_NAME,
    HF_TREE_CHECKSUM_KEY as HF_TREE_CHECKSUM_KEY,
    METRICS_KEY as METRICS_KEY,
    OUR_KEY_PREFIX as OUR_KEY_PREFIX,
    PLAIN_FORMAT_VERSION as PLAIN_FORMAT_VERSION,
    STEP_KEY as STEP_KEY,
    TREE_KEY as TREE_KEY,
    USER_METADATA_KEY as USER_METADATA_KEY,
    hf_shard_names as hf_shard_names,
    parse_temp as parse_temp,
    step_from_text as step_from_text,
    writer_is_dead as writer_is_dead,
)
from .format._reader import (
    MAX_NDIM as MAX_NDIM,
    FileReader as FileReader,
    aligned_empty as aligned_empty,
    too_big as too_big,
)
from .format._shards import remove_paths as remove_paths
from .pipeline._directory import list_checkpoints as list_checkpoints
from .pipeline._matching import Casting as Casting, Rename as Rename
from .pipeline._restore import Reader as Reader, restore_from as restore_from
from .pipeline._transfer import through_window
from .pipeline._transform import Transform as Transform
from .storage._local import LocalStorage as LocalStorage
from .storage._local_files import LocalSource as LocalSource, fsync_dir as fsync_dir

place_key = _place_key  # a typed key from key data, placed as a target key is


def write_file(out: Any, tensors: Sequence[Tensor], metadata: dict[str, str]) -> None:
    """`_format.write_file`, its leaves moved to the host by `_transfer.host_arrays` within
    the current window: the writer of a save outside the save pipeline (`save_sharded`)."""
    with _format.leaves_from(through_window):
        _format.write_file(out, tensors, metadata)
