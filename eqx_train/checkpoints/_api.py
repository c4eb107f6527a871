"""The public checkpoint functions of flax's API: save_checkpoint /
save_checkpoint_multiprocess / latest_checkpoint / available_steps here, restore_checkpoint
in `_restore_api`. Each checks its keyword arguments once into a `SaveOptions` or
`RestoreOptions` and names itself for the errors of everything below it
(`_errors.calling`); the stages are the pipeline's (`pipeline._save`, `pipeline._restore`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from .._calls import calling
from .._progress import Progress
from .format import _names
from .pipeline import _directory, _save
from .pipeline._async import AsyncManager
from .pipeline._options import SaveOptions, SnapshotMode
from .pipeline._window import DEFAULT_HOST_WINDOW_BYTES
from .storage import _locations


def save_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    target: Any,
    step: _names.Step,
    prefix: str = "checkpoint_",
    keep: int = 1,
    overwrite: bool = False,
    keep_every_n_steps: int | float | None = None,
    async_manager: AsyncManager | None = None,
    *,
    snapshot: SnapshotMode = "auto",
    host_window_bytes: int = DEFAULT_HOST_WINDOW_BYTES,
    storage_options: Mapping[str, Any] | None = None,
    filter_spec: Any = None,
    progress: Progress = None,
) -> str:
    """Saves `target` as `{ckpt_dir}/{prefix}{step}.safetensors` and prunes old checkpoints.

    The file is a plain safetensors file (tensor names are the leaves' key paths joined by
    `.`, e.g. `model.layers.0.weight`) that any safetensors reader opens; its metadata
    describes the tree so that `restore_checkpoint(path, None)` can rebuild it, and holds a
    checksum of every tensor. It is written to a temporary file, fsynced, atomically renamed
    into place and the directory fsynced: a crash at any moment leaves either the old set of
    checkpoints or the new one, never a half-written file under a checkpoint name. Old files
    are deleted only afterwards, and so are the temporary files of earlier saves that were
    killed.

    **Arguments:**

    - `ckpt_dir`: directory of the checkpoints (created if missing): a local path or an
      object-store URL, `s3://bucket/run`, `gs://bucket/run`, `memory://run`,
      `file:///abs/path` (see [Cloud storage and preemption](../cloud_storage.md)). On an
      object store the file is uploaded under its final name and appears only when the
      upload completes.
    - `target`: any pytree: dicts/lists/tuples, Equinox modules, a `TrainState`. Array leaves
      (JAX, NumPy, typed PRNG keys, Python and NumPy scalars) are saved bit-exactly in their
      own dtype; strings are kept in the metadata; other leaves (functions, static fields) are
      not saved and come back from the target on restore.
    - `step`: an int or float >= 0; it orders the checkpoints numerically. Equal numbers are
      one step: `1`, `1.0` and `np.int64(1)` all name `{prefix}1.safetensors`.
    - `prefix`: file name prefix: no path separator, no leading `.`, no trailing digit.
    - `keep`: how many of the newest checkpoints to keep (>= 1).
    - `overwrite`: if False, a `step` not newer than the latest checkpoint is an error. If
      True, the file for `step` is replaced and every newer checkpoint removed (as flax).
    - `keep_every_n_steps`: additionally keep older checkpoints, by flax's rule: walking the
      checkpoints older than the newest `keep` from the oldest, keep a step when it is at
      least this many steps past the last step kept this way (step 0 is never kept by it).
    - `async_manager`: if given, snapshot `target` now and write in the background; a save
      asked for while this one is written is queued behind it (at most two snapshots held,
      memory allowing; else it waits), and raises this one's error if it failed. The caller
      may donate or overwrite its buffers as soon as this returns (see
      [Checkpointing on GPUs](../checkpointing_on_gpus.md)).
    - `snapshot`: how an async save snapshots the array leaves. `"device"`: a copy on their
      own devices (one jitted copy, same shardings; costs 1× their size in device memory
      until each leaf is written; `MemoryError`, naming the bytes needed and free, and
      nothing saved, if the devices have no room for it); `"host"`: a copy in host
      memory, leaf by leaf, before returning (blocks for the transfer; costs 1× the state
      in host memory); `"auto"` (default): on the devices when the copy fits in their free
      memory, else on the host, with a warning the first time; on CPU devices, no copy:
      their buffers are held in place (the runtime does not donate them) until written.
      NumPy and scalar leaves are always copied on the host.
      Ignored without `async_manager`.
    - `host_window_bytes`: the most leaf bytes the save holds on the host at once (at least
      one leaf); default 256 MiB. The next leaves' transfers run while earlier ones are
      hashed and written.
    - `storage_options`: for an object-store URL, options of its fsspec filesystem
      (credentials, `client_kwargs={"endpoint_url": ...}`); the standard environment
      variables (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, ...) apply too. Besides,
      `"deadline_s"` bounds the time all of this save's requests may take together (1800 s
      by default; then `TimeoutError` naming the URL, see docs/cloud_storage.md).
    - `filter_spec`: save only the leaves it selects, Equinox's convention (as in
      `eqx.tree_serialise_leaves`): a filter such as `eqx.is_array` (the arrays, no Python
      configuration), a bool, or a pytree prefix of `target` of those. The file records
      `None` for the leaves left out. Default: every leaf.
    - `progress`: show the write's progress: `True` draws a tqdm bar on stderr (bytes, rate,
      ETA; only once the write has taken about a second; needs `tqdm`), or pass a function,
      called as `fn(done_bytes, total_bytes)` as the tensor bytes are written, from the
      thread that writes (a background thread with `async_manager`). `total_bytes` may grow
      as files begin. Default: no report, at no cost.

    **Returns:**

    The path of the checkpoint file (being written, if `async_manager` is given).

    **Raises:**

    `ValueError` for a step that is not newer than the latest (without `overwrite`), an
    invalid prefix, or a tensor name that is reserved (`__metadata__`), not valid UTF-8, or
    shared by two leaves (a key containing `.`); `TypeError` naming the leaf path for
    a dtype safetensors cannot hold; `OSError` when the disk is full (previous checkpoints
    untouched, no temporary file left behind). Nothing is written or deleted when it raises
    before writing.
    """
    with calling("save_checkpoint"):
        options = SaveOptions(
            prefix=prefix,
            overwrite=overwrite,
            retention=_directory.flax_retention(keep, keep_every_n_steps),
            snapshot=snapshot,
            host_window_bytes=host_window_bytes,
            filter_spec=filter_spec,
            progress=progress,
        )
        return _save.save(
            ckpt_dir,
            target,
            step,
            options,
            storage_options=storage_options,
            async_manager=async_manager,
        )


def save_checkpoint_multiprocess(
    ckpt_dir: str | os.PathLike[str],
    target: Any,
    step: _names.Step,
    prefix: str = "checkpoint_",
    keep: int = 1,
    overwrite: bool = False,
    keep_every_n_steps: int | float | None = None,
    async_manager: AsyncManager | None = None,
    *,
    timeout_s: int | float = 300.0,
    snapshot: SnapshotMode = "auto",
    host_window_bytes: int = DEFAULT_HOST_WINDOW_BYTES,
    storage_options: Mapping[str, Any] | None = None,
    filter_spec: Any = None,
    replica_parallel: bool = True,
    progress: Progress = None,
) -> str:
    """Saves a checkpoint of arrays sharded over several processes; call it on every process.

    Each process writes only the shards it holds into its own safetensors file, so no
    array is ever gathered; a block replicated on several processes is cut into one run
    per process and each writes its own run (see [Multi-host training](../multi_host.md)).
    Host-local leaves (NumPy arrays, scalars, fully addressable arrays) are written by
    process 0. When every process's file is durable, process 0 writes
    the index (global shapes, dtypes, which file holds which slice, the tree description,
    checksums): that write is the commit. Then it applies retention. A process dying
    mid-save leaves the previous checkpoint as the latest; the others raise
    `BarrierTimeoutError` after `timeout_s` seconds instead of hanging. Overwriting a step
    switches from the old pieces to the new ones atomically: old or new, never neither.

    **Arguments:** as `save_checkpoint`, plus

    - `timeout_s`: how long a process waits for its peers at each synchronisation point
      (through the coordination service of `jax.distributed`; no shared file system is
      needed for it).
    - `replica_parallel`: split the writing of replicated blocks between the processes
      holding them (default). With False, each block is written whole by the device with
      `replica_id == 0`, as earlier versions did (for a replicated state: by process 0
      alone); both layouts restore the same.

    `ckpt_dir` must name the same storage on every process: an object-store URL, or a
    directory of a file system every process mounts. With `progress`, each process reports
    the bytes of its own pieces.

    **Returns:**

    The path of the checkpoint directory, `{ckpt_dir}/{prefix}{step}.shards`.
    """
    with calling("save_checkpoint_multiprocess"):
        options = SaveOptions(
            prefix=prefix,
            overwrite=overwrite,
            retention=_directory.flax_retention(keep, keep_every_n_steps),
            snapshot=snapshot,
            host_window_bytes=host_window_bytes,
            filter_spec=filter_spec,
            multiprocess=True,
            timeout_s=timeout_s,
            replica_parallel=replica_parallel,
            progress=progress,
        )
        return _save.save(
            ckpt_dir,
            target,
            step,
            options,
            storage_options=storage_options,
            async_manager=async_manager,
        )


def latest_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    prefix: str = "checkpoint_",
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> str | None:
    """Returns the path of the checkpoint with the highest step in `ckpt_dir`, or None.

    Steps compare numerically (`9 < 10`, `0.5 < 1e5`); names that are not exactly
    `{prefix}{number}.safetensors` (a regular file) or a committed `{prefix}{number}.shards`
    directory (notes, temporary files, other prefixes) are ignored. `ckpt_dir` may be an
    object-store URL (then `storage_options` as for `save_checkpoint`).
    """
    with calling("latest_checkpoint"):
        store, where = _locations.resolve(ckpt_dir, storage_options)
        newest = _directory.latest(_directory.list_checkpoints(store, where, prefix))
    return None if newest is None else newest.path


def available_steps(
    ckpt_dir: str | os.PathLike[str],
    prefix: str = "checkpoint_",
    step_type: Callable[[str], Any] = int,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> list[Any]:
    """Returns the steps of all checkpoints in `ckpt_dir`, sorted numerically, each once.

    **Arguments:**

    - `ckpt_dir`: the checkpoint directory (missing: `[]`).
    - `prefix`: file name prefix.
    - `step_type`: `int` (default) or `float`; an int step type on non-integral steps raises.
    - `storage_options`: for an object-store URL, options of its fsspec filesystem
      (credentials, `client_kwargs={"endpoint_url": ...}`); the standard environment
      variables (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, ...) apply too.
    """
    with calling("available_steps"):
        store, where = _locations.resolve(ckpt_dir, storage_options)
        listing = _directory.list_checkpoints(store, where, prefix)
    texts = list({e.value: e.text for e in listing}.values())
    if step_type is int:
        steps = [_names.step_from_text(text) for text in texts]
        odd = [s for s in steps if not isinstance(s, int)]
        if odd:
            raise ValueError(f"checkpoint step {odd[0]} is not an integer; pass step_type=float.")
        return steps
    return [step_type(text) for text in texts]
