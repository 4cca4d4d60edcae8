"""KVStore over torch's TCPStore: the store the launcher hosts for every job (the default).

TCPStore's native ``compare_set`` answers with the value the key holds afterwards, which
cannot tell "I wrote it" from "it already held my bytes", nor (for a missing key) "absent"
from "absent but you expected something". So values written by `compare_and_swap` carry a
short frame with a random nonce: only the winner can see its own nonce come back. `get`
strips the frame; plain `set` values and `add` counters are stored as they are.
"""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from .store import KVStore, StoreTimeout, StoreUnreachable

T = TypeVar("T")

_FRAME = b"\x00deadpool-cas\x00"
_NONCE_BYTES = 8
# compare_set(key, P, P) never writes anything we could not read back unchanged, and answers
# P only when the key is absent (or holds P, which no caller writes): a non-blocking get.
_PROBE = b"\x00deadpool-probe\x00"


def _unframe(raw: bytes) -> bytes:
    return raw[len(_FRAME) + _NONCE_BYTES :] if raw.startswith(_FRAME) else raw


class TcpKVStore(KVStore):
    """A client of (or, with `is_master`, the host of) a torch TCPStore."""

    def __init__(self, host: str, port: int, is_master: bool = False, timeout_s: float = 30.0):
        import torch.distributed as dist

        self._dist = dist
        self._lock = threading.Lock()
        self._endpoint = f"{host}:{port}"
        try:
            self._store = dist.TCPStore(
                host,
                port,
                is_master=is_master,
                timeout=datetime.timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
        except dist.DistNetworkError as err:
            raise StoreUnreachable(self._endpoint, _first_line(err)) from err
        if port == 0:
            self._endpoint = f"{host}:{self._store.port}"

    @classmethod
    def wrap(cls, store: object, endpoint: str) -> TcpKVStore:
        """Use an existing TCPStore (e.g. the launcher's own) through this interface."""
        import torch.distributed as dist

        self = cls.__new__(cls)
        self._dist, self._store, self._endpoint = dist, store, endpoint
        self._lock = threading.Lock()
        return self

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def port(self) -> int:
        return self._store.port

    def _call(self, op: Callable[[], T]) -> T:
        try:
            with self._lock:  # heartbeat, order-watcher and training threads share the client
                return op()
        except self._dist.DistNetworkError as err:
            raise StoreUnreachable(self._endpoint, _first_line(err)) from err

    def _raw(self, key: str) -> bytes | None:
        raw = self._call(lambda: self._store.compare_set(key, _PROBE, _PROBE))
        return None if raw == _PROBE else raw

    def get(self, key: str) -> bytes | None:
        raw = self._raw(key)
        return None if raw is None else _unframe(raw)

    def set(self, key: str, value: bytes) -> None:
        self._call(lambda: self._store.set(key, value))

    def compare_and_swap(
        self, key: str, expected: bytes | None, desired: bytes
    ) -> tuple[bool, bytes | None]:
        framed = _FRAME + os.urandom(_NONCE_BYTES) + desired
        while True:
            raw = self._raw(key)
            current = None if raw is None else _unframe(raw)
            if current != expected:
                return False, current
            # Swap against the exact raw bytes read; b"" asks for "absent" natively.
            old = b"" if raw is None else raw
            after = self._call(lambda old=old: self._store.compare_set(key, old, framed))
            if after == framed:
                return True, desired
            # Someone wrote in between; retry only if the key still holds what we expect.

    def add(self, key: str, amount: int) -> int:
        return self._call(lambda: self._store.add(key, amount))

    def delete(self, key: str) -> bool:
        return self._call(lambda: self._store.delete_key(key))

    def wait(self, keys: Sequence[str], timeout_s: float) -> None:
        try:
            self._call(lambda: self._store.wait(list(keys), datetime.timedelta(seconds=timeout_s)))
        except self._dist.DistStoreError as err:
            missing = [k for k in keys if self._raw(k) is None]
            raise StoreTimeout(
                f"keys {missing} did not appear in the store at {self._endpoint} "
                f"within {timeout_s:g} s"
            ) from err

    def close(self) -> None:
        # Dropping the last reference closes the client socket (or stops a hosted server).
        self._store = None


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
