"""The byte format is a layer of its own: `checkpoints/format/` imports nothing from the
layers above it (the save and restore pipeline, the manager, the public functions), and its
one writer writes a readable file without them."""

from __future__ import annotations

import ast
import os
import pathlib

import numpy as np

import eqx_train
from eqx_train.checkpoints.format import _description, _format, _reader
from eqx_train.checkpoints.storage import LocalStorage

CHECKPOINTS = pathlib.Path(eqx_train.__file__).parent / "checkpoints"
ABOVE = ("pipeline", "manager", "_api", "_restore_api", "_plan", "_options", "engine")


def _imports_above(path: pathlib.Path) -> list[str]:
    """The modules above the format that `path` imports, however (relative, absolute, under
    `if TYPE_CHECKING`, inside a function)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 2 or module.startswith("eqx_train.checkpoints."):
                first = module.removeprefix("eqx_train.checkpoints.").split(".")[0]
                names = [first] if first else [alias.name for alias in node.names]
                found += [f"{path.name}: {n}" for n in names if n in ABOVE]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[:2] == ["eqx_train", "checkpoints"] and parts[2:3] and parts[2] in ABOVE:
                    found.append(f"{path.name}: {alias.name}")
    return found


def test_the_format_imports_nothing_from_the_layers_above_it():
    modules = sorted((CHECKPOINTS / "format").glob("*.py"))
    assert len(modules) > 5
    assert [found for path in modules for found in _imports_above(path)] == []


def test_the_layer_check_finds_an_upward_import(tmp_path):
    planted = tmp_path / "_planted.py"
    planted.write_text("from ..pipeline import _transfer\nfrom .._api import save_checkpoint\n")
    assert _imports_above(planted) == ["_planted.py: pipeline", "_planted.py: _api"]


def test_the_writer_alone_writes_a_file_the_reader_reads(tmp_path):
    tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.int64(7)}
    description, tensors = _description.describe(tree)
    metadata = _format.base_metadata("1", description)
    path = os.path.join(tmp_path, "plain.safetensors")
    LocalStorage().atomic_write(path, lambda fd: _format.write_file(fd, tensors, metadata))
    with _reader.FileReader(path) as reader:
        restored = _description.rebuild(reader.description(), reader.read)
    assert restored["w"].tolist() == tree["w"].tolist() and restored["b"] == 7
