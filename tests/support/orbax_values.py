"""The values tests/support/orbax_worker.py saves, computed independently of any reader."""

import ml_dtypes
import numpy as np


def two_process_values() -> dict[str, np.ndarray]:
    return {
        "w": np.arange(8 * 6, dtype=np.float32).reshape(8, 6) / 7,
        "rows": np.arange(16, dtype=np.int32) * -3,
        "half": (np.arange(5 * 4, dtype=np.float32).reshape(5, 4) / 3).astype(ml_dtypes.bfloat16),
        "replicated": np.array([1.5, -0.0, np.inf], dtype=np.float16),
    }
