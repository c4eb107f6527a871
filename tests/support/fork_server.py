"""A fork server for the suites' worker processes: one process that has imported JAX, NumPy,
Equinox and eqx_train forks each worker, which then runs its script as `python` would.

Importing those costs a new process about 1.5 CPU-seconds, which the multi-process tests
paid once per worker (about a hundred of them in a run). A forked worker shares nothing with
its siblings but what the server imported; it gets its own argv, environment, working
directory and output, exits with the code `python` would, and is a real process (its pid can
be killed). Two servers, each with its own string hash seed, fork the peers of a job in
turn, so that two peers still disagree on the order of a set as two new processes would.
`spawn` falls back to `subprocess.Popen` for what the server cannot do the same
way: a command that is not `python SCRIPT ...` or `python -c CODE ...`, or an environment
whose JAX variables differ from the server's (JAX reads them as it is imported) or that sets
PYTHONHASHSEED.
`EQX_TRAIN_TESTS_FORK_SERVER=0` turns it off.

Run as a script, this module is the server; it exits when its parent closes its stdin.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
from typing import Any

_SERVER_ENV = {"JAX_PLATFORMS": "cpu"}
"""What the server's environment adds to its parent's: the workers all run on CPU and name
it before importing JAX."""
_PRELOADED = ("jax", "jax.numpy", "numpy", "equinox", "optax", "eqx_train.checkpoints")


def _jax_variables(env: dict[str, str]) -> dict[str, str]:
    """What JAX reads as it is imported; no platform named counts as CPU, which the workers
    name themselves before importing JAX."""
    return {"JAX_PLATFORMS": "cpu"} | {k: v for k, v in env.items() if k.startswith("JAX_")}


# ---------------------------------------------------------------- the server


def _run_as_python(request: dict[str, Any], base_path: list[str]) -> int:
    """In the forked child: becomes `python *request["argv"][1:]` (with `base_path`, the
    server's `sys.path` less its script's folder and PYTHONPATH, after the request's) and
    returns its exit code."""
    import runpy
    import traceback
    import types

    import numpy as np

    np.random.seed()  # its legacy global generator, seeded anew as in a new process
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    args = request["argv"][1:]
    python_path = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    if args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[:] = ["", *python_path, *base_path]
    else:
        sys.argv = list(args)
        sys.path[:] = [os.path.dirname(os.path.abspath(args[0])), *python_path, *base_path]
    try:
        if args[0] == "-c":
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(args[1], "<string>", "exec"), main.__dict__)
        else:
            runpy.run_path(args[0], run_name="__main__")
        code = 0
    except SystemExit as exit:
        if exit.code is None or isinstance(exit.code, int):
            code = exit.code or 0
        else:
            print(exit.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter does at exit
    atexit._run_exitfuncs()
    return code


def _serve(listener: socket.socket) -> None:
    import selectors
    import signal
    import warnings

    for module in _PRELOADED:
        __import__(module)
    python_path = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    base_path = [p for p in sys.path[1:] if p not in python_path]
    # A SIGCHLD writes to this pipe, which wakes the select below to reap the worker.
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    waiting: dict[int, socket.socket] = {}  # worker pid -> its client's connection
    while True:
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj is sys.stdin:  # the parent has gone
                return
            if key.fileobj == wake_read:
                os.read(wake_read, 1 << 12)
                continue
            connection, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 1)
            while not message.endswith(b"\n"):
                message += connection.recv(1 << 20)
            request = json.loads(message)
            sys.stdout.flush()
            sys.stderr.flush()
            with warnings.catch_warnings():  # a BLAS thread: forking with it is safe
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for fd in (wake_read, wake_write):
                        os.close(fd)
                    selector.close()
                    listener.close()
                    for other in waiting.values():
                        other.close()
                    connection.close()
                    null = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(null, 0)
                    os.dup2(fds[0], 1)
                    os.dup2(fds[0], 2)
                    os.close(null)
                    os.close(fds[0])
                    code = _run_as_python(request, base_path)
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            os.close(fds[0])
            connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            waiting[pid] = connection
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            connection = waiting.pop(pid)
            try:
                connection.sendall(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode())
            except OSError:  # the client stopped waiting
                pass
            connection.close()


# ---------------------------------------------------------------- the client


class ForkedProcess:
    """A worker the server forked: the parts of `subprocess.Popen` that the suites use."""

    def __init__(self, connection: socket.socket, pid: int, stdout: Any):
        self._connection = connection
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._reader: threading.Thread | None = None
        self._output = ""

    def poll(self) -> int | None:
        if self.returncode is None:
            self._connection.setblocking(False)
            try:
                self._receive()
            except BlockingIOError:
                pass
            finally:
                self._connection.setblocking(True)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._connection.settimeout(timeout)
            try:
                self._receive()
            except TimeoutError:
                raise subprocess.TimeoutExpired(
                    ["fork server", str(self.pid)], timeout or 0.0
                ) from None
        assert self.returncode is not None
        return self.returncode

    def _receive(self) -> None:
        data = b""
        while chunk := self._connection.recv(1 << 16):
            data += chunk
        if not data:
            raise RuntimeError(f"the fork server closed before worker {self.pid} exited")
        self.returncode = json.loads(data)["code"]
        self._connection.close()

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """All the worker's output (stdout and stderr) once it has exited; after a timeout,
        call it again (as `Popen`'s) to wait on."""
        if self._reader is None:
            self._reader = threading.Thread(target=self._read_all, daemon=True)
            self._reader.start()
        self._reader.join(timeout)
        if self._reader.is_alive():
            raise subprocess.TimeoutExpired(["fork server", str(self.pid)], timeout or 0.0)
        self.wait(timeout)
        self.stdout.close()
        return self._output, None

    def _read_all(self) -> None:
        self._output = self.stdout.read()

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass


class _Server:
    def __init__(self, hash_seed: int) -> None:
        folder = tempfile.mkdtemp(prefix="fork-server-")
        self.address = os.path.join(folder, "socket")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.address)
        listener.listen(64)
        env = {**os.environ, **_SERVER_ENV, "PYTHONHASHSEED": str(hash_seed)}
        self.jax_variables = _jax_variables(env)
        self.process = subprocess.Popen(
            [sys.executable, __file__, str(listener.fileno())],
            stdin=subprocess.PIPE,
            pass_fds=[listener.fileno()],
            env=env,
        )
        listener.close()
        atexit.register(self.stop)

    def stop(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        os.unlink(self.address)
        os.rmdir(os.path.dirname(self.address))


_servers: list[_Server] = []


def spawn(argv: list[str], env: dict[str, str], peer: int = 0) -> Any:
    """`subprocess.Popen(argv, stdout=PIPE, stderr=STDOUT, text=True, env=env)`, forked from
    a server where it can be (see the module's docstring); peers of one job pass their index
    as `peer`."""
    forkable = (
        os.environ.get("EQX_TRAIN_TESTS_FORK_SERVER", "1") != "0"
        and len(argv) >= 2
        and argv[0] == sys.executable
        and (argv[1] == "-c" and len(argv) >= 3 or not argv[1].startswith("-"))
        and "PYTHONHASHSEED" not in env
    )
    if forkable and not _servers:
        first = secrets.randbelow(2**32 - 2) + 1  # PYTHONHASHSEED: 1 to 2**32 - 1
        _servers.extend(_Server(seed) for seed in (first, first + 1))
    server = _servers[peer % len(_servers)] if _servers else None
    if not forkable or server is None or _jax_variables(env) != server.jax_variables:
        return subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
    read, write = os.pipe()
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(server.address)
        request = {"argv": argv, "env": env, "cwd": os.getcwd()}
        socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], [write])
    finally:
        os.close(write)
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = connection.recv(1)
        if not chunk:
            raise RuntimeError("the fork server closed its connection before forking")
        reply += chunk
    return ForkedProcess(connection, json.loads(reply)["pid"], os.fdopen(read, "r"))


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])))
