"""`restore_checkpoint`, flax's restore: its keyword arguments checked once into a
`RestoreOptions`, then the pipeline's restore stages (`pipeline._restore`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, TypeVar, overload

from .._calls import calling
from .._progress import Progress
from .format import _names
from .pipeline import _matching, _restore, _selection, _transform
from .pipeline._options import RestoreOptions
from .pipeline._window import DEFAULT_HOST_WINDOW_BYTES
from .storage import _locations

T = TypeVar("T")


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
    threaded_reads: bool | None = None,
    progress: Progress = None,
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
    threaded_reads: bool | None = None,
    progress: Progress = None,
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
    threaded_reads: bool | None = None,
    progress: Progress = None,
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
    - `parallel`: flax's name for `threaded_reads`, kept so that a flax call runs
      unchanged (`threaded_reads`, when given, wins).
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
    - `threaded_reads`: read the whole tensors a target needs from a local file (a
      `.safetensors` file, Hugging Face shards) with up to 8 threads when they add up to
      16 MiB or more (default: `parallel`'s value, True). It does not apply to a `.shards`
      checkpoint (read piece by piece) nor to an object store (whose byte ranges are
      always fetched in parallel requests), and has nothing to do with
      `replica_parallel`, which splits reading between processes.
    - `progress`: show the read's progress: `True` draws a tqdm bar on stderr (bytes, rate,
      ETA; only once the restore has taken about a second; needs `tqdm`), or pass a
      function, called as `fn(done_bytes, total_bytes)` as the tensor bytes this process
      reads are read and placed. `total_bytes` may grow as the reads begin. Default: no
      report, at no cost.

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
    with calling("restore_checkpoint"):
        options = RestoreOptions(
            strict=strict,
            rename=rename,
            casting=casting,
            filter_spec=filter_spec,
            transform=transform,
            config=config,
            verify=verify,
            threaded_reads=parallel if threaded_reads is None else threaded_reads,
            host_window_bytes=host_window_bytes,
            replica_parallel=replica_parallel,
            progress=progress,
        ).check(target)
        store, where = _locations.resolve(ckpt_dir, storage_options)
        return _restore.restore(store, where, target, step, prefix, options)
