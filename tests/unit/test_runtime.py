"""What a training process reads of its environment: deadpool-launch's contract, and torchrun's
(the restart baseline), whose store outlives a restart."""

from __future__ import annotations

import subprocess
import sys

from deadpool_megatron.runtime import ENV_JOB_ID, ENV_ROLE, ProcessEnv

TORCHRUN = {
    "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
}  # fmt: skip


def test_each_torchrun_attempt_meets_under_a_job_id_of_its_own():
    first = ProcessEnv.from_environ(TORCHRUN)
    again = ProcessEnv.from_environ({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert (first.restart_count, again.restart_count) == (0, 1)
    assert first.job_id != again.job_id and "none" in first.job_id
    assert not first.under_launcher and first.master_port == 29500


def test_rank_0_hosts_the_store_only_when_torchrun_does_not_share_its_own():
    assert not ProcessEnv.from_environ({**TORCHRUN, "RANK": "0"}).hosts_store
    unshared = {**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "False"}
    assert ProcessEnv.from_environ({**unshared, "RANK": "0"}).hosts_store
    assert not ProcessEnv.from_environ(unshared).hosts_store  # rank 3 connects


def test_deadpool_launch_names_the_job_and_hosts_the_store():
    env = ProcessEnv.from_environ({**TORCHRUN, ENV_JOB_ID: "abc", ENV_ROLE: "worker"})
    assert env.job_id == "abc" and env.under_launcher and not env.hosts_store
    plain = ProcessEnv.from_environ({})
    assert (plain.job_id, plain.rank, plain.world_size, plain.restart_count) == ("local", 0, 1, 0)


FORKED_GARBAGE = """
import gc, os
from deadpool_megatron.runtime import freeze_imports
gc.disable()  # the garbage below waits for an explicit collection
freeze_imports()

class Left:  # as a previous generation's data iterator: a cycle with a finalizer
    def __del__(self):
        os.write(1, b"finalized in the %s\\n" % (b"parent" if os.getpid() == PARENT else b"child"))

PARENT = os.getpid()
left = Left()
left.me = left
del left
pid = os.fork()
if pid == 0:
    gc.collect()
    os._exit(0)
os.waitpid(pid, 0)
gc.collect()
"""


def test_a_forked_child_never_collects_what_it_inherited():
    # In a separate interpreter: the at-fork hook stays registered for the process's life.
    done = subprocess.run([sys.executable, "-c", FORKED_GARBAGE], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["finalized in the parent"]


SURVIVORS = """
import gc, weakref
from deadpool_megatron.runtime import freeze_survivors
gc.disable()

class Node:
    pass

garbage = Node()
garbage.me = garbage  # a cycle nothing holds: collected, not frozen
dead = weakref.ref(garbage)
del garbage
cache = Node()  # alive, as torch.compile's tables after the JIT warm-up
cache.me = cache
freeze_survivors()
print(dead() is None, any(o is cache for o in gc.get_objects()))
"""


def test_freeze_survivors_collects_garbage_first_and_leaves_the_living_out():
    done = subprocess.run([sys.executable, "-c", SURVIVORS], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"]


def test_a_process_ends_with_its_status_written_where_the_launcher_asked(tmp_path):
    """end_process: logs flushed, the status in ENV_EXIT_STATUS_FILE (a child spawned by MPI,
    whose parent is Open MPI's daemon), then the exit itself; nothing written without it."""
    from deadpool_megatron.runtime import ENV_EXIT_STATUS_FILE

    status = tmp_path / "status"
    code = ("import logging; from deadpool_megatron.runtime import end_process; "
            "logging.basicConfig(); logging.getLogger('x').warning('last words'); end_process(7)")  # fmt: skip
    env = {"PATH": "", "PYTHONPATH": ":".join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**env, ENV_EXIT_STATUS_FILE: str(status)})  # fmt: skip
    assert done.returncode == 7 and "last words" in done.stderr
    assert status.read_text() == "7"
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60, env=env)  # fmt: skip
    assert plain.returncode == 7 and list(tmp_path.iterdir()) == [status]
