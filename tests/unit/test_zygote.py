"""The zygote (agent/zygote.py) with real processes: it forks a ready fork server only where
that server is what the agent would have started, the agent starts its own otherwise, and a
forked server outlives the zygote and ends with its agent's end of the link."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys

import psutil
import pytest
from waiting import until
from zygotes import running_zygote

from deadpool_megatron.agent.forks import ForkServer
from deadpool_megatron.agent.forkserver import server_env
from deadpool_megatron.agent.zygote import ServerRequest, bind, refusal

pytestmark = pytest.mark.timeout(120)

ENV = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.pathsep.join(sys.path),
       "OMP_NUM_THREADS": "1"}  # fmt: skip


def _request(**change) -> ServerRequest:
    fields = {"preload": ("json",), "script_folder": "/nowhere", "executable": sys.executable,
              "env": {"OMP_NUM_THREADS": "1", "HOME": "/root"}}  # fmt: skip
    return ServerRequest(**{**fields, **change})


@pytest.mark.parametrize(
    "change, why",
    [
        ({}, None),
        ({"env": {"OMP_NUM_THREADS": "1", "HOME": "/elsewhere"}}, None),  # not read at import
        ({"executable": "/usr/bin/python3.9"}, "the agent /usr/bin/python3.9"),
        ({"preload": ("json", "numpy")}, "it preloaded json, the agent asks for json,numpy"),
        ({"env": {"OMP_NUM_THREADS": "4"}}, "the environment differs in OMP_NUM_THREADS"),
        ({"env": {"OMP_NUM_THREADS": "1", "LD_PRELOAD": "x.so"}}, "differs in LD_PRELOAD"),
        ({"env": {"OMP_NUM_THREADS": "1", "PYTHONPATH": "/x"}}, "differs in PYTHONPATH"),
        ({"env": {"OMP_NUM_THREADS": "1", "PYTHON": "/x/python"}}, None),  # the scripts' own
    ],
)
def test_a_fork_is_refused_where_it_would_differ_from_the_agents_own_server(change, why):
    import json  # noqa: F401  (preloaded, as in the zygote)

    got = refusal(_request(**change), ("json",), ["json"], {"OMP_NUM_THREADS": "1"})
    assert got == why if why is None else why in got


def test_a_script_folder_with_its_own_copy_of_a_preload_is_refused(tmp_path):
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "__init__.py").write_text("")
    got = refusal(_request(script_folder=str(tmp_path)), ("json",), ["json"],
                  {"OMP_NUM_THREADS": "1"})  # fmt: skip
    assert got == f"{tmp_path} holds its own copy of json"


def _hello(tmp_path, forks: ForkServer) -> str:
    script = tmp_path / "hello.py"
    script.write_text("import sys\nprint('hello', 'json' in sys.modules, flush=True)\n")
    child = forks.spawn([str(script)], {}, str(tmp_path))
    out = child.stdout.read().decode()
    assert child.wait(30) == 0
    return out


def test_a_refusing_or_unreachable_zygote_leaves_the_agent_its_own_server(tmp_path, caplog):
    caplog.set_level(logging.INFO, "deadpool.launch")
    with running_zygote("json", ENV) as (_, path):
        forks = ForkServer(server_env(ENV), preload=("json", "numpy"), output=lambda _: None,
                           zygote=str(path))  # fmt: skip
        try:
            assert forks.zygote == ""  # started by this process
            assert psutil.Process(forks.pid).ppid() == os.getpid()
            assert _hello(tmp_path, forks) == "hello True\n"
        finally:
            forks.close()
    assert "refused a fork server (it preloaded json, the agent asks for json,numpy)" in (
        caplog.text
    )
    gone = str(tmp_path / "no-zygote.sock")
    forks = ForkServer(server_env(ENV), preload=("json",), output=lambda _: None, zygote=gone)
    try:
        assert forks.zygote == ""
        assert _hello(tmp_path, forks) == "hello True\n"
    finally:
        forks.close()
    assert f"no fork server from the zygote at {gone}" in caplog.text


def test_a_forked_server_outlives_the_zygote_and_ends_with_its_agents_link(tmp_path):
    with running_zygote("json", ENV) as (zygote, path):
        forks = ForkServer(server_env(ENV), preload=("json",), output=lambda _: None,
                           zygote=str(path))  # fmt: skip
        try:
            assert forks.zygote == str(path)
            assert psutil.Process(forks.pid).ppid() == zygote.pid  # not this process's child
            script = tmp_path / "sleep.py"
            script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
            sleeper = forks.spawn([str(script)], {}, str(tmp_path))
            assert sleeper.stdout.readline() == b"up\n"
            zygote.kill()  # the zygote's end changes nothing for a server it forked
            zygote.wait()
            assert path.exists()  # a SIGKILLed zygote leaves its socket file behind
            assert _hello(tmp_path, forks) == "hello True\n"
            assert sleeper.poll() is None
        finally:
            forks.close()  # the agent's end of the link: the server ends, its children too
        assert not psutil.pid_exists(forks.pid) or psutil.Process(forks.pid).status() == "zombie"
        assert until(lambda: not os.path.exists(f"/proc/{sleeper.pid}"), timeout_s=10)


def test_a_socket_file_left_behind_is_taken_over_and_a_live_zygote_is_not(tmp_path):
    path = str(tmp_path / "z.sock")
    left = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    left.bind(path)  # a zygote that was SIGKILLed: the file stays, nobody listens
    left.close()
    listener = bind(path)
    try:
        with pytest.raises(SystemExit, match=f"a zygote already listens at {path}"):
            bind(path)
    finally:
        listener.close()


def test_a_terminated_zygote_removes_its_socket_file():
    with running_zygote("json", ENV) as (zygote, path):
        zygote.send_signal(signal.SIGTERM)
        assert zygote.wait(10) == 0
        assert not path.exists()
