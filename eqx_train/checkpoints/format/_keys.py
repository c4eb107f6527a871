"""The names inside a checkpoint file: the safetensors header's `__metadata__` keys and the
format markers (`*_KEY`, `FORMAT_*`, `HF_*`); see docs/checkpoint_format.md.

They stand apart from the names of files (`_names`, which re-exports them) because the
header codecs below the readers need them and nothing else: this module imports nothing.
"""

from __future__ import annotations

import re

# Every tensor's data starts on this boundary in the file (and host buffers on it in memory),
# so that a device can adopt a buffer read from it without a copy.
ALIGN_FOR_DEVICE = 64
METADATA_KEY = "__metadata__"  # the safetensors header entry that holds string metadata
RESERVED_TENSOR_NAMES = frozenset({METADATA_KEY})
FORMAT_KEY = "eqx_train.format"
FORMAT_VERSION_KEY = "eqx_train.format_version"
FORMAT_NAME = "eqx_train.checkpoint"  # FORMAT_KEY of a checkpoint file or `.shards` index
# The format versions. Each file or `.shards` index is written as the lowest version that
# holds what it needs, so that an older eqx_train refuses as newer only what it would
# misread (instead of returning wrong values, or moving the file aside as corrupt):
# version 1 is every file of plain tensors; version 2 adds complex tensors (C64, and
# complex128 as F64 pairs listed under `COMPLEX128_KEY`); version 3 adds tensors checksummed
# in parts (a list of digests and the table's `part_bytes`, see `_checksums`).
PLAIN_FORMAT_VERSION = 1
COMPLEX_FORMAT_VERSION = 2
PARTS_FORMAT_VERSION = 3
FORMAT_VERSION = 3  # the newest this eqx_train reads
STEP_KEY = "eqx_train.step"
TREE_KEY = "eqx_train.tree"
CHECKSUMS_KEY = "eqx_train.checksums"
CHECKSUM_ALGORITHM = "xxh3_64"
# The tensors a header stores as F64 with a trailing axis of 2 that are complex128 (a JSON
# list of names; absent when there are none): safetensors has no complex128 code.
COMPLEX128_KEY = "eqx_train.complex128"
ARRAYS_KEY = "eqx_train.arrays"  # a .shards index: every array's shape, dtype and pieces
PIECES_KEY = "eqx_train.pieces"  # a piece file: each of its tensors' leaf and slice
# The save's token, in every file of one save: a .shards index and each of its piece files
# (which also holds PROCESS_KEY, the process that wrote it), a Hugging Face save's files.
SAVE_KEY = "eqx_train.save"
PROCESS_KEY = "eqx_train.process"  # a piece file: its writer's process index, ASCII digits
# A manager's local tier: each process's unit (its blocks and leaves), and every process's
# host_state (a JSON list) in a persistent checkpoint, its own in a unit.
LOCAL_UNIT_KEY = "eqx_train.local_unit"
HOST_STATE_KEY = "eqx_train.host_state"
METRICS_KEY = "eqx_train.metrics"  # CheckpointManager.save(metrics=...)
USER_METADATA_KEY = "eqx_train.user_metadata"  # CheckpointManager.save(metadata=...)
OUR_KEY_PREFIX = "eqx_train."  # every key above but METADATA_KEY; others are foreign

# The Hugging Face layout.
HF_SINGLE_NAME = "model.safetensors"
HF_INDEX_NAME = "model.safetensors.index.json"
HF_SHARD_PATTERN = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")
HF_FORMAT_KEY = "format"  # transformers requires "pt" in every file's metadata
HF_FORMAT_PT = "pt"
HF_INDEX_FORMAT = "eqx_train.hf_sharded"  # FORMAT_KEY of a Hugging Face index of ours
HF_SAVE_KEY = SAVE_KEY  # the save token every shard of one save repeats
HF_TREE_CHECKSUM_KEY = "eqx_train.tree_checksum"
