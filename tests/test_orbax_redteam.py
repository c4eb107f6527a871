"""load_orbax_checkpoint and `eqx-train inspect` against hostile Orbax directories: what a
tiny file declares must never make the reader allocate without bound or abort."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from eqx_train.checkpoints import CheckpointFormatError
from eqx_train.interop import load_orbax_checkpoint

ocp = pytest.importorskip("orbax.checkpoint")


def _plain_checkpoint(tmp_path):
    path = tmp_path / "plain"
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)).save(path, {"w": np.arange(3.0)})
    return path, json.loads((path / "w" / ".zarray").read_text())


def test_a_tiny_array_declaring_a_huge_chunk_is_refused_without_aborting(tmp_path):
    # tensorstore decodes a chunk whole: a 3-element array with a 64 GiB chunk made it
    # throw std::bad_alloc and abort the process. Run where an abort cannot take pytest down,
    # with an address-space limit so nothing else on the machine pays for it.
    path, zarray = _plain_checkpoint(tmp_path)
    (path / "w" / ".zarray").write_text(json.dumps({**zarray, "chunks": [2**33]}))
    script = textwrap.dedent(
        f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))
        from eqx_train.checkpoints import CheckpointFormatError
        from eqx_train.interop import load_orbax_checkpoint
        try:
            load_orbax_checkpoint({str(path)!r})
        except CheckpointFormatError as error:
            print(error)
            sys.exit(0)
        sys.exit(3)
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "declares chunks of shape (8589934592,)" in done.stdout
    assert str(path) in done.stdout


def test_a_chunk_larger_than_a_small_array_but_under_a_mebibyte_is_not_refused_as_hostile(tmp_path):
    path, zarray = _plain_checkpoint(tmp_path)
    (path / "w" / ".zarray").write_text(json.dumps({**zarray, "chunks": [1024]}))
    # The data was written as one chunk of 3: with chunks of 1024 it no longer decodes,
    # but opening (where chunks are checked) passes and the read names the array.
    with pytest.raises(CheckpointFormatError, match="array 'w' cannot be read"):
        load_orbax_checkpoint(path)


def test_metadata_larger_than_64_mib_is_refused_before_it_is_parsed(tmp_path):
    # JSON parses to ~20x its size in Python objects: the size bound is the memory bound.
    path, _ = _plain_checkpoint(tmp_path)
    with open(path / "_METADATA", "w") as f:
        f.write('{"tree_metadata": {}}')
        f.write(" " * (64 << 20))
    with pytest.raises(CheckpointFormatError, match=r"has \d+ bytes, more than 67108864"):
        load_orbax_checkpoint(path)
