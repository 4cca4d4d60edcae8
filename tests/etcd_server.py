"""A real etcd server for tests: Debian's etcd-server, installed with apt-get when missing,
started on free loopback ports in a temporary data dir and stopped by pid."""

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from deadpool_megatron.agent.local import free_port


def etcd_binary() -> str:
    found = shutil.which("etcd")
    if found:
        return found
    if shutil.which("apt-get") is None:
        pytest.skip("etcd is not on PATH and apt-get is not available to install etcd-server")
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    if sudo and shutil.which("sudo") is None:
        pytest.skip("etcd is not on PATH and installing etcd-server needs root (no sudo)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = [*sudo, "apt-get", "install", "-y", "etcd-server"]
    done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        subprocess.run([*sudo, "apt-get", "update"], env=env, capture_output=True, timeout=600)
        done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
    found = shutil.which("etcd")
    if found is None:
        pytest.skip(f"`apt-get install -y etcd-server` failed: {(done.stderr or '')[-500:]}")
    return found


def count_keys(url: str, prefix: str) -> int:
    """How many keys under `prefix` the etcd at `url` holds (its JSON gateway's range)."""
    import base64
    import json
    import urllib.request

    start = prefix.encode()
    end = start[:-1] + bytes([start[-1] + 1])  # the prefixes asked here end in "/", not 0xff
    body = {"key": base64.b64encode(start).decode(), "count_only": True,
            "range_end": base64.b64encode(end).decode()}  # fmt: skip
    req = urllib.request.Request(url + "/v3/kv/range", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=5) as resp:
        return int(json.loads(resp.read()).get("count", 0))


@dataclass
class EtcdCluster:
    """A real etcd cluster of several members on loopback."""

    urls: list[str]
    procs: list[subprocess.Popen]

    @property
    def endpoints(self) -> str:
        return ",".join(self.urls)

    def leader(self) -> int:
        """The live member that leads the cluster now (killing it forces an election)."""
        import json
        import urllib.request

        for i, url in enumerate(self.urls):
            if self.procs[i].poll() is not None:
                continue  # killed
            req = urllib.request.Request(url + "/v3/maintenance/status", data=b"{}")
            with urllib.request.urlopen(req, timeout=5) as resp:
                status = json.loads(resp.read())
            if status["header"]["member_id"] == status.get("leader"):
                return i
        raise RuntimeError(f"no live etcd member of {self.urls} says it leads")

    def wait_for_leader(self, timeout_s: float = 30.0) -> int:
        """The member that leads once an election (after a kill) is over."""
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.leader()
            except (RuntimeError, OSError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def count(self, prefix: str) -> int:
        """How many keys under `prefix` the cluster holds (asked of its first live member)."""
        return count_keys(next(u for u, p in zip(self.urls, self.procs) if p.poll() is None),
                          prefix)  # fmt: skip

    def kill(self, member: int) -> None:
        self.procs[member].kill()
        self.procs[member].wait(timeout=5)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)


def start_etcd_cluster(root: Path, members: int = 3, timeout_s: float = 30) -> EtcdCluster:
    from deadpool_megatron.control.etcd_store import EtcdKVStore
    from deadpool_megatron.control.store import StoreUnreachable

    binary = etcd_binary()
    names = [f"m{i}" for i in range(members)]
    clients = [f"http://127.0.0.1:{free_port()}" for _ in names]
    peers = [f"http://127.0.0.1:{free_port()}" for _ in names]
    initial = ",".join(f"{n}={p}" for n, p in zip(names, peers))
    procs = []
    for name, client, peer in zip(names, clients, peers):
        log = open(root / f"etcd-{name}.log", "wb")  # noqa: SIM115 (lives with the process)
        procs.append(subprocess.Popen(
            [binary, "--name", name, "--data-dir", str(root / f"etcd-{name}"),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", initial, "--initial-cluster-state", "new"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        ))  # fmt: skip
    cluster = EtcdCluster(clients, procs)
    deadline = time.monotonic() + timeout_s
    for url in clients:  # every member answers (a write needs the quorum)
        probe = EtcdKVStore(url, timeout_s=1.0)
        while True:
            try:
                probe.set("deadpool/probe", b"1")
                break
            except StoreUnreachable:
                if time.monotonic() > deadline:
                    cluster.stop()
                    raise RuntimeError(f"the etcd cluster {clients} did not start") from None
                time.sleep(0.1)
    return cluster
