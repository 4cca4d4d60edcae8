"""Open the job's coordination store the way the flags ask: the launcher's TCPStore, or etcd."""

from __future__ import annotations

from ..config import DeadpoolConfig
from ..endpoints import etcd_security
from .etcd_store import EtcdKVStore
from .signed import job_secret, signed
from .store import KVStore
from .tcp_store import TcpKVStore


def etcd_client(settings: DeadpoolConfig, timeout_s: float = 5.0) -> EtcdKVStore:
    """An (unsigned) client of the job's etcd, with its TLS and auth options."""
    s = settings
    security = etcd_security(s.deadpool_etcd_cacert, s.deadpool_etcd_cert, s.deadpool_etcd_key,
                             s.deadpool_etcd_user, s.deadpool_etcd_endpoints or "")  # fmt: skip
    return EtcdKVStore(s.deadpool_etcd_endpoints or "", timeout_s=timeout_s, security=security)


def control_store(
    settings: DeadpoolConfig, host: str, port: int, timeout_s: float = 30.0
) -> KVStore:
    """A client of the control store, signed with the job's secret (control/signed.py);
    raises StoreUnreachable naming the endpoint(s)."""
    if settings.deadpool_store == "etcd":
        store: KVStore = etcd_client(settings, timeout_s=min(timeout_s, 5.0))
        store.get("deadpool/probe")  # fail now, naming the endpoints, not at the first beat
    else:
        store = TcpKVStore(host, port, timeout_s=timeout_s)
    return signed(store, job_secret())
