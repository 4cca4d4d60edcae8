"""A torch.distributed (c10d) store on etcd: every generation's process groups meet there
instead of in node 0's TCPStore, so with `--deadpool-store etcd` no agent holds state the job
needs and losing any node, the first one included, leaves the job running.

A Python subclass of `dist.Store` (torch calls it from gloo's and NCCL's rendezvous through its
Python-store trampoline) over the etcd client of etcd_store.py: set, a get that waits for the
key as TCPStore's does, add, compare-and-set, wait and check. Keys live under
``deadpool/c10d/``; each generation's groups use their own prefix inside it
(JobContext.store_prefix), so no generation ever reads another's addresses.
"""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from . import keys
from .etcd_store import EtcdKVStore
from .store import StoreTimeout

ROOT = keys.C10D_ROOT
POLL_FIRST_S = 0.002  # rendezvous keys usually appear within milliseconds
POLL_MAX_S = 0.05


class EtcdC10dStore(dist.Store):
    def __init__(self, kv: EtcdKVStore, timeout_s: float = 300.0):
        super().__init__()
        self._kv = kv
        self._timeout_s = timeout_s

    @staticmethod
    def _key(key: str) -> str:
        return ROOT + key

    def _timeout(self, timeout: datetime.timedelta | None) -> float:
        return self._timeout_s if timeout is None else timeout.total_seconds()

    def _wait(self, keys: list[str], timeout_s: float) -> dict[str, bytes]:
        deadline = time.monotonic() + timeout_s
        got: dict[str, bytes] = {}
        pause = POLL_FIRST_S
        while True:
            for k in keys:
                if k not in got:
                    value = self._kv.get(self._key(k))
                    if value is not None:
                        got[k] = value
            if len(got) == len(keys):
                return got
            if time.monotonic() >= deadline:
                missing = [k for k in keys if k not in got]
                raise StoreTimeout(
                    f"c10d keys {missing} did not appear in etcd at {self._kv.endpoint} within "
                    f"{timeout_s:g} s"
                )
            time.sleep(pause)
            pause = min(POLL_MAX_S, pause * 2)

    # -- dist.Store ---------------------------------------------------------------------------
    def set(self, key: str, value) -> None:
        self._kv.set(self._key(key), bytes(value))

    def get(self, key: str) -> bytes:
        return self._wait([key], self._timeout_s)[key]

    def add(self, key: str, amount: int) -> int:
        return self._kv.add(self._key(key), int(amount))

    def compare_set(self, key: str, expected, desired) -> bytes:
        """TCPStore's semantics: set `desired` if the key holds `expected` (an absent key
        matches an empty `expected`); returns the value the key holds afterwards."""
        expected, desired = bytes(expected), bytes(desired)
        ok, now = self._kv.compare_and_swap(self._key(key), expected or None, desired)
        if ok:
            return desired
        return expected if now is None else now

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._wait(list(keys), self._timeout(timeout))

    def check(self, keys: list[str]) -> bool:
        return all(self._kv.get(self._key(k)) is not None for k in keys)

    def delete_key(self, key: str) -> bool:
        return self._kv.delete(self._key(key))

    def num_keys(self) -> int:
        raise NotImplementedError("num_keys is not kept on etcd")

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout_s = timeout.total_seconds()
