"""Reading the Hugging Face sharded safetensors layout (`eqx_train.interop.save_sharded`,
`huggingface_hub`, `transformers`) as one checkpoint reader.

Layout of a directory (names in `_names`):

    model.safetensors                         everything, when it fits in one shard; or
    model-00001-of-00003.safetensors ...      the shards, plain safetensors files, and
    model.safetensors.index.json              {"metadata": {"total_size": bytes},
                                               "weight_map": {tensor name: shard file}}

The index of a save of ours also holds the tree description (with its checksum) and a save
token that every shard of the save repeats: a shard of another save (a save killed while
replacing same-named shards) is refused instead of mixing two models.

The directory is read through a `Storage`: on the local disk, or on any store a URL names
(`s3://bucket/model/`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..._text import short
from .._errors import CheckpointFormatError, invalid
from ..storage._base import Storage
from ._arrays import Into
from ._checksums import text_digest
from ._description import OpenFile, ReaderBase, parse_json
from ._names import HF_INDEX_NAME, HF_SAVE_KEY, HF_TREE_CHECKSUM_KEY, TREE_KEY

_MAX_INDEX_BYTES = 64 << 20


def is_plain_file_name(name: Any) -> bool:
    """A name that can only mean a file directly inside the directory."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(sep and sep in name for sep in ("/", "\\", os.sep, os.altsep, "\0"))
        and not os.path.isabs(name)
    )


class IndexReader(ReaderBase):
    """A sharded Hugging Face directory as one checkpoint reader (a `_layouts.Reader`), so
    that `restore_checkpoint`'s matching code serves it unchanged.

    The whole index is validated and every shard's header read and checked against it
    before anything is trusted; tensor data is then read only from the shards that hold
    the tensors asked for.

    **Arguments:**

    - `directory`: the directory that holds the index and its shards.
    - `store`: where the directory is (`LocalStorage()` for the local disk).
    - `open_file`: how each file is opened: `FileReader`.
    - `index_name`: the index's file name in it.
    """

    reads_into = True  # `read_many` reads into the buffers `into` offers

    def __init__(
        self, directory: str, store: Storage, open_file: OpenFile, index_name: str = HF_INDEX_NAME
    ):
        self.path = directory
        self.store = store
        self._open = open_file
        self.index_path = self.store.join(directory, index_name)
        self._files: dict[str, Any] = {}
        try:
            self._load()
        except BaseException:
            self.close()
            raise

    def bad(self, why: str) -> CheckpointFormatError:
        return invalid(self.index_path, "index")(why)

    def _load(self) -> None:
        # The checkpoint reader's own source (locally: no blocking open, regular files only).
        source = self.store.open(self.index_path)
        try:
            if source.size > _MAX_INDEX_BYTES:
                raise self.bad(
                    f"it has {source.size} bytes, more than the {_MAX_INDEX_BYTES} allowed"
                )
            raw = bytearray(source.size)
            source.read_into(memoryview(raw), 0)
        finally:
            source.close()
        index = parse_json(bytes(raw), "the index", self.bad)
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise self.bad("it is not a JSON object with a 'weight_map' object")
        metadata = index.get("metadata", {})
        if not isinstance(metadata, dict):
            raise self.bad("its 'metadata' is not a JSON object")
        weight_map: dict[str, Any] = index["weight_map"]
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            if not is_plain_file_name(file):
                raise self.bad(
                    f"tensor {short(name)} is mapped to {short(file)}, which is "
                    "not a plain file name in the directory"
                )
            by_file.setdefault(file, []).append(name)
        pickles = sorted(f for f in by_file if f.endswith((".bin", ".pt", ".pth")))
        if pickles:
            raise CheckpointFormatError(
                f"{self.index_path} is an index of PyTorch pickle shards ({short(pickles[:3])}), "
                "not of safetensors files: load each with torch.load(path, weights_only=True) "
                "and pass the merged state dict to eqx_train.interop.from_state_dict"
            )
        # Only the string entries are ours (total_size is a number; others are foreign).
        self.metadata: dict[str, str] = {k: v for k, v in metadata.items() if isinstance(v, str)}
        token = self.metadata.get(HF_SAVE_KEY)
        shapes: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        self._where: dict[str, str] = {}
        for file, names in by_file.items():
            path = self.store.join(self.path, file)
            try:
                reader = self._open(path, self.store.open(path))
            except FileNotFoundError:
                raise self.bad(f"it maps tensors to {file}, which is missing") from None
            self._files[file] = reader
            for name in names:
                if name not in reader.tensors:
                    raise self.bad(f"it maps tensor {short(name)} to {file}, which lacks it")
            unlisted = sorted(set(reader.tensors) - set(names))
            if unlisted:
                raise self.bad(
                    f"{file} holds tensors the index does not map to it: {short(unlisted[:5])}"
                )
            if token is not None and reader.metadata.get(HF_SAVE_KEY) != token:
                raise self.bad(
                    f"{file} belongs to another save than the index (a save was interrupted "
                    "while replacing it); save again"
                )
        for name, file in weight_map.items():
            info = self._files[file].tensors[name]
            shapes[name] = (info.shape, info.dtype)
            self._where[name] = file
        self._shapes = shapes

    def close(self) -> None:
        for reader in self._files.values():
            reader.close()

    def files(self) -> dict[str, Any]:
        """The open shard readers, by path, in the index's order."""
        return {self.store.join(self.path, name): reader for name, reader in self._files.items()}

    def check_unchanged(self) -> None:
        """Raises `ObjectReplacedError` if a shard read was replaced since it was opened
        (a local file, read through one descriptor, cannot be)."""
        for reader in self._files.values():
            reader.check_unchanged()

    def tree_text(self) -> str:
        text = self.metadata[TREE_KEY]
        if self.metadata.get(HF_TREE_CHECKSUM_KEY) != text_digest(text):
            raise self.bad("its tree description fails its checksum")
        return text

    def arrays(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return self._shapes

    def read(
        self, name: str, index: tuple[slice, ...] | None = None, *, verify: bool = True
    ) -> np.ndarray:
        return self._files[self._where[name]].read(name, index, verify=verify)

    def read_many(
        self,
        names: Sequence[str],
        *,
        verify: bool = True,
        parallel: bool = True,
        into: Into | None = None,
    ) -> dict[str, np.ndarray]:
        """Whole tensors, by name, each file's read together (`FileReader.read_many`)."""
        grouped: dict[str, list[str]] = {}
        for name in names:
            grouped.setdefault(self._where[name], []).append(name)
        found: dict[str, np.ndarray] = {}
        for file, group in grouped.items():
            found.update(
                self._files[file].read_many(group, verify=verify, parallel=parallel, into=into)
            )
        return {name: found[name] for name in names}
