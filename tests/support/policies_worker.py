"""Worker for tests/test_checkpoint_manager_policies.py: the preemption loop of
docs/cloud_storage.md, as a real training job that a real SIGTERM stops.

    python policies_worker.py DIR STEPS

Resumes from the latest checkpoint in DIR (printing "resumed STEP"), then runs the steps
after it up to STEPS - 1, printing each step number after its `should_save`. The manager
has no interval, so the only checkpoints are the preemption save (then it prints
"preempted STEP" and exits 0) and the final save after the last step ("finished STEP").
"""

import os
import sys
import time

os.environ["JAX_PLATFORMS"] = "cpu"

import numpy as np  # noqa: E402

from eqx_train.checkpoints import CheckpointManager  # noqa: E402

directory, steps = sys.argv[1], int(sys.argv[2])
fresh = {"step": np.asarray(-1), "w": np.zeros(4, np.float32)}

with CheckpointManager(directory) as manager:
    state = manager.restore(fresh)
    start = int(state["step"]) + 1
    if start > 0:
        print("resumed", int(state["step"]), flush=True)
    step = start
    for step in range(start, steps):
        state = {"step": np.asarray(step), "w": state["w"] + 1}  # the training step
        time.sleep(0.001)  # a step takes time: the signal lands between steps
        if manager.should_save(step):
            manager.save(step, state)
        print(step, flush=True)
        if manager.preempted:
            print("preempted", step, flush=True)
            break
    else:
        manager.save(step, state)
        print("finished", step, flush=True)
