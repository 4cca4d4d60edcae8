"""The launcher's own argument checks and its preflight: reported once, nothing started."""

import os
import signal
import subprocess
import sys

import pytest

from deadpool_megatron.failure.evidence import describe_exit
from jobs import ROOT, launch_cmd

SECRET = {"DEADPOOL_JOB_SECRET": "0123456789abcdef0123456789abcdef"}


def _launch(args: list[str], nproc: int = 8, spares: int = 0, launcher=None, env=None):
    return subprocess.run(
        launch_cmd(nproc, args, spares, launcher), cwd=ROOT, capture_output=True, text=True,
        timeout=120, env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_bad_job_flags_are_reported_once_and_no_process_starts():
    done = _launch(["--config", "configs/demo.yaml", "--tensor-model-parallel-size", "3"])
    assert done.returncode == 2
    out = done.stdout + done.stderr
    assert out.count("world size 8 is not divisible by --tensor-model-parallel-size 3") == 1
    assert "started worker" not in out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--nproc-per-node", "0"], "--nproc-per-node=0 must be at least 1"),
        (["--nproc-per-node", "2", "--spares", "-1"], "--spares=-1 must be 0 or more"),
        (
            ["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "2", "--master-port", "1"],
            "--node-rank=2 must lie in [0, 1] (--nnodes 2 + --spare-nodes 0)",
        ),
        (
            ["--nproc-per-node", "2", "--nnodes", "2", "--spare-nodes", "1", "--master-port", "1"],
            "--nnodes 2 + --spare-nodes 1 = 3 nodes, but the Slurm allocation has 2",
        ),
        (
            ["--nproc-per-node", "2", "--nnodes", "2"],
            "--master-port 0 (pick a free port) only works on one node",
        ),
        (
            ["--nproc-per-node", "2", "--fork-zygote", str(ROOT / "README.md")],
            f"--fork-zygote={ROOT / 'README.md'} is not a socket",
        ),
        (
            ["--nproc-per-node", "2", "--nnodes", "2", "--join", "--node-rank", "1",
             "--master-port", "1"],
            "--node-rank=1 with --join: a joining node takes the next free index past 1",
        ),
        (["--nproc-per-node", "2", "--join"], "--join into a job of 1 node"),
        (
            ["--nproc-per-node", "2", "--nnodes", "2", "--join", "--mpi-spawn",
             "--master-port", "1"],
            "--join with --mpi-spawn: Open MPI joins processes only inside the mpirun",
        ),
    ],
)  # fmt: skip
def test_bad_launcher_flags_exit_2(flags, message):
    done = subprocess.run(
        [sys.executable, "-m", "deadpool_megatron.launch", *flags, str(ROOT / "pretrain_gpt.py")],
        env=dict(os.environ, SLURM_JOB_NUM_NODES="2"),
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert message in done.stderr


@pytest.mark.parametrize(
    "flags, args, message",
    [
        (["--spare-nodes", "1"], [], "--spare-nodes 1 without --deadpool"),
        (["--spare-nodes", "1", "--restart-policy", "full"], ["--deadpool"],
         "--spare-nodes 1 with --restart-policy full"),
        ([], ["--pipeline-model-parallel-size", "4"], "world size 6 is not divisible by"),
        (["--join"], [], "--join without --deadpool"),
        (["--join", "--restart-policy", "full"], ["--deadpool"],
         "--join with --restart-policy full"),
        (["--join"], ["--deadpool", "--deadpool-transport", "mpi"],
         "--join with --deadpool-transport mpi"),
    ],
)  # fmt: skip
def test_bad_multi_node_jobs_exit_2_before_any_process_starts(flags, args, message):
    rank = [] if "--join" in flags else ["--node-rank", "0"]
    nodes = ["--nnodes", "3", *rank, "--master-port", "1", *flags]
    shape = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
             "--global-batch-size", "12"]  # fmt: skip
    done = _launch(["--config", "configs/demo.yaml", *shape, *args], nproc=2, launcher=nodes,
                   env=SECRET)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert (done.stdout + done.stderr).count(message) == 1
    assert "started worker" not in done.stdout + done.stderr


def test_several_nodes_need_the_jobs_secret_and_a_short_one_is_refused():
    nodes = ["--nnodes", "2", "--node-rank", "0", "--master-port", "1"]
    env = {k: v for k, v in os.environ.items() if k != "DEADPOOL_JOB_SECRET"}
    done = subprocess.run(
        [sys.executable, "-m", "deadpool_megatron.launch", "--nproc-per-node", "1", *nodes,
         str(ROOT / "pretrain_gpt.py")], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--nnodes 2 + --spare-nodes 0 = 2 nodes need DEADPOOL_JOB_SECRET set" in done.stderr
    done = _launch(["--config", "configs/demo.yaml"], nproc=1, env={"DEADPOOL_JOB_SECRET": "abc"})
    assert done.returncode == 2 and "DEADPOOL_JOB_SECRET has 3 characters" in done.stderr


def test_missing_script_is_named():
    done = subprocess.run(
        [sys.executable, "-m", "deadpool_megatron.launch", "--nproc-per-node", "1", "nope.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "script 'nope.py' does not exist" in done.stderr


def test_exit_descriptions():
    assert describe_exit(-signal.SIGKILL) == "was killed by signal SIGKILL"
    assert describe_exit(3) == "exited with status 3"


def test_unreachable_etcd_is_named_before_any_process_starts():
    done = _launch(["--config", "configs/demo.yaml", "--deadpool-store", "etcd",
                    "--deadpool-etcd-endpoints", "http://127.0.0.1:9"])  # fmt: skip
    assert done.returncode == 2
    assert "http://127.0.0.1:9" in done.stderr and "unreachable" in done.stderr
    assert "started worker" not in done.stdout + done.stderr


@pytest.mark.parametrize(
    "flags, args",
    [(["--mpi-spawn"], []), ([], ["--deadpool", "--deadpool-transport", "mpi"])],
    ids=["launcher-flag", "implied-by-the-script-s-flag"],
)
def test_the_mpi_transport_outside_mpirun_exits_2_once_before_any_process_starts(flags, args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    done = subprocess.run(
        [*launch_cmd(2, ["--config", "configs/demo.yaml", "--tensor-model-parallel-size", "1",
                         "--pipeline-model-parallel-size", "1", *args], 0, flags)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert out.count("needs the launcher started by Open MPI 5's mpirun with ULFM") == 1
    assert "started worker" not in out
