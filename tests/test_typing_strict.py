"""The strict user file (tests/typing/strict_user.py) stays strict and runs as written.

CI's pyright step checks tests/typing, which makes the file's `# pyright: strict` comment
the whole of the typing promise: pyright strict, 0 errors, `assert_type` on what each call
returns. These tests keep that comment in place and run the file's functions, so that the
code pyright accepts is also code that works."""

import importlib
import pathlib
import tomllib

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

ROOT = pathlib.Path(__file__).resolve().parent.parent
STRICT_FILE = ROOT / "tests" / "typing" / "strict_user.py"


def test_strict_user_file_is_checked_in_strict_mode():
    first_line = STRICT_FILE.read_text().splitlines()[0]
    assert first_line == "# pyright: strict", first_line


def test_pyright_checks_the_typing_directory():
    pyright = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pyright"]
    # The directory itself or a folder holding it (pyright checks everything under it).
    includes = [p.rstrip("/") + "/" for p in pyright["include"]]
    assert any("tests/typing/".startswith(p) for p in includes), pyright["include"]
    assert "pyright" in (ROOT / ".ci" / "run").read_text()


@pytest.fixture(scope="module")
def user():
    return importlib.import_module("tests.typing.strict_user")


def test_strict_user_state_keeps_training(user):
    state = user.jitted_training(3)
    assert int(state.step) == 3


def test_strict_user_subclass_trains(user):
    state = user.subclass_keeps_its_type()
    assert type(state) is user.KeyedState and int(state.step) == 1


def test_strict_user_places_on_a_mesh(user):
    user.mesh_placement(Mesh(np.array(jax.devices()), ("data",)))


def test_strict_user_checkpoints(user, tmp_path):
    restored = user.checkpoints(str(tmp_path))
    assert int(restored.step) == 0


def test_strict_user_early_stopping_and_scaling(user):
    assert user.early_stopping_and_scaling([1.0, 2.0, 3.0, 4.0]) is True


def test_strict_user_strategies_build(user):
    user.strategies()


def test_strict_user_roundtrip_law(user, tmp_path):
    user.roundtrip_law(str(tmp_path))


def test_strict_user_fine_tunes_with_transforms(user, tmp_path):
    state = user.fine_tune(str(tmp_path))
    assert int(state.step) == 0
