"""Shared test set-up: the tests folder on sys.path (for `jobs`), an in-process TCPStore, and a
real etcd server (Debian's etcd-server, installed with apt-get when missing) for the tests that
need one."""

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from etcd_server import etcd_binary, free_port  # noqa: E402
from waiting import STORE_CONNECT_S  # noqa: E402

from deadpool_megatron.control.etcd_store import EtcdKVStore  # noqa: E402
from deadpool_megatron.control.store import StoreUnreachable  # noqa: E402
from deadpool_megatron.control.tcp_store import TcpKVStore  # noqa: E402
from jobs import Drivers  # noqa: E402


@pytest.fixture
def kv() -> Iterator[TcpKVStore]:
    """A real TCPStore hosted in the test process: the in-process store of unit tests."""
    store = TcpKVStore("127.0.0.1", 0, is_master=True, timeout_s=STORE_CONNECT_S)
    yield store
    store.close()


@pytest.fixture(scope="session")
def etcd_url(tmp_path_factory) -> Iterator[str]:
    binary = etcd_binary()
    client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    data = tmp_path_factory.mktemp("etcd")
    with open(data.parent / "etcd.log", "wb") as log:
        # fmt: off
        proc = subprocess.Popen(
            [binary, "--name", "deadpool-test", "--data-dir", str(data / "data"),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"deadpool-test={peer}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        # fmt: on
    try:
        probe, deadline = EtcdKVStore(client, timeout_s=0.5), time.monotonic() + 15
        while True:
            try:
                probe.get("probe")
                break
            except StoreUnreachable:
                tail = (data.parent / "etcd.log").read_text()[-1500:]
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"etcd at {client} did not start (rc {proc.poll()}):\n{tail}")
                time.sleep(0.05)
        yield client
    finally:
        proc.terminate()  # by pid: only the etcd we started
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@pytest.fixture(scope="session")
def run_drivers() -> Iterator[Callable[[Path, list[list[str]], float], list[dict]]]:
    """`run_drivers(driver, argvs, timeout_s)`: the drivers of tests/drivers, forked (jobs.Drivers)."""
    drivers = Drivers()
    yield drivers.run
    drivers.close()


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `gpu` run only where torch sees a CUDA device (scripts/gpu_check.sh)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run scripts/gpu_check.sh on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
