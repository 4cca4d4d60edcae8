"""The key-value store interface every coordination backend implements.

Membership, spare claims and heartbeats only need these few operations, so the job's
TCPStore (the launcher's, the default) and etcd (coordination that survives any one host) are
interchangeable. Compare-and-swap is the one primitive fencing is built on: a write is applied
only if the key still holds exactly what the writer last read.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from ..errors import DeadpoolError


class StoreUnreachable(DeadpoolError):
    """No store endpoint answered; the message names every endpoint that was tried."""

    def __init__(self, endpoint: str, reason: str):
        super().__init__(f"coordination store at {endpoint} is unreachable: {reason}")
        self.endpoint = endpoint


class StoreTimeout(DeadpoolError, TimeoutError):
    """`KVStore.wait` ran out of time; the message names the keys still missing."""


class KVStore(abc.ABC):
    """A small, thread-safe key-value store with atomic compare-and-swap and counters.

    Keys are strings (declared in `control.keys`); values are bytes.
    """

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """Where the store lives (``host:port`` or a list of URLs), for error messages."""

    @property
    def term(self) -> int:
        """The store's leadership term as this client last saw it (0 for a store without
        one, the TCPStore). A new term means the store elected a new leader: other clients'
        requests may have hung through the election while this client's did not, so a record
        that stood still across it proves nothing about its writer."""
        return 0

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value of `key`, or None if it does not exist. Never blocks waiting for it."""

    @abc.abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Unconditionally write `value` (for data with a single writer, e.g. a heartbeat)."""

    @abc.abstractmethod
    def compare_and_swap(
        self, key: str, expected: bytes | None, desired: bytes
    ) -> tuple[bool, bytes | None]:
        """Write `desired` only if `key` holds `expected` (None: only if it does not exist).

        Returns (True, desired) when this call wrote, else (False, current value or None).
        Exactly one of several concurrent callers with the same `expected` succeeds, even when
        they all write identical bytes.
        """

    @abc.abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Atomically add `amount` to the integer at `key` (0 if absent); returns the sum."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Remove `key`; returns whether it existed."""

    def delete_prefix(self, prefix: str) -> int | None:
        """Remove every key that starts with `prefix`; the number removed, or None where the
        store cannot list keys (the TCPStore: it lives only as long as the job anyway)."""
        return None

    @abc.abstractmethod
    def wait(self, keys: Sequence[str], timeout_s: float) -> None:
        """Block until every key exists; raises StoreTimeout naming the missing ones."""

    def close(self) -> None:  # noqa: B027 - stores without a connection need no cleanup
        """Release the connection; the store itself (and its data) lives on elsewhere."""

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
