"""Replica-parallel saves and read-once restores, checked without a multi-process job: the
manager's option, the rule that splits a replicated block (on stand-in shardings, for any
number of holders), an index whose runs do not tile a block, and a single-process job,
which never takes part in the read-once exchange."""

import json
import math
from typing import cast

import jax
import ml_dtypes
import numpy as np
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints.format import _format, _names, _shards
from eqx_train.checkpoints.manager import _manager
from eqx_train.checkpoints.pipeline import _coordination, _multiprocess, _read_once, _restore

_TOKEN = _names.new_token()


@pytest.mark.parametrize("replica_parallel", [True, False])
def test_the_managers_replica_parallel_reaches_its_saves_and_every_kind_of_restore(
    tmp_path, monkeypatch, replica_parallel
):
    seen = []
    real_save, real_restore = _manager.save_pipeline, _restore.restore_from

    def save(*args, **kwargs):
        seen.append(("save", kwargs["options"].replica_parallel))
        return real_save(*args, **kwargs)

    def restore(*args, **kwargs):
        seen.append(("restore", kwargs["options"].replica_parallel))
        return real_restore(*args, **kwargs)

    monkeypatch.setattr(_manager, "save_pipeline", save)
    monkeypatch.setattr(_restore, "restore_from", restore)
    manager = checkpoints.CheckpointManager(
        tmp_path, best_metric="loss", replica_parallel=replica_parallel
    )
    assert manager.replica_parallel is replica_parallel
    state = {"w": np.arange(3, dtype=np.float32)}
    manager.save(1, state, metrics={"loss": 0.5})
    manager.restore(state)  # the latest, with the fallback
    manager.restore(state, step=1)
    manager.restore(state, step="best")
    manager.restore(state, fallback=False)
    assert seen == [("save", replica_parallel)] + [("restore", replica_parallel)] * 4


def test_the_manager_refuses_a_replica_parallel_that_is_not_a_bool(tmp_path, without_type_checks):
    with pytest.raises(ValueError, match="replica_parallel must be True or False, got 'no'"):
        checkpoints.CheckpointManager(tmp_path, replica_parallel="no")  # pyright: ignore[reportArgumentType]  # a wrong value on purpose


class _Device:
    def __init__(self, process_index):
        self.process_index = process_index


class _Shard:
    def __init__(self, index, data):
        self.index, self.data = index, data


class _Sharding:
    def __init__(self, cells):
        self.cells = cells

    def devices_indices_map(self, shape):
        return dict(self.cells)


class _Array:
    """Stands in for a global array: device i lives on process i; devices i and j hold the
    same block when i % blocks == j % blocks (blocks cut along axis 0, the last one short
    when the axis does not divide)."""

    def __init__(self, value, processes, blocks, process, reverse=False):
        rows = value.shape[0] if value.ndim else 0
        step = -(-rows // blocks) if blocks > 1 else rows
        cells = []
        for device in range(processes):
            b = device % blocks
            first = (slice(b * step, min((b + 1) * step, rows)),) if blocks > 1 else ()
            index = first + (slice(None),) * (value.ndim - len(first))
            cells.append((_Device(device), index))
        if reverse:  # the map's order is no part of the rule
            cells.reverse()
        self.sharding = _Sharding(cells)
        self.addressable_shards = [
            _Shard(index, value[index]) for d, index in cells if d.process_index == process
        ]


_CASES = [  # shape, processes, blocks (the array is replicated processes / blocks times)
    ((64, 32), 2, 1),
    ((5, 3), 2, 1),  # a first axis the holders do not divide
    ((7,), 3, 1),
    ((1, 6), 4, 1),  # too short along axis 0: cut along axis 1
    ((9, 2), 4, 2),  # uneven blocks (5 and 4 rows), each on 2 processes
    ((3,), 4, 1),  # fewer elements than holders: written whole, once
    ((), 2, 1),  # a scalar
    ((0, 4), 2, 1),  # empty
    ((0,), 2, 1),
]


@pytest.mark.parametrize(("shape", "processes", "blocks"), _CASES)
def test_the_runs_every_process_plans_alone_tile_each_replicated_block_exactly_once(
    shape, processes, blocks, without_type_checks
):
    """Each process computes its runs from the sharding alone, whatever the order of the
    sharding's map: together they tile the array (the index check the reader makes), and
    each holder writes an even share of each block it holds (within one slab of the cut)."""
    value = (np.arange(math.prod(shape)) % 251).reshape(shape).astype(ml_dtypes.bfloat16)
    pieces, shares = [], []
    for process in range(processes):
        runs = [
            _multiprocess._replica_runs(
                cast(jax.Array, _Array(value, processes, blocks, process, rev)),
                shape,
                process,
                False,
            )
            for rev in (False, True)
        ]
        assert [r[0] for r in runs[0]] == [r[0] for r in runs[1]]
        shares.append(0)
        for k, (ranges, get, _, _) in enumerate(runs[0]):
            data = get()
            np.testing.assert_array_equal(data, value[tuple(slice(a, b) for a, b in ranges)])
            shares[-1] += data.size
            pieces.append(
                {"file": _names.piece_file(process, _TOKEN), "tensor": f"x.{k}", "index": ranges}
            )
    table = {"x": {"shape": list(shape), "dtype": "BF16", "pieces": pieces}}
    _shards.validate_arrays(table, AssertionError)
    long_enough = [n for n in shape if n >= processes]
    if blocks == 1 and long_enough and math.prod(shape):
        # Replicated on every process: the shares differ by at most one slab of the cut.
        assert max(shares) - min(shares) <= math.prod(shape) // min(long_enough), shares


def _crafted(tmp_path, pieces):
    """A 2-process `.shards` checkpoint of x = arange(8), whose index is then rewritten to
    cite `pieces` (runs of the two piece files, as (process, start, stop))."""
    path = tmp_path / "checkpoint_1.shards"
    path.mkdir()
    value = np.arange(8, dtype=np.float32)
    runs = {0: [], 1: []}
    for process, start, stop in pieces:
        runs[process].append((start, stop))
    for process, mine in runs.items():
        tensors, where = [], {}
        for k, (start, stop) in enumerate(mine):
            name = f"x.{k}"
            part = value[start:stop]
            tensors.append(_Tensor(name, part))
            where[name] = {"leaf": "x", "index": [[start, stop]]}
        with open(path / _names.piece_file(process, _TOKEN), "wb") as out:
            _format.write_file(out, tensors, {_names.PIECES_KEY: json.dumps(where)})
    cited = [
        {
            "file": _names.piece_file(process, _TOKEN),
            "tensor": f"x.{sum(1 for p, *_ in pieces[:i] if p == process)}",
            "index": [[start, stop]],
        }
        for i, (process, start, stop) in enumerate(pieces)
    ]
    arrays = {"x": {"shape": [8], "dtype": "F32", "pieces": cited}}
    with open(path / _names.INDEX_NAME, "wb") as out:
        _format.write_file(out, [], {_names.ARRAYS_KEY: json.dumps(arrays)})
    return path


def _Tensor(name, array):
    from eqx_train.checkpoints.format import _description

    return _description.Tensor(name, lambda: array, array.dtype, array.shape)


def test_a_well_formed_crafted_index_restores(tmp_path):
    """The control of the two tests below: the same construction, with runs that tile."""
    path = _crafted(tmp_path, [(0, 0, 4), (1, 4, 8)])
    restored = checkpoints.restore_checkpoint(path, None)
    np.testing.assert_array_equal(restored["x"], np.arange(8, dtype=np.float32))


@pytest.mark.parametrize(
    "pieces",
    [
        [(0, 0, 5), (1, 3, 8)],  # overlapping runs (their volume too large)
        [(0, 0, 4), (1, 0, 4)],  # one run twice, the other half missing (volume right)
        [(0, 0, 3), (1, 4, 8)],  # a row missing
        [(0, 0, 4), (1, 2, 6), (1, 6, 8)],  # overlapping, the volume right
    ],
    ids=["overlap", "duplicate", "hole", "overlap_same_volume"],
)
def test_an_index_whose_runs_do_not_tile_a_block_is_a_format_error(tmp_path, pieces):
    path = _crafted(tmp_path, pieces)
    for target in (None, {"x": np.zeros(8, np.float32)}):
        with pytest.raises(checkpoints.CheckpointFormatError, match="checkpoint_1.shards"):
            checkpoints.restore_checkpoint(path, target)


def test_a_single_process_job_never_enters_the_read_once_exchange(tmp_path, monkeypatch):
    """With one process there is no peer to wait for: a sharded target of a `.shards`
    checkpoint is read block by block, and no exchange is numbered or made."""
    asked = []
    monkeypatch.setattr(_coordination, "next_number", lambda kind: asked.append(kind) or 0)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    value = np.arange(12, dtype=np.float32).reshape(4, 3)
    tree = {"w": jax.device_put(value, replicated)}
    assert _read_once.staging_sharding(tree["w"]) is None
    checkpoints.save_checkpoint_multiprocess(tmp_path, tree, 1)
    restored = checkpoints.restore_checkpoint(tmp_path, {"w": jax.numpy.zeros_like(tree["w"])})
    np.testing.assert_array_equal(np.asarray(restored["w"]), value)
    assert "read_once" not in asked, asked
