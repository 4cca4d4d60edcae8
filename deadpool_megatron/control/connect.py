"""Open the job's coordination store the way the flags ask: the launcher's TCPStore, or etcd."""

from __future__ import annotations

from .etcd_store import EtcdKVStore, parse_endpoints
from .signed import job_secret, signed
from .store import KVStore
from .tcp_store import TcpKVStore


def control_store(
    kind: str, etcd_endpoints: str | None, host: str, port: int, timeout_s: float = 30.0
) -> KVStore:
    """A client of the control store, signed with the job's secret (control/signed.py);
    raises StoreUnreachable naming the endpoint(s)."""
    if kind == "etcd":
        store = EtcdKVStore(parse_endpoints(etcd_endpoints or ""), timeout_s=min(timeout_s, 5.0))
        store.get("deadpool/probe")  # fail now, naming the endpoints, not at the first beat
        return signed(store, job_secret())
    return signed(TcpKVStore(host, port, timeout_s=timeout_s), job_secret())
