"""The fork server with real processes: children run their script as `python script` would,
their exits are reported, they die with the server, and an unsafe preload is refused; the
same of a server forked from a zygote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from waiting import until
from zygotes import running_zygote

from deadpool_megatron.agent.forks import ForkServer, ForkServerUnavailable
from deadpool_megatron.agent.forkserver import server_env, worker_defaults

pytestmark = pytest.mark.timeout(120)

REPORT = """
import json, os, random, sys
import numpy
print(json.dumps({
    "argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd(), "path0": sys.path[0],
    "stdin": sys.stdin.read(), "sid": os.getsid(0), "pid": os.getpid(), "name": __name__,
    "random": random.random(), "numpy": float(numpy.random.rand()),
    "comm": open("/proc/self/comm").read().strip(),
}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def _env() -> dict[str, str]:
    # One OpenMP/BLAS thread, as the agent gives it: otherwise numpy's import starts BLAS
    # threads and the server (rightly) refuses to fork.
    return {
        "PATH": os.environ.get("PATH", ""),
        "PYTHONPATH": os.pathsep.join(sys.path),
        "OMP_NUM_THREADS": "1",
    }


@pytest.fixture(scope="module")
def zygote_socket() -> Iterator[str]:
    with running_zygote("json,numpy", _env()) as (_, path):
        yield str(path)


@pytest.fixture(params=["own", "zygote"])
def server(request, tmp_path):
    """A fork server the agent starts, or one a zygote forks ready (zygote.py): the same."""
    zygote = request.getfixturevalue("zygote_socket") if request.param == "zygote" else ""
    lines: list[bytes] = []
    forks = ForkServer(server_env(_env()), preload=("json", "numpy"), output=lines.append,
                       zygote=zygote)  # fmt: skip
    assert forks.zygote == zygote  # the zygote's fork, where one is asked for
    forks.wait_ready(60)
    yield forks
    forks.close()


def _run(server, tmp_path, code: int, **env):
    script = tmp_path / "scripts" / "report.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(REPORT)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    child = server.spawn([str(script), str(code), "--flag"], {"ONLY": "this", **env}, str(work))
    out = child.stdout.read().decode()
    assert child.wait(30) == code
    report, err = out.splitlines()
    return json.loads(report), err, child


def test_a_child_runs_its_script_as_python_would_and_its_exit_is_reported(server, tmp_path):
    report, err, child = _run(server, tmp_path, 3)
    script = str(tmp_path / "scripts" / "report.py")
    assert report["argv"] == [script, "3", "--flag"]
    assert report["env"] == {"ONLY": "this"}  # exactly the environment it was given
    assert report["cwd"] == str(tmp_path / "work")
    assert report["path0"] == str(tmp_path / "scripts")
    assert report["name"] == "__main__"
    assert report["stdin"] == ""  # /dev/null
    assert report["comm"] == "report.py"  # what top shows
    assert report["sid"] == report["pid"] == child.pid  # a session of its own
    assert report["sid"] != os.getsid(0)
    assert err == "to stderr"
    assert child.poll() == 3


ENDING = """
import atexit, os, sys, threading, time

class AbortsAtTeardown:  # what a native library's teardown did to a worker once (SIGABRT)
    def __del__(self):
        os.abort()

kept = AbortsAtTeardown()
out = sys.argv[1]
atexit.register(lambda: open(os.path.join(out, "atexit"), "w").write("ran"))

def late():
    time.sleep(0.3)
    open(os.path.join(out, "thread"), "w").write("joined")

threading.Thread(target=late).start()
print("unflushed", end="")
how = sys.argv[2]
if how == "raise":
    raise RuntimeError("the script failed")
if how == "message":
    sys.exit("a message instead of a status")
if how == "interrupt":
    raise KeyboardInterrupt
sys.exit(None if how == "none" else int(how))
"""


@pytest.mark.parametrize(
    "how, code, err",
    [("none", 0, ""), ("7", 7, ""), ("300", 300 & 0xFF, ""),
     ("raise", 1, "RuntimeError: the script failed"),
     ("message", 1, "a message instead of a status"),
     ("interrupt", -signal.SIGINT, "KeyboardInterrupt")],
)  # fmt: skip
def test_a_child_ends_as_python_would_but_without_the_interpreter_s_teardown(
    server, tmp_path, how, code, err
):
    """Its threads are joined, its atexit handlers run and its output flushed, and it exits
    with the status `python script` would; the teardown after that (which aborts here, as
    torch's once did after a worker's last iteration) is skipped."""
    script = tmp_path / "ending.py"
    script.write_text(ENDING)
    child = server.spawn([str(script), str(tmp_path), how], {}, str(tmp_path))
    out = child.stdout.read().decode()
    assert child.wait(30) == code
    assert out.startswith("unflushed")
    assert err in out
    assert (tmp_path / "thread").read_text() == "joined"
    assert (tmp_path / "atexit").read_text() == "ran"
    # the same script in a fresh interpreter: its teardown aborts it
    if how == "none":
        fresh = subprocess.run([sys.executable, str(script), str(tmp_path), how], timeout=60)
        assert fresh.returncode == -signal.SIGABRT


def test_siblings_draw_different_random_numbers(server, tmp_path):
    first, _, _ = _run(server, tmp_path, 0)
    second, _, _ = _run(server, tmp_path, 0)
    assert first["pid"] != second["pid"]
    assert first["random"] != second["random"]
    assert first["numpy"] != second["numpy"]  # numpy's global generator is reseeded


def test_a_killed_child_reports_the_signal_and_wait_times_out_before(server, tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    child = server.spawn([str(script)], {}, str(tmp_path))
    assert child.stdout.readline() == b"up\n"
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    assert child.poll() is None
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait(10) == -signal.SIGKILL


def test_children_die_with_the_server(server, tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    child = server.spawn([str(script)], {}, str(tmp_path))
    assert child.stdout.readline() == b"up\n"
    os.kill(server.pid, signal.SIGKILL)
    assert child.wait(10) == -signal.SIGKILL
    assert until(lambda: not os.path.exists(f"/proc/{child.pid}"), timeout_s=10)
    with pytest.raises(ForkServerUnavailable):
        server.spawn([str(script)], {}, str(tmp_path))


def test_a_preload_that_starts_a_thread_makes_the_server_refuse_to_fork(tmp_path):
    (tmp_path / "threaded.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    )
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    forks = ForkServer(env, preload=("threaded",), output=lambda line: None)
    try:
        with pytest.raises(ForkServerUnavailable, match="started threads"):
            forks.wait_ready(60)
        with pytest.raises(ForkServerUnavailable, match="started threads"):
            forks.spawn([str(tmp_path / "threaded.py")], {}, str(tmp_path))
    finally:
        forks.close()


def test_a_missing_preload_is_skipped_and_reported(tmp_path):
    lines: list[bytes] = []
    forks = ForkServer(_env(), preload=("json", "no_such_module_here"), output=lines.append)
    try:
        forks.wait_ready(60)
        script = tmp_path / "ok.py"
        script.write_text("print('ok')\n")
        child = forks.spawn([str(script)], {}, str(tmp_path))
        assert child.stdout.read() == b"ok\n"
        assert child.wait(30) == 0
    finally:
        forks.close()
    assert any(b"not preloading no_such_module_here" in line for line in lines), lines


def test_a_script_whose_folder_shadows_a_preload_runs_in_an_interpreter_of_its_own(
    server, tmp_path
):
    # As a Megatron-LM checkout's megatron/ beside its pretrain_gpt.py: python would import
    # the folder's copy, which the preloaded one must not stand in for.
    folder = tmp_path / "checkout"
    (folder / "json").mkdir(parents=True)
    (folder / "json" / "__init__.py").write_text("WHO = 'the checkout'\n")
    script = folder / "train.py"
    script.write_text(
        "import json, os, sys\n"
        "print(json.WHO, 'numpy' in sys.modules, os.getpid(), flush=True)\n"
        "sys.exit(7)\n"
    )
    child = server.spawn([str(script)], {"PATH": os.environ.get("PATH", "")}, str(tmp_path))
    lines = child.stdout.read().decode().splitlines()
    assert child.wait(60) == 7
    assert "imports json from its own folder" in lines[0], lines
    who, numpy_loaded, pid = lines[-1].rsplit(" ", 2)
    assert who == "the checkout"
    assert numpy_loaded == "False"  # a fresh interpreter, not the preloaded state
    assert int(pid) == child.pid  # the same process, exec'd: the agent's handle still holds


def test_a_script_beside_the_same_copy_of_a_preload_is_forked(tmp_path):
    import json as preloaded_json

    from deadpool_megatron.agent.forkserver import shadowed_preloads

    stdlib = os.path.dirname(os.path.dirname(preloaded_json.__file__))
    assert shadowed_preloads(stdlib, ["json"]) == []  # the very folder it came from
    assert shadowed_preloads(str(tmp_path), ["json"]) == []  # no json here
    (tmp_path / "json.py").write_text("")
    assert shadowed_preloads(str(tmp_path), ["json.decoder"]) == ["json"]


def test_the_script_folder_comes_first_when_preloading_so_its_copy_is_forked(tmp_path):
    folder = tmp_path / "checkout"
    (folder / "probe_pkg").mkdir(parents=True)
    (folder / "probe_pkg" / "__init__.py").write_text("WHO = 'the checkout'\n")
    script = folder / "train.py"
    script.write_text("import probe_pkg, sys\nprint(probe_pkg.WHO, 'numpy' in sys.modules)\n")
    lines: list[bytes] = []
    forks = ForkServer(_env(), preload=("probe_pkg", "numpy"), output=lines.append,
                       script_folder=str(folder))  # fmt: skip
    try:
        child = forks.spawn([str(script)], {}, str(tmp_path))
        assert child.stdout.read().decode().splitlines() == ["the checkout True"]  # forked
        assert child.wait(30) == 0
    finally:
        forks.close()
    assert not [line for line in lines if b"not preloading" in line], lines


def test_children_fall_back_to_interpreters_when_the_fork_server_refuses(
    tmp_path, monkeypatch, capfd, caplog
):
    from deadpool_megatron.agent.children import Children, Launch

    (tmp_path / "threaded.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    )
    script = tmp_path / "hello.py"
    script.write_text("import sys\nprint('hello from', sys.argv[1:], flush=True)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    children = Children(
        Launch(str(script), ("--x",), "127.0.0.1", 1, 1, fork_preload=("threaded",))
    )
    try:
        child = children.spawn("worker", 0, 0, {})
        assert isinstance(child.proc, subprocess.Popen)  # its own interpreter
        assert child.proc.wait(60) == 0
        child.pump.join(10)
    finally:
        children.close()
    assert "[worker 0] hello from ['--x']" in capfd.readouterr().out
    assert "fork server unusable (the preloaded modules started threads" in caplog.text


def test_workers_default_to_one_thread_huge_pages_and_nccl_errors_raised_unless_told_otherwise():
    # NCCL's watchdog aborts a failed communicator and the error reaches the training thread
    # (2), rather than ending a survivor whose peer died (torch's default, 3).
    assert worker_defaults({}) == {"OMP_NUM_THREADS": "1", "THP_MEM_ALLOC_ENABLE": "1",
                                   "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}  # fmt: skip
    mine = {"OMP_NUM_THREADS": "4", "THP_MEM_ALLOC_ENABLE": "0",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}  # fmt: skip
    assert worker_defaults(dict(mine)) == mine
    assert server_env({})["THP_MEM_ALLOC_ENABLE"] == "1"


def test_torch_puts_a_worker_s_large_tensors_on_huge_pages():
    """What the default buys: torch in a worker's environment madvises its large CPU
    allocations, and the kernel backs them with huge pages (where THP is not off)."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    if "[never]" in mode:
        pytest.skip(f"transparent huge pages are off here ({mode.strip()})")
    probe = (
        "import torch\n"
        "t = torch.empty(64 << 20, dtype=torch.uint8)\n"
        "t.fill_(1)\n"
        "print(next(int(line.split()[1]) for line in open('/proc/self/smaps_rollup')"
        " if line.startswith('AnonHugePages')))\n"
    )
    sizes = {}
    for value in ("0", "1"):
        env = worker_defaults(dict(os.environ, THP_MEM_ALLOC_ENABLE=value))
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        sizes[value] = int(done.stdout.split()[-1])
    assert sizes["1"] >= 32 << 10, sizes  # kB: at least half the 64 MiB
    if "[madvise]" in mode:  # only what is advised ("always": everything)
        assert sizes["0"] < 32 << 10, sizes
