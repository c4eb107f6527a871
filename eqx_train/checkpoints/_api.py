"""The public checkpoint functions, save_checkpoint / save_checkpoint_multiprocess /
restore_checkpoint / latest_checkpoint / available_steps, and the one save pipeline behind
every save (both layouts). Restoring is `_restore`'s."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import TYPE_CHECKING, Any, TypeVar, overload

if TYPE_CHECKING:
    import jax
else:  # imported on first use: the command line reads headers without JAX
    from .._lazy import LazyModule

    jax = LazyModule("jax")

from ._errors import StepExistsError
from .format import _description, _format, _names
from .pipeline import (
    _directory,
    _matching,
    _multiprocess,
    _restore,
    _selection,
    _snapshot,
    _transform,
    _window,
)
from .pipeline._async import AsyncManager
from .pipeline._snapshot import SnapshotMode
from .pipeline._window import DEFAULT_HOST_WINDOW_BYTES
from .storage import Storage, _locations

T = TypeVar("T")


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
    return save_pipeline(
        ckpt_dir,
        target,
        step,
        prefix=prefix,
        overwrite=overwrite,
        retention=_directory.flax_retention(keep, keep_every_n_steps, "save_checkpoint"),
        async_manager=async_manager,
        caller="save_checkpoint",
        snapshot=snapshot,
        host_window_bytes=host_window_bytes,
        storage_options=storage_options,
        filter_spec=filter_spec,
    )


def save_pipeline(
    ckpt_dir: str | os.PathLike[str],
    target: Any,
    step: _names.Step,
    *,
    prefix: str,
    overwrite: bool,
    retention: _directory.Retention,
    async_manager: AsyncManager | None,
    caller: str,
    extra_metadata: dict[str, str] | Callable[[], dict[str, str]] | None = None,
    multiprocess: bool = False,
    timeout_s: int | float = 300.0,
    snapshot: SnapshotMode = "auto",
    host_window_bytes: int = DEFAULT_HOST_WINDOW_BYTES,
    storage_options: Mapping[str, Any] | None = None,
    filter_spec: Any = None,
    replica_parallel: bool = True,
) -> str:
    """The one save path: `save_checkpoint`, `save_checkpoint_multiprocess` and
    `CheckpointManager.save` differ only in the layout (one file, or a `.shards` directory
    of per-process piece files) and so in the commit step.

    Validates everything before touching the disk, writes, commits, then (after the commit
    is durable) removes newer steps when `overwrite` and the steps `retention` names.
    """
    # First, before anything can fail: the save's number, which keys its exchanges (a
    # process that fails below still takes part in the opening exchange, so the numbers
    # stay the same on every process).
    number = _multiprocess.begin_save() if multiprocess else None

    def prepare() -> tuple[Storage, str, Decimal, str, str, Any, list, dict]:
        _snapshot.check_options(snapshot, host_window_bytes, caller)
        store, where = _locations.resolve(ckpt_dir, storage_options, caller=caller)
        if multiprocess and store.stale_by_age and timeout_s > _directory.STALE_S / 2:
            # On an object store nobody can tell a live writer's uncommitted pieces from a
            # dead one's but by age: other saves remove them after `STALE_S`.
            raise ValueError(
                f"{caller}: timeout_s={timeout_s!r} is too long for an object store; at most "
                f"{_directory.STALE_S / 2:.0f} s, since uncommitted pieces older than "
                f"{_directory.STALE_S:.0f} s count as abandoned."
            )
        _names.check_prefix(prefix, caller)
        value = _names.check_step(step, caller)
        try:
            name = _names.checkpoint_name(prefix, step, sharded=multiprocess)
        except ValueError as error:
            raise ValueError(f"{caller}: {error}") from None
        if async_manager is not None:
            # At most one save in flight (a multi-process save: none) from here on.
            async_manager.wait_until(0 if multiprocess else 1)
        store.start_deadline()  # every request of this save, from here on, shares one budget
        description, tensors = _description.describe(
            _selection.filtered_for_saving(target, filter_spec),
            caller=caller,
            allow_global=multiprocess,
        )
        step_text = _names.canonical_step(step)
        extra = extra_metadata() if callable(extra_metadata) else extra_metadata
        metadata = {**_format.base_metadata(step_text, description), **(extra or {})}
        _format.check_header_size(tensors, metadata, caller)
        if async_manager is not None and async_manager.in_flight():
            # Queued behind the save being written only where its snapshot fits next to
            # that save's; otherwise (and for a step that is not newer, or a save to an
            # object store, whose request budget has started) wait for it.
            if not (
                not store.save_deadline
                and async_manager.may_queue((where, prefix), value)
                and _snapshot.another_fits(tensors, snapshot)
            ):
                async_manager.wait_previous_save()
        store.makedirs(where)
        _directory.check_newer(store, where, prefix, value, step_text, overwrite, caller)
        return store, where, value, step_text, name, description, tensors, metadata

    if number is None:
        store, ckpt_dir, value, step_text, name, description, tensors, metadata = prepare()
    else:
        try:
            store, ckpt_dir, value, step_text, name, description, tensors, metadata = prepare()
        except Exception as error:
            # Reported to the others in the opening exchange, which then raises it here.
            _multiprocess.agree_on_token(number, error, timeout_s=timeout_s, caller=caller)
            raise  # pragma: no cover - agree_on_token raised it
    final_path = store.join(ckpt_dir, name)

    def after_commit() -> None:
        _directory.apply_retention(
            store, ckpt_dir, prefix, value, final_path, overwrite=overwrite, retention=retention
        )

    if number is not None:
        token = _multiprocess.agree_on_token(
            number, (step_text, prefix, description, tensors), timeout_s=timeout_s, caller=caller
        )
        key = _multiprocess.save_key(number, step_text)
        planned: Any
        try:
            if async_manager is not None:
                # The caller may mutate or donate its buffers as soon as we return.
                tensors = _snapshot.snapshot(
                    tensors, snapshot, caller=caller, warn=_snapshot.warn_once_per(async_manager)
                )
            planned = _multiprocess.plan_pieces(
                tensors, jax.process_index(), replica_parallel=replica_parallel
            )
        except Exception as error:  # reported when the pieces are collected
            planned = error

        def commit() -> None:
            mine = planned
            if jax.process_index() == 0:
                try:
                    _directory.remove_leftovers(
                        store, ckpt_dir, prefix, keep_token=token, current=final_path
                    )
                except Exception as error:  # reported with the pieces: all give up at once
                    mine = error
            _multiprocess.write_and_commit(
                store,
                final_path,
                token,
                key,
                mine,
                tensors,
                metadata,
                timeout_s=timeout_s,
                caller=caller,
                overwrite=overwrite,
                after_commit=after_commit,
            )

    else:
        if async_manager is not None:
            # The caller may mutate or donate its buffers as soon as we return.
            tensors = _snapshot.snapshot(
                tensors, snapshot, caller=caller, warn=_snapshot.warn_once_per(async_manager)
            )

        def commit() -> None:
            _directory.remove_leftovers(store, ckpt_dir, prefix)
            try:
                store.atomic_write(
                    final_path,
                    lambda fd: _format.write_file(fd, tensors, metadata),
                    replace=overwrite,
                )
            except FileExistsError:
                raise StepExistsError(
                    f"{caller}: a checkpoint at step {step_text} appeared in {ckpt_dir} while "
                    "this save was writing (a concurrent save); it was kept. Pass "
                    "overwrite=True to replace it."
                ) from None
            after_commit()

    def commit_within_window() -> None:
        try:
            with _window.host_window_bytes(host_window_bytes):
                commit()
        finally:
            _snapshot.release(tensors)  # what the snapshot still holds, written or not

    if async_manager is not None:
        async_manager.save_async(commit_within_window, (ckpt_dir, prefix), value)
    else:
        commit_within_window()
    return final_path


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
    directory of a file system every process mounts.

    **Returns:**

    The path of the checkpoint directory, `{ckpt_dir}/{prefix}{step}.shards`.
    """
    caller = "save_checkpoint_multiprocess"
    return save_pipeline(
        ckpt_dir,
        target,
        step,
        prefix=prefix,
        overwrite=overwrite,
        retention=_directory.flax_retention(keep, keep_every_n_steps, caller),
        async_manager=async_manager,
        caller=caller,
        multiprocess=True,
        timeout_s=timeout_s,
        snapshot=snapshot,
        host_window_bytes=host_window_bytes,
        storage_options=storage_options,
        filter_spec=filter_spec,
        replica_parallel=replica_parallel,
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
    store, where = _locations.resolve(ckpt_dir, storage_options, caller="latest_checkpoint")
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
    store, where = _locations.resolve(ckpt_dir, storage_options, caller="available_steps")
    listing = _directory.list_checkpoints(store, where, prefix)
    texts = list({e.value: e.text for e in listing}.values())
    if step_type is int:
        steps = [_names.step_from_text(text) for text in texts]
        odd = [s for s in steps if not isinstance(s, int)]
        if odd:
            raise ValueError(f"checkpoint step {odd[0]} is not an integer; pass step_type=float.")
        return steps
    return [step_type(text) for text in texts]


# ------------------------------------------------------------------------------------ restore


# For a type checker: the target's type comes back; with `target=None`, the tree as saved
# (nested dicts, lists and tuples, or None when there is no checkpoint), hence `Any`.
@overload
def restore_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    target: None,
    step: _names.Step | None = None,
    prefix: str = "checkpoint_",
    parallel: bool = True,
    *,
    strict: bool = True,
    verify: bool = True,
    host_window_bytes: int = DEFAULT_HOST_WINDOW_BYTES,
    storage_options: Mapping[str, Any] | None = None,
    config: _selection.Config = "target",
    filter_spec: Any = None,
    rename: _matching.Rename = None,
    casting: _matching.Casting = "no",
    replica_parallel: bool = True,
    transform: _transform.Transform = None,
) -> Any: ...


@overload
def restore_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    target: T,
    step: _names.Step | None = None,
    prefix: str = "checkpoint_",
    parallel: bool = True,
    *,
    strict: bool = True,
    verify: bool = True,
    host_window_bytes: int = DEFAULT_HOST_WINDOW_BYTES,
    storage_options: Mapping[str, Any] | None = None,
    config: _selection.Config = "target",
    filter_spec: Any = None,
    rename: _matching.Rename = None,
    casting: _matching.Casting = "no",
    replica_parallel: bool = True,
    transform: _transform.Transform = None,
) -> T: ...


def restore_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    target: T,
    step: _names.Step | None = None,
    prefix: str = "checkpoint_",
    parallel: bool = True,
    *,
    strict: bool = True,
    verify: bool = True,
    host_window_bytes: int = DEFAULT_HOST_WINDOW_BYTES,
    storage_options: Mapping[str, Any] | None = None,
    config: _selection.Config = "target",
    filter_spec: Any = None,
    rename: _matching.Rename = None,
    casting: _matching.Casting = "no",
    replica_parallel: bool = True,
    transform: _transform.Transform = None,
) -> T:
    """Restores a checkpoint into the structure of `target` (or as saved, if `target` is None).

    **Arguments:**

    - `ckpt_dir`: a checkpoint file or `.shards` directory, a directory of checkpoints
      (then the latest checkpoint, or `step`), or Hugging Face weights: the directory,
      `model.safetensors` or `model.safetensors.index.json`. Weights of another kind (flax
      msgpack, Orbax, a PyTorch pickle) raise `CheckpointFormatError` naming the call that
      reads them.
    - `target`: a pytree to fill: dicts, Equinox modules, a `TrainState`... Array leaves are
      read from the file by their key path; non-array leaves (activation functions, static
      fields) are kept from `target`. `jax.Array` leaves come back with the target's sharding;
      `jax.ShapeDtypeStruct` leaves become arrays of that shape, dtype and sharding; NumPy
      leaves stay NumPy; Python scalars in dicts, lists and tuples get the file's value only
      if it converts exactly; the Python scalars of Equinox modules follow `config`.
      With `target=None`, returns the saved tree as nested dicts, lists and tuples of NumPy
      arrays (Equinox modules and other nodes as dicts of their fields; empty containers as
      empty containers).
    - `step`: the step to restore from a directory; `None` for the latest.
    - `prefix`: file name prefix.
    - `parallel`: read large tensors with several threads.
    - `strict`: if True (default), every array leaf of `target` must be in the file with the
      same shape and dtype, and the file must hold nothing else. With `strict=False`, leaves
      missing from the file keep the target's value and extra tensors are ignored (shape and
      dtype must still match), and one `PartialRestoreWarning` names them.
    - `rename`: where each target leaf's values come from, by name (`layers.0.weight`, as the
      errors and `eqx-train inspect --tree` print them). A mapping of name prefixes, target
      prefix -> saved prefix: a prefix matches whole dot-separated segments, the longest
      matching one wins, and `""` is the root (`{"": "encoder"}` loads the saved `encoder`
      sub-tree into a standalone encoder). Or a function `target_name -> saved_name | None`
      (None: the leaf keeps the target's value). Unmapped names map to themselves; two
      target leaves may take the same saved tensor (tied weights). A mapping entry that
      applies to no target leaf is an error. See `plan_restore` to check one first.
    - `casting`: which dtype changes are allowed, in NumPy's vocabulary, judged by
      `numpy.can_cast(saved dtype, target dtype, casting)`: `"no"` (default: dtypes must be
      equal), `"equiv"`, `"safe"`, `"same_kind"` (float32 into bfloat16, say) or `"unsafe"`.
      The cast happens on the host, before the leaf is placed on its devices, and is
      NumPy's: a value out of the target's range becomes `inf` (float32 `1e6` into float16)
      without a warning. PRNG key leaves are never cast.
    - `transform`: reshape saved tensors stored in another layout than the target's (a
      transposed kernel, a fused QKV projection) after reading, before the cast and the
      shape check. A mapping of target name prefixes to functions `array -> array` (the
      longest matching prefix wins; an entry that applies to no target leaf is an error),
      or a function `(target_name, array) -> array | None` (None: no transform for that
      leaf). Each function receives the saved tensor as a read-only NumPy array (several
      leaves may be cut from one saved tensor; `rename` several targets to it) and may
      return a NumPy or JAX array (converted back with `np.asarray`; prefer NumPy
      functions and array methods, which stay on the host). It is first run under
      `jax.eval_shape` on a `jax.ShapeDtypeStruct` of the saved tensor, so that the shapes
      are checked before any data is read: it must trace (`a.T`, `a.transpose(1, 0)`,
      `a.reshape(...)`, `a[..., :n]`, `jnp.split(a, 3)[0]`, not `np.asarray(a)` or Python
      decisions on values). It may be called from several threads at once.
    - `verify`: check every tensor read against the checksum recorded when it was saved
      (default). Files written before checksums existed have nothing to check.
    - `host_window_bytes`: the most leaf bytes held on the host at once while restoring
      into a target (at least one leaf); default 256 MiB. Background threads read, verify
      and place up to four groups of leaves at once (each at most a quarter of the window,
      or one larger leaf), and each group's host bytes are let go once its leaves are on
      their devices. (With `target=None` the result itself is on the host.)
    - `storage_options`: for an object-store URL, options of its fsspec filesystem
      (credentials, `client_kwargs={"endpoint_url": ...}`); the standard environment
      variables (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, ...) apply too.
      From an object store only the byte ranges of the needed tensors are fetched, in
      parallel requests.
    - `config`: where the Python `bool`/`int`/`float` fields of the target's Equinox modules
      come from: their configuration, such as `eqx.nn.Dropout`'s `p` and `inference`.
      `"target"` (default): the target's values are kept; saved values that differ raise a
      `ConfigMismatchWarning` naming each path and both values, and a file without them
      (saved with `filter_spec=eqx.is_array`) is fine. `"saved"`: the file's values, which
      must convert exactly, as for other Python scalars.
    - `filter_spec`: restore only the leaves it selects (Equinox's convention: a filter such
      as `eqx.is_array`, a bool, or a pytree prefix of `target` of those); the others keep
      the target's values, and the file's tensors for them are ignored: those named by
      their leaves, and every one under a sub-tree it leaves out whole (a fresh `opt_state`:
      the saved optimiser state goes unused, even with `strict=True`). Default: every leaf.
    - `replica_parallel`: in a multi-process job, when the target places one block of an
      array on devices of several processes, each of them reads only its share of the
      block and one jitted resharding assembles it over the interconnect (default), so the
      job reads the checkpoint once, not once per process. Every process must then make
      the call. With False, every process reads all the blocks its devices hold.

    **Returns:**

    The restored pytree. If `ckpt_dir` does not exist, or is a directory holding no weights
    and `step` is None, `target` is returned unchanged (as flax does). A checkpoint that
    fills none of the target's leaves to restore (no name in common) is an error whatever
    `strict` says; a target without data leaves, or a `filter_spec` that selects none, is not.

    **Raises:**

    `ValueError` for a missing `step` (naming the available ones) and for a file that does
    not match `target` (listing each path with what the file has and what the target
    expects; when every array has an extra leading axis, as a state saved replicated does,
    saying so; when the saved shape is a permutation of the target's, giving the
    `transform=` that transposes it); `CheckpointFormatError` (a `ValueError`) naming the
    file if it is truncated, corrupt or fails a checksum. Only the tensors the target needs
    are read from disk.
    """
    _selection.check_config(config, "restore_checkpoint")
    _matching.check_options(
        casting,
        rename,
        "restore_checkpoint",
        target=target,
        filter_spec=filter_spec,
        transform=transform,
    )
    _window.check_window(host_window_bytes, "restore_checkpoint")
    store, where = _locations.resolve(ckpt_dir, storage_options, caller="restore_checkpoint")
    return _restore.restore(
        store,
        where,
        target,
        step,
        prefix,
        strict=strict,
        parallel=parallel,
        verify=verify,
        config=config,
        filter_spec=filter_spec,
        host_window_bytes=host_window_bytes,
        rename=rename,
        casting=casting,
        replica_parallel=replica_parallel,
        transform=transform,
    )
