"""Multi-process coordination on the key-value store of the coordination service that
`jax.distributed.initialize` starts (it runs inside process 0). The only module that touches
JAX's internals: `jax._src.distributed.global_state.client`, whose methods `key_value_set`,
`key_value_dir_get`, `blocking_key_value_get` and `key_value_delete` have the same signatures
in jax 0.10 and 0.12.

## The protocol of one operation

Every collective (`broadcast`, `gather`, `barrier`, `decide`) is one *operation* with a key
prefix `op` from `next_id` (the n-th call of a kind) or `op_id` (a key every process agrees
on, such as a save's number and step). Process `i` writes `{op}/arrived/{i}` (its value), then lists
`{op}/arrived/`; whoever sees every process there writes `{op}/outcome = ok`. Everyone waits
for `{op}/outcome` with a deadline; a process whose deadline passes first writes
`{op}/outcome = failed: ...`, naming the processes whose arrival keys are missing. The outcome
is written without overwrite, so exactly one of "ok" and "failed" wins and every process
follows it: an operation succeeds everywhere or fails everywhere, and a process that arrives
after a peer gave up raises at once instead of succeeding alone.

## Key hygiene

An operation's keys are deleted by process 0 once every process is done with them: when a
later operation of the same kind succeeds, every process has arrived there, so every process
has returned from (or raised in) all earlier operations of that kind. The store thus holds the
last successful operation of each kind plus the failed ones since. A failed operation keeps its
keys (its "failed" outcome) until then, so a late arrival always finds the failure; its keys
can never satisfy a later operation, whose prefix differs.

## What the caller must ensure

Every process makes the same sequence of calls per kind (a process whose own work failed
still makes the call, with a value that says so, instead of skipping it), and calls of one
kind are sequential (one thread per kind); different kinds may run in different threads.
A multi-process save numbers itself with `next_number("save")` as its very first step and
keys all its exchanges by that number (`op_id`), so one save's failure on some processes
cannot shift the pairing of later saves.

## When a peer dies (measured with jax 0.10.2 and 0.12.0.1, the same in both)

- A peer other than process 0 dies: the survivors' waits end at `timeout_s` with
  `BarrierTimeoutError` naming it. Then, `heartbeat_timeout_seconds` (an argument of
  `jax.distributed.initialize`, default 100) after the death, the coordination service
  declares the peer dead and JAX terminates every survivor (LOG(FATAL), exit code 134, no
  Python exception) unless `jax.config.update("jax_enable_recoverability", True)` was set
  before `jax.distributed.initialize`. So the error is seen only when `timeout_s` is shorter
  than `heartbeat_timeout_seconds`; with a longer `timeout_s`, JAX's termination comes first.
- Process 0 dies: the service dies with it and JAX terminates every other process at once
  (an UNAVAILABLE error may reach a waiting call just before), in both versions and with
  recoverability on or off. Nothing is committed either way.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._errors import BarrierTimeoutError as BarrierTimeoutError

if TYPE_CHECKING:
    import jax
else:  # imported on first use: the command line reads headers without JAX
    from ..._lazy import LazyModule

    jax = LazyModule("jax")

from ..._calls import call

_LOCK = threading.Lock()
_COUNTERS: dict[str, int] = {}
# Process 0 only: per kind, the operations whose keys are still in the store.
_UNDELETED: dict[str, list[str]] = {}
_OK = "ok"
_FAILED = "failed: "


def next_id(kind: str) -> str:
    """A key prefix unique to this collective call: every process calls collectives in the
    same order, so the n-th call of `kind` gets the same id everywhere.

    **Arguments:**

    - `kind`: what the operation is for (`"save"`, `"should_save"`): a non-empty name
      without `/`, so that no id is a key directory of another.

    **Returns:**

    `"eqx_train/{kind}/{n}"`, where `n` counts the earlier calls with this `kind`.
    """
    return op_id(kind, str(next_number(kind)))


def next_number(kind: str) -> int:
    """How many times this process asked for a number of `kind` before (0, 1, 2, ...).

    A multi-process save takes its number as its very first step, before anything that can
    fail: every process calls the save the same number of times, so the n-th save has
    number n on every process, whatever failed in earlier saves on some of them.
    """
    _check_name("kind", kind)
    with _LOCK:
        count = _COUNTERS.get(kind, 0)
        _COUNTERS[kind] = count + 1
    return count


def op_id(kind: str, key: str) -> str:
    """The id of the operation `key` of `kind`: `"eqx_train/{kind}/{key}"`. `key` must be
    something every process agrees on (a save's number and step), and unique per `kind`.

    Ids of one `kind` form one group for key hygiene (see the module docstring)."""
    _check_name("kind", kind)
    _check_name("key", key)
    return f"eqx_train/{kind}/{key}"


def _check_name(what: str, name: str) -> None:
    if not name or "/" in name:
        raise ValueError(f"next_id: {what} must be a non-empty name without '/', got {name!r}.")


def broadcast(op: str, value: str | None, *, timeout_s: int | float) -> str:
    """Process 0's `value`, returned on every process.

    **Arguments:**

    - `op`: this call's id from `next_id`, the same on every process.
    - `value`: the value to share; only process 0's is used (it must be a string there).
    - `timeout_s`: how long to wait for the other processes.

    **Returns:**

    Process 0's `value`.

    **Raises:**

    `BarrierTimeoutError` naming the processes that did not arrive within `timeout_s`.
    """
    return _broadcast(op, value, timeout_s=timeout_s)


def _broadcast(op: str, value: str | None, *, timeout_s: int | float) -> str:
    me, count = _topology()
    if me == 0 and value is None:
        raise ValueError(f"{call()}: process 0 must give the value to broadcast, got None.")
    if count == 1:
        assert value is not None
        return value
    mine = value if me == 0 and value is not None else ""
    return _exchange(op, mine, timeout_s=timeout_s, what="broadcast")[0]


def gather(op: str, value: str, *, timeout_s: int | float) -> list[str]:
    """Every process's `value`, in process order, returned on every process.

    **Arguments:**

    - `op`: this call's id from `next_id`, the same on every process.
    - `value`: this process's contribution.
    - `timeout_s`: how long to wait for the other processes.

    **Returns:**

    A list whose `i`-th element is process `i`'s `value`.

    **Raises:**

    `BarrierTimeoutError` naming the processes that did not arrive within `timeout_s`.
    """
    if _topology()[1] == 1:
        return [value]
    return _exchange(op, value, timeout_s=timeout_s, what="gather")


def barrier(op: str, *, timeout_s: int | float) -> None:
    """Returns once every process has called `barrier` with the same `op`.

    **Arguments:**

    - `op`: this call's id from `next_id`, the same on every process.
    - `timeout_s`: how long to wait for the other processes.

    **Raises:**

    `BarrierTimeoutError` naming the processes that did not arrive within `timeout_s`.
    """
    if _topology()[1] == 1:
        return
    _exchange(op, "", timeout_s=timeout_s, what="barrier")


def decide(
    op: str,
    make_decision: Callable[[], bool | str],
    *,
    timeout_s: int | float,
) -> bool | str:
    """One decision for all processes: process 0 calls `make_decision` (the others do not)
    and every process returns its result, so processes whose clocks or state differ never
    disagree.

    **Arguments:**

    - `op`: this call's id from `next_id`, the same on every process.
    - `make_decision`: called on process 0 only; returns a `bool` or a `str`.
    - `timeout_s`: how long to wait for the other processes.

    **Returns:**

    Process 0's decision, of the type `make_decision` returned.

    **Raises:**

    On process 0, whatever `make_decision` raised; on the others, a `RuntimeError` quoting
    it (they do not wait out the timeout). `BarrierTimeoutError` as `broadcast`.
    """
    return _decide(op, make_decision, timeout_s=timeout_s)


def _decide(
    op: str, make_decision: Callable[[], bool | str], *, timeout_s: int | float
) -> bool | str:
    encoded: str | None = None
    error: BaseException | None = None
    if _topology()[0] == 0:
        try:
            decision = make_decision()
            if not isinstance(decision, bool | str):
                raise TypeError(
                    f"{call()}: the decision must be a bool or a str, got "
                    f"{type(decision).__name__} {decision!r}."
                )
            encoded = json.dumps({"decision": decision})
        except Exception as e:
            # Shared before re-raising, so that the peers fail now instead of at the timeout.
            error = e
            encoded = json.dumps({"error": f"{type(e).__name__}: {e}"})
    shared = json.loads(_broadcast(op, encoded, timeout_s=timeout_s))
    if error is not None:
        raise error
    if "error" in shared:
        raise RuntimeError(f"{call()}: process 0 failed to decide: {shared['error']}")
    return shared["decision"]


def reached_preemption(step: int) -> bool:
    """Whether every process has reached the step at which to save because one of them was
    told it will be preempted: JAX's
    `jax.experimental.multihost_utils.reached_preemption_sync_point`.

    Call it on every process at every step, with the same `step`. When any process gets
    SIGTERM, the processes agree on a step (one past the largest step any of them reported)
    and this returns True at that step on all of them.

    It needs the preemption service of `jax.distributed` (on by default in jax 0.10 and 0.12:
    the config option `jax_enable_preemption_service`), which catches SIGTERM in C++; a Python
    SIGTERM handler installed after `jax.distributed.initialize` replaces JAX's, and the sync
    point is then never reached.

    **Arguments:**

    - `step`: the current training step.

    **Returns:**

    True at the agreed step after a preemption notice; False otherwise, and always False
    without `jax.distributed` or with the preemption service turned off.
    """
    distributed = _distributed_state()
    if distributed is None or distributed.client is None:
        return False
    if distributed.preemption_sync_manager is None:
        return False  # jax_enable_preemption_service was off at initialize
    from jax.experimental import multihost_utils

    return bool(multihost_utils.reached_preemption_sync_point(step))


# ------------------------------------------------------------------------ the implementation


def _distributed_state() -> Any:
    try:
        from jax._src.distributed import global_state
    except ImportError:  # pragma: no cover - a JAX that moved its internals
        return None
    return global_state


def _topology() -> tuple[int, int]:
    """This process's index and the process count. From the coordination client when there
    is one: `jax.process_index()` would first initialise the backend, which waits (up to 2
    minutes, outside any timeout of ours) for every process to publish its devices."""
    state = _distributed_state()
    if state is not None and state.client is not None:
        return state.process_id, state.num_processes
    return jax.process_index(), jax.process_count()


def _client() -> Any:
    state = _distributed_state()
    client = getattr(state, "client", None)
    if client is None:
        raise RuntimeError(
            f"{call()}: jax.process_count() is {_topology()[1]} but the client of "
            "JAX's coordination service is missing (jax.distributed.initialize was not "
            "called, was shut down, or this JAX "
            f"{jax.__version__} keeps it elsewhere than jax._src.distributed.global_state)."
        )
    return client


def _status(error: Exception) -> str:
    """The gRPC status code that starts a coordination-service error's message."""
    return str(error).split(":", 1)[0].strip()


def _exchange(op: str, value: str, *, timeout_s: int | float, what: str) -> list[str]:
    """The protocol of the module docstring: every process's value, in process order."""
    if not (isinstance(timeout_s, int | float) and timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"{call()}: timeout_s must be a positive number, got {timeout_s!r}.")
    client = _client()
    me, count = _topology()
    deadline = time.monotonic() + timeout_s
    arrived_dir, outcome_key = f"{op}/arrived/", f"{op}/outcome"
    try:
        client.key_value_set(f"{arrived_dir}{me}", value)
    except Exception as error:
        if _status(error) != "ALREADY_EXISTS":
            raise
        raise RuntimeError(
            f"{call()}: the {what} {op!r} was already called on process {me}; every "
            "operation needs its own id from next_id."
        ) from None
    arrivals = _arrivals(client, arrived_dir)
    if len(arrivals) == count:
        _settle(client, outcome_key, _OK)
    while True:
        wait_ms = max(1, math.ceil((deadline - time.monotonic()) * 1000))
        try:
            outcome = client.blocking_key_value_get(outcome_key, wait_ms)
            break
        except Exception as error:
            if _status(error) != "DEADLINE_EXCEEDED":
                if _status(error) == "UNAVAILABLE":
                    raise BarrierTimeoutError(
                        f"{call()}: the {what} {op!r} lost the coordination service, which "
                        f"runs in process 0, while process {me} waited: process 0 probably "
                        f"died ({_status(error)})."
                    ) from error
                raise
            if time.monotonic() < deadline:
                continue  # the service's clock ran ahead of ours: wait out the rest
            missing = [i for i in range(count) if i not in _arrivals(client, arrived_dir)]
            failure = {"by": me, "timeout_s": timeout_s, "missing": missing}
            outcome = _settle(client, outcome_key, _FAILED + json.dumps(failure))
            break
    if outcome != _OK:
        _remember(op, me)
        failure = json.loads(outcome.removeprefix(_FAILED))
        missing = failure["missing"]
        late = f" Process {me} itself arrived after that." if me in missing else ""
        timed_out = BarrierTimeoutError(
            f"{call()}: the {what} {op!r} timed out: process {failure['by']} waited "
            f"{failure['timeout_s']}s and processes {missing} did not arrive.{late} A peer "
            "probably died, hung, or did not make the same call."
        )
        timed_out.late = me in missing
        raise timed_out
    if len(arrivals) < count:
        arrivals = _arrivals(client, arrived_dir)
    _forget_earlier(client, op, me)
    return [arrivals[i] for i in range(count)]


def _arrivals(client: Any, arrived_dir: str) -> dict[int, str]:
    found: dict[int, str] = {}
    for key, value in client.key_value_dir_get(arrived_dir):
        index = key.rpartition("/")[2]
        if index.isascii() and index.isdigit():
            found[int(index)] = value
    return found


def _settle(client: Any, outcome_key: str, outcome: str) -> str:
    """Writes `outcome` unless another process settled the operation first; returns the
    outcome that stands."""
    try:
        client.key_value_set(outcome_key, outcome)
        return outcome
    except Exception as error:
        if _status(error) != "ALREADY_EXISTS":
            raise
    return client.key_value_try_get(outcome_key)


def _remember(op: str, me: int) -> None:
    if me == 0:
        with _LOCK:
            _UNDELETED.setdefault(op.rpartition("/")[0], []).append(op)


def _forget_earlier(client: Any, op: str, me: int) -> None:
    """On process 0, after `op` succeeded: deletes the keys of the earlier operations of its
    kind, which every process is done with."""
    if me != 0:
        return
    with _LOCK:
        kept = _UNDELETED.setdefault(op.rpartition("/")[0], [])
        earlier, kept[:] = list(kept), [op]
    for old in earlier:
        client.key_value_delete(f"{old}/")
