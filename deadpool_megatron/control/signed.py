"""Only the job's own processes steer it: every value written to the control store carries an
HMAC of its key and bytes under a per-job secret, and a value without a valid one reads as
absent.

The store is reachable from every host of the cluster (a TCPStore port, an etcd endpoint), and
what it holds decides who is fenced, which spare takes a rank and when everyone rolls back: a
forged recovery order or plan would be obeyed. The secret comes from the environment
(`DEADPOOL_JOB_SECRET`): `deadpool-launch` draws one for a single-node job, the Slurm script
and the local multi-node runner draw one per job and hand it to every node. The key is part of
the MAC, so a genuine record cannot be replayed under another key (keys name the generation).
Counters (`add`) are integers the store adds atomically and cannot carry a MAC: they count
finished ranks and departed agents, never steer a recovery.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Mapping, Sequence

from ..errors import ConfigError, DeadpoolError
from .store import KVStore

log = logging.getLogger("deadpool.store")

ENV_JOB_SECRET = "DEADPOOL_JOB_SECRET"
MIN_SECRET_CHARS = 16
MAC_BYTES = 32


class ForgedRecord(DeadpoolError):
    """A compare-and-swap met a value the job's secret did not sign."""


def job_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The job's secret from the environment (None when unset); a short one is refused."""
    value = (os.environ if environ is None else environ).get(ENV_JOB_SECRET)
    if value is None:
        return None
    if len(value) < MIN_SECRET_CHARS:
        raise ConfigError(
            f"{ENV_JOB_SECRET} has {len(value)} characters; it needs at least "
            f"{MIN_SECRET_CHARS} (e.g. the output of: python -c 'import secrets; "
            f"print(secrets.token_hex(32))')"
        )
    return value.encode()


def new_secret() -> str:
    """A fresh secret for one job."""
    return secrets.token_hex(32)


class SignedKVStore(KVStore):
    """`inner` with every value sealed on write and checked on read."""

    def __init__(self, inner: KVStore, secret: bytes):
        if len(secret) < MIN_SECRET_CHARS:
            raise ConfigError(f"the job secret needs at least {MIN_SECRET_CHARS} bytes")
        self.inner = inner
        self._secret = secret
        self._reported: set[str] = set()  # keys whose forged value was logged already

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._secret, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def seal(self, key: str, value: bytes) -> bytes:
        return self._mac(key, value) + value

    def open(self, key: str, raw: bytes) -> bytes | None:
        """The value, or None (logged once per key) when the MAC does not match."""
        mac, value = raw[:MAC_BYTES], raw[MAC_BYTES:]
        if len(raw) >= MAC_BYTES and hmac.compare_digest(mac, self._mac(key, value)):
            return value
        if key not in self._reported:
            self._reported.add(key)
            log.error("ignored a value at %s that the job's secret did not sign (%d bytes): "
                      "another job, or a forged write", key, len(raw))  # fmt: skip
        return None

    @property
    def endpoint(self) -> str:
        return self.inner.endpoint

    @property
    def term(self) -> int:
        return self.inner.term

    def get(self, key: str) -> bytes | None:
        raw = self.inner.get(key)
        return None if raw is None else self.open(key, raw)

    def set(self, key: str, value: bytes) -> None:
        self.inner.set(key, self.seal(key, value))

    def compare_and_swap(
        self, key: str, expected: bytes | None, desired: bytes
    ) -> tuple[bool, bytes | None]:
        sealed = None if expected is None else self.seal(key, expected)
        ok, current = self.inner.compare_and_swap(key, sealed, self.seal(key, desired))
        if ok:
            return True, desired
        if current is None:
            return False, None
        value = self.open(key, current)
        if value is None:  # nothing this job wrote can ever replace it: say so, do not spin
            raise ForgedRecord(f"{key} holds a value the job's secret did not sign")
        return False, value

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def delete(self, key: str) -> bool:
        return self.inner.delete(key)

    def delete_prefix(self, prefix: str) -> int | None:
        return self.inner.delete_prefix(prefix)

    def wait(self, keys: Sequence[str], timeout_s: float) -> None:
        self.inner.wait(keys, timeout_s)

    def close(self) -> None:
        self.inner.close()


def signed(inner: KVStore, secret: bytes | None) -> KVStore:
    """`inner`, signed when the job has a secret; unsigned (logged) for a process started
    without one (by hand, outside deadpool-launch)."""
    if secret is None:
        log.warning("%s is unset: the control store's records are not authenticated",
                    ENV_JOB_SECRET)  # fmt: skip
        return inner
    return SignedKVStore(inner, secret)
