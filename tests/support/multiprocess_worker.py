"""Worker for tests/test_checkpoints_multiprocess.py: one JAX process of a loopback job.

    python multiprocess_worker.py MODE PROCESS_ID NUM_PROCESSES PORT DIR [OTHER_DIR]

Prints "OK <mode> <process>" on success; any failure is an exception (non-zero exit).
"""

import os
import sys
from typing import Any

mode, pid, count, port, directory = (
    sys.argv[1],
    int(sys.argv[2]),
    int(sys.argv[3]),
    sys.argv[4],
    sys.argv[5],
)
other = sys.argv[6] if len(sys.argv) > 6 else None
# The replica-parallel modes ("rp_..."): one device per process, as one host per process.
local_devices = 1 if mode.startswith("rp_") else 8 if count == 1 else 2
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={local_devices}"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

if mode.startswith("rp_"):  # the read-once restore's all-gather runs over gloo
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except AttributeError:  # a JAX without the option, where gloo is the only choice
        pass
if count > 1:
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=count, process_id=pid
    )

from eqx_train import checkpoints  # noqa: E402


def values(step):
    return {
        "a": np.arange(8 * 6, dtype=np.float32).reshape(8, 6) + step,
        "b": np.arange(4, dtype=np.int32) * step,
        "c": np.linspace(0, 1, 3) + step,
    }


def global_tree(step, mesh, spec_a):
    v = values(step)

    def place(x, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    return {"a": place(v["a"], spec_a), "b": place(v["b"], P()), "c": v["c"], "n": step}


def check(tree, step):
    expected = values(step)
    for key in ("a", "b"):
        for shard in tree[key].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), expected[key][shard.index])
    np.testing.assert_array_equal(tree["c"], expected["c"])
    assert tree["n"] == step


mesh_1d = Mesh(np.array(jax.devices()), ("d",))


def rp_values(step):
    """Independent of the process count: what every replica-parallel mode saves."""
    import ml_dtypes

    return {
        "rep": np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + step,
        "part": (np.arange(64 * 32).reshape(64, 32) % 251 + step).astype(ml_dtypes.bfloat16),
        "model": {"weight": np.arange(12, dtype=np.float32).reshape(3, 4) - step},
        "host": np.arange(16, dtype=np.float32) * step,
        "n": step,
    }


def rp_tree(step, shardings=None):
    """Replicated ('rep', the model), sharded over 2 processes and replicated over the
    others ('part'; mesh x=2 by y=count/2), host-local ('host', 'n'), on this job."""
    import equinox as eqx

    devices = np.array(jax.devices())
    replicated = NamedSharding(Mesh(devices, ("d",)), P())
    rows = 2 if len(devices) % 2 == 0 else 1
    partly = NamedSharding(Mesh(devices.reshape(rows, -1), ("x", "y")), P("x"))
    v = rp_values(step)

    def place(x, sharding):
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    model = eqx.nn.Linear(4, 3, use_bias=False, key=jax.random.key(0))
    model = eqx.tree_at(lambda m: m.weight, model, place(v["model"]["weight"], replicated))
    return {
        "rep": place(v["rep"], replicated),
        "part": place(v["part"], partly),
        "model": model,
        "host": v["host"],
        "n": v["n"],
    }


def rp_check(tree, step):
    expected = rp_values(step)
    for got, want in [
        (tree["rep"], expected["rep"]),
        (tree["part"], expected["part"]),
        (tree["model"].weight, expected["model"]["weight"]),
    ]:
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
        for shard in got.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index], strict=True)
    np.testing.assert_array_equal(tree["host"], expected["host"], strict=True)
    assert tree["n"] == step


def rp_restore(path, step, restore=None, **options):
    """Restores `path` onto this job's tree, checks it, and returns the tensor bytes this
    process read from the checkpoint's piece files (what a verified read fetches)."""
    import math

    from eqx_train.checkpoints.format import _reader

    counted = [0]
    real_fill = _reader.FileReader._fill

    def fill(self, info, out, verify):
        if "process_" in self.path:
            counted[0] += math.prod(info.shape) * info.dtype.itemsize
        return real_fill(self, info, out, verify)

    _reader.FileReader._fill = fill
    try:
        restore = restore or checkpoints.restore_checkpoint
        rp_check(restore(path, rp_tree(0), **options), step)
    finally:
        _reader.FileReader._fill = real_fill
    return counted[0]


# The replica-parallel option, where this code has it (not when it writes a fixture of the
# layout before it, with PYTHONPATH naming that code).
rp_options: dict[str, Any] = (
    {} if "RP" not in os.environ else {"replica_parallel": os.environ["RP"] == "1"}
)

if mode == "save_restore":
    for step in (1, 2, 3):
        checkpoints.save_checkpoint_multiprocess(
            directory, global_tree(step, mesh_1d, P("d")), step, keep=2, timeout_s=60
        )
    assert checkpoints.available_steps(directory) == [2, 3], checkpoints.available_steps(directory)
    checkpoints.save_checkpoint_multiprocess(
        directory, global_tree(20, mesh_1d, P("d")), 2, keep=2, overwrite=True, timeout_s=60
    )
    assert checkpoints.available_steps(directory) == [2]
    restored = checkpoints.restore_checkpoint(directory, global_tree(0, mesh_1d, P("d")))
    check(restored, 20)
    # The path the save returns is itself restorable.
    path = os.path.join(directory, "checkpoint_2.shards")
    check(checkpoints.restore_checkpoint(path, global_tree(0, mesh_1d, P("d"))), 20)
    # Asynchronous multi-process saves: snapshot at the call, one in flight, errors kept.
    manager = checkpoints.AsyncManager()
    for step in (30, 31):
        checkpoints.save_checkpoint_multiprocess(
            directory + "_async",
            global_tree(step, mesh_1d, P("d")),
            step,
            keep=1,
            async_manager=manager,
            timeout_s=60,
        )
    manager.wait_previous_save()
    assert checkpoints.available_steps(directory + "_async") == [31]
    check(checkpoints.restore_checkpoint(directory + "_async", global_tree(0, mesh_1d, P("d"))), 31)
    try:
        checkpoints.save_checkpoint(directory + "_single", global_tree(1, mesh_1d, P("d")), 1)
    except ValueError as error:
        assert "save_checkpoint_multiprocess" in str(error)
    else:
        raise AssertionError("single-host save of a global array did not fail")
elif mode == "reshard_to_one":  # 1 process x 8 devices reads a 2 x 2 checkpoint
    mesh_2d = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    restored = checkpoints.restore_checkpoint(directory, global_tree(0, mesh_2d, P("x", "y")))
    check(restored, 20)
    as_saved = checkpoints.restore_checkpoint(directory, None)
    np.testing.assert_array_equal(as_saved["a"], values(20)["a"])
    np.testing.assert_array_equal(as_saved["b"], values(20)["b"])
    assert as_saved["n"] == 20
    spec = global_tree(7, mesh_2d, P("x", "y"))  # another partitioning: 4 x 2 blocks
    assert other is not None, "this mode takes OTHER_DIR"
    checkpoints.save_checkpoint_multiprocess(other, spec, 7, timeout_s=60)
elif mode == "reshard_back":  # 2 processes x 2 devices read a 1 x 8 checkpoint
    restored = checkpoints.restore_checkpoint(
        directory,
        {
            "a": jax.ShapeDtypeStruct((8, 6), np.float32, sharding=NamedSharding(mesh_1d, P("d"))),
            "b": global_tree(0, mesh_1d, P("d"))["b"],
            "c": np.zeros(3),
            "n": 0,
        },
    )
    check(restored, 7)
elif mode == "manager":
    manager = checkpoints.CheckpointManager(
        directory, keep_latest=1, keep_best=1, best_metric="loss", timeout_s=60
    )
    for step, loss in zip((1, 2, 3, 4), (0.5, 0.1, 0.4, 0.3), strict=True):
        manager.save(
            step,
            global_tree(step, mesh_1d, P("d")),
            metrics={"loss": loss},
            metadata={"lr": 0.01, "step": step},
        )
    assert manager.all_steps() == [2, 4], manager.all_steps()
    assert manager.best_step() == 2 and manager.metrics(2) == {"loss": 0.1}
    assert manager.metadata(4) == {"lr": 0.01, "step": 4}
    check(manager.restore(global_tree(0, mesh_1d, P("d")), step="best"), 2)
    check(manager.restore(global_tree(0, mesh_1d, P("d"))), 4)
    # should_save: process 0 decides, every process gets its answer. Process 1's clock is
    # skewed far ahead; were it asked, it would say yes to the time interval every time.
    policy = checkpoints.CheckpointManager(
        directory + "_policy", save_interval_steps=3, save_interval_seconds=3600, timeout_s=60
    )
    if pid == 1:
        from eqx_train.checkpoints.manager import _manager

        _manager._clock = lambda: 1e12
    decisions = [policy.should_save(step) for step in range(7)]
    assert decisions == [True, False, False, True, False, False, True], decisions
    # A corruption only process 1 reads (its own piece of step 4): both fall back to step 2.
    import glob
    import warnings

    from eqx_train.checkpoints.pipeline import _coordination

    def barrier():
        _coordination.barrier(_coordination.next_id("test"), timeout_s=60)

    barrier()
    if pid == 1:
        (piece,) = glob.glob(os.path.join(directory, "checkpoint_4.shards", "process_00001.*"))
        with open(piece, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)[0]
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last ^ 0xFF]))
    barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check(manager.restore(global_tree(0, mesh_1d, P("d"))), 2)
    assert len(caught) == 1 and "checkpoint_4.shards" in str(caught[0].message), caught
    # Process 0 moved the corrupt step aside, for every process: step 4 saves again.
    moved = os.path.join(directory, "corrupt-checkpoint_4.shards")
    assert moved in str(caught[0].message), caught
    assert manager.all_steps() == [2], manager.all_steps()
    manager.save(4, global_tree(4, mesh_1d, P("d")), metrics={"loss": 0.3})
    check(manager.restore(global_tree(0, mesh_1d, P("d"))), 4)
elif mode == "zero_fails":
    checkpoints.save_checkpoint_multiprocess(
        directory, global_tree(1, mesh_1d, P("d")), 1, timeout_s=60
    )
    if pid == 0:
        from eqx_train.checkpoints.pipeline import _multiprocess

        def fail(*args, **kwargs):
            raise OSError(28, "No space left on device")

        _multiprocess._collect_index = fail
    try:
        checkpoints.save_checkpoint_multiprocess(
            directory, global_tree(2, mesh_1d, P("d")), 2, timeout_s=60
        )
    except (OSError, RuntimeError) as error:
        assert ("No space" in str(error)) if pid == 0 else ("did not commit" in str(error))
    else:
        raise AssertionError(f"process {pid}: a save that process 0 failed returned normally")
    assert checkpoints.available_steps(directory) == [1]
    check(checkpoints.restore_checkpoint(directory, global_tree(0, mesh_1d, P("d"))), 1)
elif mode == "disagree":
    checkpoints.save_checkpoint_multiprocess(
        directory, global_tree(1, mesh_1d, P("d")), 1, keep=1, timeout_s=60
    )

    def place(x, spec):
        sharding = NamedSharding(mesh_1d, spec)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    good = global_tree(2, mesh_1d, P("d"))
    a = values(2)["a"]
    variants = {  # process 1's tree, and the difference the error must name
        "dtype": (
            {**good, "a": place(a.astype(np.float16), P("d"))},
            "leaf 'a' is float32[8, 6] sharded as NamedSharding(mesh {'d': 4}, ",
            "'d',)) on process 0 but float16[8, 6] sharded as",
        ),
        "shape": ({**good, "a": place(a[:, :5], P("d"))}, "float32[8, 5]"),
        "sharding": ({**good, "a": place(a, P())}, "on process 1"),
        "host_local_extra": (
            {**good, "extra": np.zeros(3)},
            "leaf 'extra' is saved by process 1 but not by process 0",
        ),
        "host_local_vs_global": ({**good, "c": place(values(2)["c"], P())}, "leaf 'c' is"),
        "structure": (
            {**good, "s": "one"} if pid == 0 else {**good, "s": "two"},
            "at 's': the string 'one' vs the string 'two'",
        ),
    }
    for variant, (tree, *expected) in variants.items():
        mine = tree if pid == 1 or variant == "structure" else good
        try:
            checkpoints.save_checkpoint_multiprocess(directory, mine, 2, keep=1, timeout_s=60)
        except ValueError as error:
            message = str(error)
            assert "disagree on what to save" in message, (variant, message)
            assert all(part in message for part in expected), (variant, message)
        else:
            raise AssertionError(f"process {pid}: {variant}: the save did not fail")
        assert checkpoints.available_steps(directory) == [1], (variant, os.listdir(directory))
        assert not os.path.exists(os.path.join(directory, "checkpoint_2.shards")), variant
    try:  # the step itself
        checkpoints.save_checkpoint_multiprocess(directory, good, 2 + pid, keep=1, timeout_s=60)
    except ValueError as error:
        assert "disagree on the step (process 0: '2', process 1: '3')" in str(error), error
    else:
        raise AssertionError("a save with different steps did not fail")
    checkpoints.save_checkpoint_multiprocess(directory, good, 2, keep=1, timeout_s=60)
    assert checkpoints.available_steps(directory) == [2]
    check(checkpoints.restore_checkpoint(directory, global_tree(0, mesh_1d, P("d"))), 2)
elif mode == "desync":
    from eqx_train.checkpoints.pipeline import _multiprocess

    def save(step, tree_step, **kwargs):
        tree = global_tree(tree_step, mesh_1d, P("d"))
        return checkpoints.save_checkpoint_multiprocess(directory, tree, step, **kwargs)

    def fails_everywhere(step, tree_step, own_error, peer_error, **kwargs):
        try:
            save(step, tree_step, **kwargs)
        except Exception as error:
            expected = own_error if pid == 1 else peer_error
            assert expected in str(error), (step, tree_step, repr(error))
        else:
            raise AssertionError(f"process {pid}: a save that process 1 failed succeeded")

    def on_process_1_fail_once(module, name, error):
        """Process 1's next call of `module.name` raises `error` (later calls are real)."""
        real = getattr(module, name)

        def fail_once(*args, **kwargs):
            setattr(module, name, real)
            raise error

        if pid == 1:
            setattr(module, name, fail_once)

    save(1, 1, timeout_s=60)
    # Process 1 fails before the opening exchange (a leaf it cannot save): every process
    # fails this save, and at once, not after the timeout.
    describe_fails = TypeError("injected: process 1 cannot describe its tree")
    on_process_1_fail_once(checkpoints.format._description, "describe", describe_fails)
    fails_everywhere(2, 2, "injected", "process 1 (TypeError: injected", timeout_s=60)
    save(3, 3, timeout_s=60)  # the next save works
    # The same with a fixed step and overwrite: never a checkpoint of two saves' rows.
    on_process_1_fail_once(checkpoints.format._description, "describe", describe_fails)
    fails_everywhere(3, 30, "injected", "process 1 (TypeError: injected", overwrite=True,
                     timeout_s=60)  # fmt: skip
    save(3, 31, overwrite=True, timeout_s=60)
    check(checkpoints.restore_checkpoint(directory, global_tree(0, mesh_1d, P("d"))), 31)
    # Process 1 fails after the opening exchange, while planning its pieces.
    plan_fails = MemoryError("injected: no memory for the pieces")
    on_process_1_fail_once(_multiprocess, "plan_pieces", plan_fails)
    fails_everywhere(3, 32, "injected", "process 1 (MemoryError: injected", overwrite=True,
                     timeout_s=60)  # fmt: skip
    save(3, 33, overwrite=True, timeout_s=60)
    check(checkpoints.restore_checkpoint(directory, global_tree(0, mesh_1d, P("d"))), 33)
    # Process 1 skips the opening exchange altogether: process 0 times out, then the
    # processes pair up again.
    skipped = RuntimeError("injected: process 1 left before the exchange")
    on_process_1_fail_once(_multiprocess, "agree_on_token", skipped)
    fails_everywhere(3, 34, "injected", "processes [1] did not arrive", overwrite=True,
                     timeout_s=5)  # fmt: skip
    save(3, 35, overwrite=True, timeout_s=60)
    check(checkpoints.restore_checkpoint(directory, global_tree(0, mesh_1d, P("d"))), 35)
    save(4, 4, timeout_s=60)
    assert checkpoints.available_steps(directory) == [4]
    check(checkpoints.restore_checkpoint(directory, global_tree(0, mesh_1d, P("d"))), 4)
elif mode == "rp_save":  # save step 5, restore it at once; DIR/checkpoint_5.shards
    checkpoints.save_checkpoint_multiprocess(directory, rp_tree(5), 5, timeout_s=60, **rp_options)
    path = os.path.join(directory, "checkpoint_5.shards")
    print(f"READ {pid} {rp_restore(path, 5, **rp_options)}", flush=True)
    if other is not None:  # and again, each process reading all the blocks it holds
        print(f"READ_ALL {pid} {rp_restore(path, 5, replica_parallel=False)}", flush=True)
elif mode == "bind_save":  # steps 1 and 2 in DIR, and step 2 of another run in OTHER
    for where, step, value in [(directory, 1, 100), (directory, 2, 200), (other, 2, 300)]:
        tree = global_tree(value, mesh_1d, P("d"))
        checkpoints.save_checkpoint_multiprocess(where, tree, step, keep=2, timeout_s=60)
elif mode == "bind_restore":  # DIR holds a piece of another save: every process refuses it
    try:
        checkpoints.restore_checkpoint(directory, global_tree(0, mesh_1d, P("d")))
    except checkpoints.CheckpointFormatError as error:
        print(f"REFUSED {pid} {error}", flush=True)
    else:
        raise AssertionError("a piece of another save was restored")
elif mode == "rp_manager":  # a manager with replica_parallel=False: the layout of before
    rp_manager = checkpoints.CheckpointManager(directory, replica_parallel=False, timeout_s=60)
    rp_manager.save(5, rp_tree(5))
    read = rp_restore(directory, 5, restore=lambda _, target: rp_manager.restore(target))
    print(f"READ {pid} {read}", flush=True)
elif mode == "rp_restore":  # restore DIR (a checkpoint of step OTHER) onto this job
    assert other is not None, "this mode takes the step as OTHER_DIR"
    print(f"READ {pid} {rp_restore(directory, int(other), **rp_options)}", flush=True)
elif mode == "rp_race":  # process 1 lists the directory before step 2 lands
    for step in (1, 2):
        checkpoints.save_checkpoint_multiprocess(
            directory, rp_tree(step), step, keep=2, timeout_s=60
        )
    if pid == 1:
        from eqx_train.checkpoints.pipeline import _directory

        real_list = _directory.list_checkpoints

        def stale_once(*args, **kwargs):
            _directory.list_checkpoints = real_list
            return [e for e in real_list(*args, **kwargs) if e.text != "2"]

        _directory.list_checkpoints = stale_once
    # Each process reads its half of each replicated block from the checkpoint it chose:
    # never half of step 2 and half of step 1 in one array.
    rp_check(checkpoints.restore_checkpoint(directory, rp_tree(0)), 2)
    if pid == 1:
        # bound above, where pid == 1 too; the stale listing was used:
        assert _directory.list_checkpoints is real_list  # pyright: ignore[reportPossiblyUnboundVariable]
elif mode == "rp_rename":  # read-once next to renamed, tied and cast leaves
    import warnings

    import ml_dtypes

    def keys(seed):  # typed PRNG keys, replicated on every process: one, and a batch of 3
        replicated = rp_tree(0)["rep"].sharding
        make = jax.jit(
            lambda: (jax.random.key(seed), jax.random.split(jax.random.key(seed), 3)),
            out_shardings=(replicated, replicated),
        )
        return make()

    checkpoints.save_checkpoint_multiprocess(
        directory, {**rp_tree(5), "keys": keys(5)}, 5, timeout_s=60
    )
    tree = rp_tree(0)
    target = {
        "renamed": tree["rep"],  # renamed: read once
        "tied_a": tree["model"].weight,  # two leaves from one tensor: read block by block
        "tied_b": tree["model"].weight,
        "wide": jax.ShapeDtypeStruct(  # cast on the host, replicated: block by block
            (64, 32), np.float32, sharding=tree["rep"].sharding
        ),
    }
    sources = {"renamed": "rep", "tied_a": "model.weight", "tied_b": "model.weight"}
    from eqx_train.checkpoints.pipeline import _read_once

    real_place, placed = _read_once.place, []

    def spy(*args, **kwargs):
        result = real_place(*args, **kwargs)
        placed.extend(result)
        return result

    _read_once.place = spy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", checkpoints.PartialRestoreWarning)
        got = checkpoints.restore_checkpoint(
            directory,
            target,
            strict=False,
            rename=lambda name: sources.get(name, "part" if name == "wide" else name),
            casting="safe",
        )
    assert placed == ["rep"], placed  # only the renamed leaf was read once
    want = rp_values(5)
    expected = {
        "renamed": want["rep"],
        "tied_a": want["model"]["weight"],
        "tied_b": want["model"]["weight"],
        "wide": want["part"].astype(np.float32),
    }
    assert want["part"].dtype == ml_dtypes.bfloat16
    # The keys' data, each cut between the processes at the save, read back as saved and
    # into a target of keys replicated over both processes.
    saved_keys = checkpoints.restore_checkpoint(directory, None)["keys"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", checkpoints.PartialRestoreWarning)  # the other leaves
        into_target = checkpoints.restore_checkpoint(directory, {"keys": keys(0)}, strict=False)
    local = (jax.random.key(5), jax.random.split(jax.random.key(5), 3))  # on this host
    for placed_key, want_key, like in zip(into_target["keys"], local, keys(0), strict=True):
        assert placed_key.sharding == like.sharding
        assert jax.random.key_impl(placed_key) == jax.random.key_impl(want_key)
        want_data = np.asarray(jax.random.key_data(want_key))
        for shard in jax.random.key_data(placed_key).addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want_data[shard.index])
    for got_key, want_key in zip(saved_keys, local, strict=True):
        assert jax.random.key_impl(got_key) == jax.random.key_impl(want_key)
        np.testing.assert_array_equal(
            np.asarray(jax.random.key_data(got_key)), np.asarray(jax.random.key_data(want_key))
        )
    for name, array in expected.items():
        assert got[name].dtype == array.dtype and got[name].sharding == target[name].sharding
        for shard in got[name].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), array[shard.index], strict=True)
elif mode == "rp_lone":  # process 0 restores alone once; then both restore together
    import warnings

    from eqx_train.checkpoints.pipeline import _coordination, _read_once

    def barrier():
        _coordination.barrier(_coordination.next_id("test"), timeout_s=60)

    checkpoints.save_checkpoint_multiprocess(directory, rp_tree(5), 5, timeout_s=60)
    _read_once.TIMEOUT_S = 3  # the wait for the absent peer, shortened
    if pid == 0:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rp_check(checkpoints.restore_checkpoint(directory, rp_tree(0)), 5)
        assert any("did not arrive" in str(w.message) for w in caught), caught
    barrier()
    for _ in range(2):  # each read once again, without waiting out a timeout
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            print(f"READ {pid} {rp_restore(directory, 5)}", flush=True)
        assert not caught, [str(w.message) for w in caught]
elif mode == "peer_dies":
    checkpoints.save_checkpoint_multiprocess(
        directory, global_tree(1, mesh_1d, P("d")), 1, timeout_s=60
    )
    if pid == 1:
        from eqx_train.checkpoints.storage import _fsspec, _local

        def die(*args, **kwargs):
            os._exit(3)  # killed mid-save, after the save started

        _local.LocalStorage.atomic_write = die
        _fsspec.FsspecStorage.atomic_write = die
    try:
        checkpoints.save_checkpoint_multiprocess(
            directory, global_tree(2, mesh_1d, P("d")), 2, timeout_s=4
        )
    except checkpoints.BarrierTimeoutError as error:
        assert "previous checkpoint is still the latest" in str(error)
        assert "processes [1] did not arrive" in str(error), str(error)
        assert checkpoints.available_steps(directory) == [1]
        # Restoring alone, the replicated leaf is read whole once the wait for the dead
        # peer's share runs out (shortened here), with a warning saying so.
        import warnings

        from eqx_train.checkpoints.pipeline import _read_once

        _read_once.TIMEOUT_S = 2
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check(checkpoints.restore_checkpoint(directory, global_tree(0, mesh_1d, P("d"))), 1)
        assert any("processes [1] did not arrive" in str(w.message) for w in caught), caught
        print(f"OK {mode} {pid}", flush=True)
        os._exit(0)  # the peer is gone: skip the distributed shutdown handshake
    raise AssertionError("save with a dead peer did not time out")
print(f"OK {mode} {pid}", flush=True)
if count > 1:
    jax.distributed.shutdown()
