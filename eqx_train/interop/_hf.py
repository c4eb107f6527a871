"""The Hugging Face sharded safetensors layout, written with eqx_train's one writer and read
back through `restore_checkpoint`'s own reader and matching code (the reader is
`eqx_train.checkpoints`' `IndexReader`).

Layout of a directory (as `huggingface_hub` and `transformers` write it):

    model.safetensors                         everything, when it fits in one shard; or
    model-00001-of-00003.safetensors ...      the shards, plain safetensors files, and
    model.safetensors.index.json              {"metadata": {"total_size": bytes},
                                               "weight_map": {tensor name: shard file}}

Each file's safetensors metadata holds `"format": "pt"` (which `transformers` requires) and
eqx_train's checksums. Ours adds, in the index's metadata, the tree description (so a load
without a target rebuilds the tree) and a save token that every shard of the save repeats:
a load that finds a shard of another save (a save killed while replacing same-named shards)
refuses it instead of mixing two models.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._progress import Progress
from ..checkpoints import engine
from ..checkpoints.engine import (
    HF_INDEX_NAME,
    HF_SAVE_KEY,
    HF_SHARD_PATTERN,
    HF_SINGLE_NAME,
    Casting,
    Rename,
    Tensor,
    call,
    short,
)

# huggingface_hub's decimal units, and the binary ones transformers also accepts.
_SIZE_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_LOCAL = engine.LocalStorage()  # the layout lives in a local directory
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]+)\s*")


def parse_size(size: Any) -> int:
    """Bytes from an int or a string such as `"5GB"` (10**9 each), `"500MB"` or `"10KiB"`
    (2**10 each); units are case-insensitive, as in huggingface_hub."""
    if isinstance(size, bool) or not isinstance(size, int | str):
        raise TypeError(
            f"{call()}: max_shard_size must be an int (bytes) or a string such as '5GB', "
            f"got {short(size)}."
        )
    if isinstance(size, int):
        value = size
    else:
        match = _SIZE.fullmatch(size)
        unit = match and _SIZE_UNITS.get(match[2].upper())
        if match is None or unit is None:
            raise ValueError(
                f"{call()}: max_shard_size {size!r} is not a size: expected a number and a "
                "unit, one of B, KB, MB, GB, TB (powers of 10) or KiB, MiB, GiB, TiB (powers "
                "of 2), e.g. '5GB', '500MB', '10KiB'."
            )
        value = int(float(match[1]) * unit)
    if value <= 0:
        raise ValueError(f"{call()}: max_shard_size must be positive, got {size!r}.")
    return value


def plan_shards(tensors: Sequence[Tensor], limit: int) -> list[list[Tensor]]:
    """huggingface_hub's split: tensors in order fill a shard until the next would pass
    `limit`; a tensor bigger than `limit` alone gets a shard of its own, in place."""
    shards: list[list[Tensor]] = []
    current: list[Tensor] = []
    size = 0
    for tensor in tensors:
        nbytes = _nbytes(tensor)
        if nbytes > limit:
            shards.append([tensor])
            continue
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append(tensor)
        size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def _nbytes(tensor: Tensor) -> int:
    return int(np.prod(tensor.shape, dtype=np.int64)) * tensor.dtype.itemsize


def save_sharded(
    directory: str | os.PathLike[str], tree: Any, *, max_shard_size: int | str = "5GB"
) -> None:
    """Saves `tree` in the Hugging Face layout: `model.safetensors` if it fits in one shard,
    else `model-00001-of-0000N.safetensors`... and `model.safetensors.index.json`.

    `transformers` (`from_pretrained`), `huggingface_hub` and `safetensors` read the result:
    tensor names are the leaves' dotted key paths (`layers.0.weight`, the PyTorch names
    wherever Equinox and PyTorch agree, see `to_state_dict`), and every file's metadata says
    `"format": "pt"`. Tensors fill shards in tree order until the next one would pass
    `max_shard_size`, as in huggingface_hub; a tensor bigger than that gets a shard of its
    own (which is then bigger than `max_shard_size`).

    Leaves are handled as by `save_checkpoint`: arrays (JAX, NumPy, typed PRNG keys as
    their key data) and Python/NumPy scalars become tensors, bit-exactly in their own dtype;
    strings are kept in the tree description; other leaves (functions, static fields) are
    not saved and come back from the target on `load_sharded`. To publish only the arrays
    (a `float` field such as `Dropout.p` is a 0-d tensor otherwise), save
    `eqx.filter(model, eqx.is_array)`.

    Each file is written to a temporary name, fsynced and renamed into place; the index is
    written last, then the files of a previous save that the new one does not use are
    removed. A crash leaves the previous save, or (when it was replacing shards of the same
    names) a directory that `load_sharded` refuses naming the shard, never a silent mix.

    **Arguments:**

    - `directory`: where to write (created if missing). Other files in it are left alone.
    - `tree`: any pytree: an Equinox model, dicts of arrays, a `TrainState`...
    - `max_shard_size`: bytes per shard, an int or a string: `"5GB"`, `"500MB"` (powers of
      10, as huggingface_hub) or `"10GiB"`, `"512KiB"` (powers of 2).

    **Raises:**

    `ValueError` naming the value for a bad `max_shard_size`; `TypeError` / `ValueError`
    naming the leaf path for what `save_checkpoint` refuses too (masked arrays, Fractions,
    unsupported dtypes, two leaves with one name). Nothing is written when it raises so.
    """
    with engine.calling("save_sharded"):
        _save_sharded(os.fspath(directory), tree, max_shard_size)


def _save_sharded(directory: str, tree: Any, max_shard_size: int | str) -> None:
    """`save_sharded` within its public call's name."""
    limit = parse_size(max_shard_size)
    description, tensors = engine.describe(tree)
    groups = plan_shards(tensors, limit)
    names = engine.hf_shard_names(len(groups))
    token = os.urandom(8).hex()
    tree_text = json.dumps(description, separators=(",", ":"))
    base = {
        engine.HF_FORMAT_KEY: engine.HF_FORMAT_PT,
        engine.FORMAT_KEY: engine.FORMAT_NAME,
        engine.FORMAT_VERSION_KEY: str(engine.PLAIN_FORMAT_VERSION),
    }
    if len(groups) == 1:
        # One file: an ordinary eqx_train checkpoint file (without a step).
        plans = [(names[0], groups[0], {**base, engine.TREE_KEY: tree_text})]
    else:
        plans = [(n, g, {**base, HF_SAVE_KEY: token}) for n, g in zip(names, groups, strict=True)]
    for _, group, metadata in plans:
        engine.check_header_size(group, metadata)
    _LOCAL.makedirs(directory)  # its entry in the parent durable, as a checkpoint's
    _remove_dead_temporaries(directory)
    if len(groups) > 1:
        _uncommit_foreign_index(directory, names)
    for name, group, metadata in plans:
        _LOCAL.atomic_write(
            os.path.join(directory, name),
            lambda fd, g=group, m=metadata: engine.write_file(fd, g, m),
        )
    if len(groups) > 1:
        index = {
            "metadata": {
                "total_size": sum(_nbytes(t) for t in tensors),
                engine.FORMAT_KEY: engine.HF_INDEX_FORMAT,
                engine.FORMAT_VERSION_KEY: str(engine.PLAIN_FORMAT_VERSION),
                HF_SAVE_KEY: token,
                engine.TREE_KEY: tree_text,
                engine.HF_TREE_CHECKSUM_KEY: engine.text_digest(tree_text),
            },
            "weight_map": {t.name: name for name, group, _ in plans for t in group},
        }
        raw = json.dumps(index, indent=2, ensure_ascii=False).encode("utf-8") + b"\n"
        _LOCAL.atomic_write(
            os.path.join(directory, HF_INDEX_NAME), lambda fd: engine.write_all(fd, memoryview(raw))
        )
    # The new save is in place: only now may the previous one's files go.
    stale = [HF_INDEX_NAME] if len(groups) == 1 else [HF_SINGLE_NAME]
    stale += [
        entry
        for entry in os.listdir(directory)
        if HF_SHARD_PATTERN.fullmatch(entry) and entry not in names
    ]
    engine.remove_paths(_LOCAL, [os.path.join(directory, entry) for entry in stale])
    engine.fsync_dir(directory)


def _uncommit_foreign_index(directory: str, names: Sequence[str]) -> None:
    """Removes an index that carries no save token (another tool's, or unreadable) before
    shards of the same names are replaced under it: nothing could then tell its old shards
    from the new ones after a crash, and a load would mix two saves. An index of ours is
    kept: its token makes such a mix fail loudly, naming the shard."""
    index = os.path.join(directory, HF_INDEX_NAME)
    if not os.path.lexists(index):
        return
    if not any(os.path.lexists(os.path.join(directory, name)) for name in names):
        return
    try:
        with engine.IndexReader(directory, _LOCAL, engine.FileReader) as reader:
            if reader.metadata.get(HF_SAVE_KEY):
                return
    except (OSError, ValueError):
        pass
    _LOCAL.remove(index)
    engine.fsync_dir(directory)


def _remove_dead_temporaries(directory: str) -> None:
    """Temporary files that killed saves of this layout left behind (only names this module
    writes, and only when their writer's process is gone)."""
    ours = {HF_SINGLE_NAME, HF_INDEX_NAME}
    for entry in os.listdir(directory):
        temp = engine.parse_temp(entry)
        if temp is not None and (temp[0] in ours or HF_SHARD_PATTERN.fullmatch(temp[0])):
            if engine.writer_is_dead(temp[1], temp[2]):
                _LOCAL.remove(os.path.join(directory, entry))


# ------------------------------------------------------------------------------------ load


def load_sharded(
    directory: str | os.PathLike[str],
    target: Any = None,
    *,
    strict: bool = True,
    rename: Rename = None,
    casting: Casting = "no",
    filter_spec: Any = None,
    transform: engine.Transform = None,
    verify: bool = True,
    parallel: bool = True,
    threaded_reads: bool | None = None,
    progress: Progress = None,
) -> Any:
    """Loads weights in the Hugging Face layout (written by `save_sharded`,
    `huggingface_hub`, `transformers`' `save_pretrained(safe_serialization=True)`, or one
    `safetensors` file named `model.safetensors`).

    Matching is `restore_checkpoint`'s own: the same `strict`, `rename`, `casting` and
    `filter_spec`, the same errors listing every mismatched leaf, and `jax.Array` /
    `jax.ShapeDtypeStruct` target leaves come back with the target's sharding;
    `plan_restore` on the same path shows what it will do. Every shard's header is read and
    checked against the index first; tensor data is read only from the shards that hold the
    tensors needed.

    **Arguments:**

    - `directory`: the directory holding `model.safetensors` or
      `model.safetensors.index.json` and its shards (when both exist, `model.safetensors`
      wins, as in `transformers`), or either file itself.
    - `target`: a pytree to fill (an Equinox model, dicts...), matched by dotted key path;
      or None. With None, a directory `save_sharded` wrote comes back as saved (nested
      dicts, lists and tuples of NumPy arrays); one written by another tool, which has no
      tree description, as nested dicts split on `.` (`{"layers": {"0": {"weight": ...}}}`),
      or a flat `{name: array}` dict when the names do not nest (as `restore_checkpoint`
      does for such files).
    - `strict`, `rename`, `casting`, `filter_spec`, `transform`: as for
      `restore_checkpoint` (a model whose names, dtype, layout or size differ from the
      saved one's: see
      [When the model changed](../changed_model.md)).
    - `verify`: check each tensor against the checksum `save_sharded` recorded (files from
      other tools have none).
    - `threaded_reads`: read the whole tensors a target needs with up to 8 threads when
      they add up to 16 MiB or more (default: `parallel`'s value, True).
    - `parallel`: the older name of `threaded_reads` (`threaded_reads`, when given, wins).
    - `progress`: as for `restore_checkpoint`: `True` draws a tqdm bar on stderr, or a
      function is called as `fn(done_bytes, total_bytes)` as the tensors are read.

    **Returns:**

    The loaded pytree.

    **Raises:**

    `FileNotFoundError` if neither file is there; `CheckpointFormatError` naming the file
    for a corrupt shard or a hostile index (a file name with `/` or `..`, a tensor mapped to
    a shard that lacks it, a shard holding tensors the index does not list, a missing
    shard, a shard from another save) and for weights of another kind (naming the call that
    reads them); `ValueError` listing every mismatch with `target`.
    """
    with engine.calling("load_sharded"):
        options = engine.RestoreOptions(
            strict=strict,
            rename=rename,
            casting=casting,
            filter_spec=filter_spec,
            transform=transform,
            verify=verify,
            threaded_reads=parallel if threaded_reads is None else threaded_reads,
            progress=progress,
        ).check(target)
        return _load_sharded(os.fspath(directory), target, options)


def _load_sharded(path: str, target: Any, options: engine.RestoreOptions) -> Any:
    """`load_sharded` once its options are checked."""
    found = engine.locate(_LOCAL, path)
    if found is None:
        raise FileNotFoundError(f"{call()}: {path} does not exist.")
    if found.layout in ("directory", "shards"):
        raise FileNotFoundError(
            f"{call()}: {path} holds neither {HF_SINGLE_NAME} nor {HF_INDEX_NAME}"
            + (
                " (it is an eqx_train .shards checkpoint: read it with restore_checkpoint)."
                if found.layout == "shards"
                else "."
            )
        )
    with engine.open_reader(_LOCAL, found) as reader:
        return engine.restore_with(reader, target, options)
