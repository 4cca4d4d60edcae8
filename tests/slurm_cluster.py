"""A real Slurm on this machine for tests: Debian's slurm-wlm and munge (installed with apt-get
when missing), munged, slurmctld and one slurmd per fake node, all on loopback with their
state, spool, pid and log files in a temporary folder (settings from FIELD-NOTES)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from etcd_server import free_port

START_TIMEOUT_S = 60


def _install() -> None:
    if shutil.which("slurmctld") and shutil.which("munged") and shutil.which("sbatch"):
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip("Slurm is not installed and cannot be here (needs root and apt-get to "
                    "install slurm-wlm and munge)")  # fmt: skip
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "slurm-wlm", "munge"]
    done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=600)
        done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
    if not shutil.which("slurmctld"):
        pytest.skip(f"`apt-get install slurm-wlm munge` failed: {(done.stderr or '')[-500:]}")


def _start_munge() -> None:
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0:
        return
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        key.parent.mkdir(parents=True, exist_ok=True)
        key.write_bytes(os.urandom(1024))
    for d in ("/etc/munge", "/run/munge", "/var/lib/munge", "/var/log/munge"):
        os.makedirs(d, exist_ok=True)
        shutil.chown(d, "munge", "munge")
    os.chmod("/etc/munge", 0o700)
    shutil.chown(key, "munge", "munge")
    os.chmod(key, 0o400)
    subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True,
                   capture_output=True, timeout=30)  # fmt: skip


@dataclass
class SlurmCluster:
    root: Path
    nodes: list[str]
    env: dict[str, str]
    pids: list[int]

    def run(self, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip

    def job_state(self, job_id: str) -> str:
        out = self.run("scontrol", "show", "job", job_id, "-o").stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "UNKNOWN"

    def wait_job(self, job_id: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in (
                "COMPLETED",
                "FAILED",
                "CANCELLED",
                "TIMEOUT",
                "NODE_FAIL",
                "OUT_OF_MEMORY",
            ):
                return state
            time.sleep(0.5)
        self.run("scancel", job_id)
        return f"{state} (cancelled after {timeout_s:.0f} s)"

    def stop(self) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        time.sleep(1)
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def start_cluster(root: Path, count: int, cpus: int = 4) -> SlurmCluster:
    _install()
    _start_munge()
    names = [f"n{i + 1}" for i in range(count)]
    # Every port drawn free on its own: consecutive ports after a free one may be taken (a
    # busy suite holds thousands of ephemeral ones), and a slurmd that cannot bind exits.
    ports: list[int] = []
    while len(ports) < count + 1:
        port = free_port()
        if port not in ports:
            ports.append(port)
    ctld = ports.pop()
    for sub in ("state", "spool", "log", "run"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    lines = [
        "ClusterName=deadpool", "SlurmctldHost=localhost(127.0.0.1)", f"SlurmctldPort={ctld}",
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
        f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/run/slurmctld.pid", f"SlurmdPidFile={root}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log", f"SlurmdLogFile={root}/log/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        "SchedulerParameters=batch_sched_delay=0", "SlurmdParameters=config_overrides",
        "ReturnToService=2", "MpiDefault=none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "KillWait=5",
        *(f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs={cpus}"
          for n, p in zip(names, ports)),
        f"PartitionName=debug Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP "
        "OverSubscribe=FORCE:4",
    ]  # fmt: skip
    conf.write_text("\n".join(lines) + "\n")
    env = dict(os.environ, SLURM_CONF=str(conf))
    pids = []
    ctl = subprocess.Popen(["slurmctld", "-D", "-c", "-f", str(conf)], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)  # fmt: skip
    pids.append(ctl.pid)
    for n in names:
        d = subprocess.Popen(["slurmd", "-D", "-N", n, "-f", str(conf)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)  # fmt: skip
        pids.append(d.pid)
    cluster = SlurmCluster(root, names, env, pids)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        out = cluster.run("sinfo", "-h", "-N", "-o", "%N %t").stdout.split("\n")
        states = dict(line.split() for line in out if line.strip())
        if len(states) == count and all(s == "idle" for s in states.values()):
            return cluster
        time.sleep(0.5)
    logs = "\n".join(f"== {log.name}\n" + log.read_text(errors="replace")[-1500:]
                     for log in sorted((root / "log").glob("*.log")))  # fmt: skip
    cluster.stop()
    raise RuntimeError(f"the local Slurm did not come up within {START_TIMEOUT_S} s: {logs}")
