"""`casting=` and typed PRNG keys: PRNG key data is never cast, whichever side holds the key."""

import jax
import numpy as np
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints import plan_restore, restore_checkpoint


def test_a_saved_key_is_never_cast_into_a_float_array(tmp_path):
    checkpoints.save_checkpoint(tmp_path, {"rng": jax.random.key(42)}, 1)
    target = {"rng": np.zeros(2, np.float32)}
    [problem] = plan_restore(tmp_path, target, casting="unsafe").problems
    assert problem.startswith("'rng'") and "PRNG key data is never cast" in problem
    with pytest.raises(ValueError, match="PRNG key data is never cast"):
        restore_checkpoint(tmp_path, target, casting="unsafe")


def test_a_saved_keys_data_still_restores_as_its_own_uint32(tmp_path):
    key = jax.random.key(42)
    checkpoints.save_checkpoint(tmp_path, {"rng": key}, 1)
    restored = restore_checkpoint(tmp_path, {"rng": np.zeros(2, np.uint32)})
    np.testing.assert_array_equal(restored["rng"], jax.random.key_data(key))
