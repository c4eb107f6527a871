"""The byte format is a layer of its own: its one writer writes a file its reader reads,
without the save pipeline above it (that no format module imports upward is
`test_checkpoint_layers`'s)."""

from __future__ import annotations

import os

import numpy as np

from eqx_train.checkpoints.format import _description, _format, _reader
from eqx_train.checkpoints.storage import LocalStorage


def test_the_writer_alone_writes_a_file_the_reader_reads(tmp_path):
    tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.int64(7)}
    description, tensors = _description.describe(tree)
    metadata = _format.base_metadata("1", description)
    path = os.path.join(tmp_path, "plain.safetensors")
    LocalStorage().atomic_write(path, lambda fd: _format.write_file(fd, tensors, metadata))
    with _reader.FileReader(path) as reader:
        restored = _description.rebuild(reader.description(), reader.read)
    assert restored["w"].tolist() == tree["w"].tolist() and restored["b"] == 7
