"""Python torch.distributed (c10d) stores.

`StoppableStore`: the store generation 0's process groups meet on, whose waits give up once
a recovery is ordered (below).

`EtcdC10dStore`: a store on etcd: every generation's process groups meet there
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
from collections.abc import Callable

import torch.distributed as dist

from . import keys
from .etcd_store import EtcdKVStore
from .wait import wait_until

ROOT = keys.C10D_ROOT
POLL_FIRST_S = 0.002  # rendezvous keys usually appear within milliseconds
POLL_MAX_S = 0.05
STOPPABLE_POLL_FIRST_S = 0.001
# How often, at most, all the ranks waiting in a stoppable rendezvous at once ask the store in
# all: each rank's pauses grow to world_size / this (at least 5 ms, at most 1 s).
STORE_POLLS_PER_S = 2000.0


def poll_cap(world_size: int) -> float:
    """The longest pause between two polls of one rank's rendezvous wait: 5 ms for a job of
    a few ranks; longer as it grows, so that its ranks waiting at once for a late peer (the
    imports of thousands of processes end seconds apart) poll the one store about
    STORE_POLLS_PER_S times a second in all; at most 1 s."""
    return min(1.0, max(0.005, world_size / STORE_POLLS_PER_S))


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
        got: dict[str, bytes] = {}

        def poll() -> dict[str, bytes] | None:
            for k in keys:
                if k not in got:
                    value = self._kv.get(self._key(k))
                    if value is not None:
                        got[k] = value
            return got if len(got) == len(keys) else None

        def timed_out() -> str:
            missing = [k for k in keys if k not in got]
            return (f"c10d keys {missing} did not appear in etcd at {self._kv.endpoint} "
                    f"within {timeout_s:g} s")  # fmt: skip

        return wait_until(poll, timeout_s, "c10d keys", interval_s=POLL_FIRST_S,
                          max_interval_s=POLL_MAX_S, timed_out=timed_out)  # fmt: skip

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


class StoppableStore(dist.Store):
    """Generation 0's rendezvous store, whose waits look at `stop` (which raises to give up)
    between polls of the wrapped store.

    A rank that dies after registering and before its groups are up leaves every peer waiting
    in gloo's (or NCCL's) rendezvous for its address: a store get in torch's C++, which no
    recovery can cut (there are no connections yet), so the peers sat there until the group's
    timeout, the recovery took them for blocked, and the job ended with every rank lost. Here
    the wait polls the key (`check`, a round trip of about 30 us; a TCPStore wait with a short
    timeout logs two warnings per timeout instead), pausing 1 ms, then longer up to
    `poll_max_s`, and asks `stop` at each poll: the recovery order makes the set-up raise, and
    the rank sets up again in the next generation. A recovery's groups meet only after its
    own rendezvous (recovery/stages.py), which a newer order interrupts, so they keep torch's
    blocking get (no polling in a recovery's time).
    """

    def __init__(
        self, inner: dist.Store, stop: Callable[[], None], timeout_s: float,
        poll_max_s: float = 0.005,
        clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
    ):  # fmt: skip
        """`poll_max_s`: the longest pause between two polls (`poll_cap`)."""
        super().__init__()
        self._inner = inner
        self._stop = stop
        self._timeout_s = timeout_s
        self._poll_max_s = poll_max_s
        self._clock = clock
        self._sleep = sleep

    def _wait(self, keys: list[str], timeout_s: float) -> None:
        def poll() -> bool | None:
            if self._inner.check(keys):
                return True
            self._stop()
            return None

        wait_until(poll, timeout_s, "c10d keys", interval_s=STOPPABLE_POLL_FIRST_S,
                   max_interval_s=self._poll_max_s, clock=self._clock, sleep=self._sleep,
                   timed_out=lambda: f"c10d keys {keys} did not appear within {timeout_s:g} s",
                   )  # fmt: skip

    # -- dist.Store ---------------------------------------------------------------------------
    def set(self, key: str, value) -> None:
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._wait([key], self._timeout_s)
        return self._inner.get(key)

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._inner.compare_set(key, expected, desired)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._wait(list(keys), self._timeout_s if timeout is None else timeout.total_seconds())

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout_s = timeout.total_seconds()
