"""tests/support/fork_server.py: a worker forked from the server behaves as `python` started
with the same command, environment and working directory would."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.fork_server import ForkedProcess, spawn
from tests.support.helpers import run_processes, worker_env


def _run(code, *args, env=None, timeout=60):
    [(returncode, out)] = run_processes(
        [([sys.executable, "-c", code, *args], env or worker_env())], timeout
    )
    return returncode, out


def test_a_worker_is_forked_with_its_argv_environment_directory_and_path(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        "import os, sys\n"
        "print(sys.argv, os.environ['MARK'], os.getcwd(), sys.path[0], __name__)\n"
        "import tests.support.helpers\n"  # from the worker's PYTHONPATH
    )
    process = spawn([sys.executable, str(script), "a", "b"], worker_env(MARK="m1"))
    out, _ = process.communicate(timeout=60)
    assert isinstance(process, ForkedProcess)
    assert process.returncode == 0, out
    assert out.split() == [f"['{script}',", "'a',", "'b']", "m1", os.getcwd(), str(tmp_path)] + [
        "__main__"
    ]


def test_dash_c_code_sees_its_arguments_and_an_empty_first_path_entry():
    code = "import sys; print(sys.argv, repr(sys.path[0]))"
    returncode, out = _run(code, "x")
    assert (returncode, out.strip()) == (0, "['-c', 'x'] ''")


@pytest.mark.parametrize(
    "code, expected",
    [
        ("pass", 0),
        ("import sys; sys.exit(3)", 3),
        ("import sys; sys.exit('bad')", 1),
        ("raise ValueError('boom')", 1),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL),
    ],
)
def test_exit_codes_are_pythons(code, expected):
    returncode, out = _run(code)
    assert returncode == expected, out
    if "boom" in code:
        assert "Traceback" in out and "ValueError: boom" in out
    if "bad" in code:
        assert out.strip() == "bad"


def test_atexit_handlers_run_after_other_threads_have_finished():
    code = (
        "import atexit, threading, time\n"
        "atexit.register(lambda: print('atexit', flush=True))\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread', flush=True))).start()\n"
    )
    returncode, out = _run(code)
    assert (returncode, out.split()) == (0, ["thread", "atexit"])


def test_a_worker_can_be_killed_by_its_pid_while_it_runs():
    process = spawn([sys.executable, "-c", "import time; time.sleep(60)"], worker_env())
    assert isinstance(process, ForkedProcess)
    time.sleep(0.2)
    assert process.poll() is None
    os.kill(process.pid, signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    process.stdout.close()


def test_a_worker_that_runs_too_long_times_out_and_is_killed():
    process = spawn([sys.executable, "-c", "import time; time.sleep(60)"], worker_env())
    with pytest.raises(subprocess.TimeoutExpired):
        process.communicate(timeout=0.5)
    process.kill()
    assert process.communicate(timeout=30) == ("", None)
    assert process.returncode == -signal.SIGKILL


@pytest.mark.parametrize(
    "argv_tail, env_extra",
    [
        (["-m", "json.tool", "--help"], {}),  # not a script or -c: Popen
        (["-c", "print('x')"], {"JAX_ENABLE_X64": "1"}),  # JAX reads it on import: Popen
        (["-c", "print('x')"], {"JAX_PLATFORMS": "cuda"}),  # the server's JAX is on CPU
        (["-c", "print('x')"], {"PYTHONHASHSEED": "7"}),  # the servers have their own
    ],
)
def test_what_the_server_cannot_do_alike_runs_as_a_new_process(argv_tail, env_extra):
    process = spawn([sys.executable, *argv_tail], worker_env(**env_extra))
    assert isinstance(process, subprocess.Popen)
    process.communicate(timeout=60)
    assert process.returncode == 0


def test_peers_of_a_job_disagree_on_string_hashes_as_new_processes_do():
    code = "print(hash('eqx_train'))"
    results = run_processes([([sys.executable, "-c", code], worker_env())] * 2, 60)
    assert all(returncode == 0 for returncode, _ in results), results
    assert results[0][1] != results[1][1]


def test_the_servers_exit_when_the_process_that_started_them_is_killed():
    code = (
        "import sys, time\n"
        "from tests.support import fork_server\n"
        "from tests.support.helpers import worker_env\n"
        "fork_server.spawn([sys.executable, '-c', 'pass'], worker_env()).communicate(60)\n"
        "print(*[s.process.pid for s in fork_server._servers], flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=worker_env()
    )
    try:
        assert parent.stdout is not None
        servers = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(servers) == 2 and all(os.path.exists(f"/proc/{pid}") for pid in servers)
        parent.kill()  # no atexit: only the servers' closed stdin tells them
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in servers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in servers)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()


def _alive(pid):
    """Running, as opposed to gone or a zombie waiting for its reaper (here, init)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
