"""The Orbax reader's refusal of symbolic links out of the checkpoint: a
directory it cannot list (no read permission, which a crafted archive can set while
leaving it searchable) must not hide a link from the check."""

import os

import numpy as np
import pytest

from eqx_train.checkpoints import CheckpointFormatError
from eqx_train.interop import load_orbax_checkpoint

ocp = pytest.importorskip("orbax.checkpoint")


def test_a_directory_that_cannot_be_listed_is_refused_not_skipped(tmp_path, monkeypatch):
    path = tmp_path / "plain"
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)).save(path, {"w": np.arange(3.0)})
    secret = tmp_path / "secret"
    secret.write_bytes((path / "w" / "0").read_bytes())
    (path / "w" / "0").unlink()
    (path / "w" / "0").symlink_to(secret)
    # A directory mode 0o311 (searchable, not readable) lists as PermissionError for
    # anyone but root, while tensorstore still opens 'w/0' by its name; the suite runs as
    # root, so the listing's error is injected.
    hidden = os.path.realpath(path / "w")
    real_scandir = os.scandir

    def scandir(directory="."):
        if os.path.realpath(directory) == hidden:
            raise PermissionError(13, "Permission denied", str(directory))
        return real_scandir(directory)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(CheckpointFormatError, match=f"{path / 'w'}.*cannot be listed"):
        load_orbax_checkpoint(path)
