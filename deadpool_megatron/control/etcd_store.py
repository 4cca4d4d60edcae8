"""KVStore over etcd v3, for clusters whose coordination must survive the loss of any host.

Talks to etcd's JSON gRPC gateway (``POST /v3/kv/...``, served by etcd 3.4 and later) with
the standard library only: the Python etcd clients break with current protobuf (see the field
notes). Keys and values travel base64-encoded; int64 fields come back as JSON strings, and
fields at their default (``succeeded: false``, an empty ``value``) are omitted.

Secured clusters: https endpoints checked against a CA bundle, a client certificate for
etcd's --client-cert-auth, and etcd's own users (``/v3/auth/authenticate`` gives a token sent
as the Authorization header; an expired token is renewed once and the request retried).
"""

from __future__ import annotations

import base64
import json
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from ..endpoints import EtcdSecurity, parse_endpoints
from ..errors import DeadpoolError
from .store import KVStore, StoreTimeout, StoreUnreachable

__all__ = ["EtcdKVStore", "parse_endpoints"]

RETRY_S = 0.1
# One request's wait on one member: a request a follower took during an election can hang for
# etcd's own request timeout (seconds) after the new leader is up, while another member (or
# the same one, asked again) answers at once. Waited for whole, it made one node's lease and
# heartbeats late by those seconds and a node watching through another member counted it lost
# (CI-like run of test_multinode's etcd test: node 2 counted lost 2-3 s after the leader died).
ATTEMPT_S = 1.0
AUTHENTICATE = "/v3/auth/authenticate"


def _prefix_end(prefix: bytes) -> bytes:
    """etcd's range end for "every key starting with prefix": the prefix with its last byte
    incremented (trailing 0xff bytes dropped first)."""
    trimmed = prefix.rstrip(b"\xff")
    return trimmed[:-1] + bytes([trimmed[-1] + 1])


def _ssl_context(security: EtcdSecurity) -> ssl.SSLContext | None:
    """Verification against the CA bundle (the system's without one) and the client
    certificate; None for plain http."""
    if not security.tls:
        return None
    context = ssl.create_default_context(cafile=security.cacert)
    if security.cert:
        context.load_cert_chain(security.cert, security.key)
    return context


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


class EtcdKVStore(KVStore):
    """An etcd v3 cluster reached through any of `endpoints` (tried in turn)."""

    def __init__(
        self,
        endpoints: str | Sequence[str],
        timeout_s: float = 5.0,
        poll_s: float = 0.05,
        security: EtcdSecurity | None = None,
    ):
        self._urls = parse_endpoints(endpoints)
        self._timeout_s = timeout_s
        self._poll_s = poll_s
        self._order_lock = threading.Lock()
        self._security = security or EtcdSecurity()
        self._ssl = _ssl_context(self._security)
        self._token: str | None = None
        self._token_lock = threading.Lock()
        self._term = 0  # the highest raft term any answer carried

    @property
    def term(self) -> int:
        return self._term

    @property
    def endpoint(self) -> str:
        return ",".join(self._urls)

    def _post(self, path: str, body: dict) -> dict:
        """POST to the first endpoint that answers; it is tried first next time. Every
        endpoint is tried again (each attempt waited for up to ATTEMPT_S) until the timeout: a
        member that died, or a cluster electing a new leader (about a second), is ridden out,
        not reported."""
        data = json.dumps(body).encode()
        deadline = time.monotonic() + self._timeout_s
        while True:
            failures = []
            for url in list(self._urls):
                answer = self._try(url, path, data, failures)
                if answer is not None:
                    return answer
            if time.monotonic() >= deadline:
                raise StoreUnreachable(self.endpoint, "; ".join(failures))
            time.sleep(RETRY_S)

    def _try(
        self, url: str, path: str, data: bytes, failures: list[str], renewed: bool = False
    ) -> dict | None:
        try:
            answer = self._request(url, path, data, self._auth_header(url))
        except urllib.error.HTTPError as err:
            detail = _error_message(err)
            if err.code == 401 and self._security.user and not renewed:
                self._renew_token(url)  # expired (etcd's --auth-token-ttl): once more, renewed
                return self._try(url, path, data, failures, renewed=True)
            if err.code < 500:  # our request is wrong; another member would say the same
                raise DeadpoolError(f"etcd at {url} rejected {path}: {detail}") from err
            failures.append(f"{url}: HTTP {err.code} {detail}")
            return None
        except (urllib.error.URLError, OSError) as err:
            # A timed-out write may still have been applied; CAS callers re-read anyway.
            failures.append(f"{url}: {getattr(err, 'reason', err)}")
            return None
        with self._order_lock:
            if url != self._urls[0]:
                self._urls.remove(url)
                self._urls.insert(0, url)
            self._term = max(self._term, int(answer.get("header", {}).get("raft_term", 0)))
        return answer

    def _request(self, url: str, path: str, data: bytes, headers: dict[str, str]) -> dict:
        request = urllib.request.Request(
            url + path, data=data, headers={"Content-Type": "application/json", **headers}
        )
        timeout = min(self._timeout_s, ATTEMPT_S)
        opened = urllib.request.urlopen(request, timeout=timeout, context=self._ssl)
        with opened as response:
            return json.loads(response.read() or b"{}")

    def _auth_header(self, url: str) -> dict[str, str]:
        if not self._security.user:
            return {}
        with self._token_lock:
            token = self._token
        if token is None:
            token = self._renew_token(url)
        return {"Authorization": token}

    def _renew_token(self, url: str) -> str:
        """A fresh token for the configured user (raises DeadpoolError when etcd refuses it)."""
        body = json.dumps({"name": self._security.user, "password": self._security.password})
        try:
            answer = self._request(url, AUTHENTICATE, body.encode(), {})
        except urllib.error.HTTPError as err:
            raise DeadpoolError(
                f"etcd at {url} refused user {self._security.user!r}: {_error_message(err)}"
            ) from err
        with self._token_lock:
            self._token = answer["token"]
            return self._token

    def get(self, key: str) -> bytes | None:
        return _first_value(self._post("/v3/kv/range", {"key": _b64(key)}))

    def set(self, key: str, value: bytes) -> None:
        self._post("/v3/kv/put", {"key": _b64(key), "value": _b64(value)})

    def compare_and_swap(
        self, key: str, expected: bytes | None, desired: bytes
    ) -> tuple[bool, bytes | None]:
        k = _b64(key)
        if expected is None:  # a key that never existed (or was deleted) has revision 0
            compare = {"target": "CREATE", "result": "EQUAL", "key": k, "create_revision": "0"}
        else:
            compare = {"target": "VALUE", "result": "EQUAL", "key": k, "value": _b64(expected)}
        answer = self._post(
            "/v3/kv/txn",
            {
                "compare": [compare],
                "success": [{"request_put": {"key": k, "value": _b64(desired)}}],
                "failure": [{"request_range": {"key": k}}],
            },
        )
        if answer.get("succeeded", False):
            return True, desired
        return False, _first_value(answer["responses"][0]["response_range"])

    def add(self, key: str, amount: int) -> int:
        current = self.get(key)
        while True:
            try:
                total = int(current or b"0") + amount
            except ValueError:
                raise DeadpoolError(
                    f"etcd key {key!r} holds {current!r}, not an integer counter"
                ) from None
            ok, current = self.compare_and_swap(key, current, str(total).encode())
            if ok:
                return total

    def delete(self, key: str) -> bool:
        return int(self._post("/v3/kv/deleterange", {"key": _b64(key)}).get("deleted", 0)) > 0

    def delete_prefix(self, prefix: str) -> int:
        if not prefix:
            raise ValueError("an empty prefix would delete the whole keyspace")
        end = _prefix_end(prefix.encode())
        body = {"key": _b64(prefix), "range_end": _b64(end)}
        return int(self._post("/v3/kv/deleterange", body).get("deleted", 0))

    def wait(self, keys: Sequence[str], timeout_s: float) -> None:
        # Polling is enough for the rare waits of the control plane; a watch would need a stream.
        deadline = time.monotonic() + timeout_s
        missing = list(keys)
        while True:
            missing = [k for k in missing if self.get(k) is None]
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise StoreTimeout(
                    f"keys {missing} did not appear in etcd at {self.endpoint} "
                    f"within {timeout_s:g} s"
                )
            time.sleep(self._poll_s)


def _first_value(range_response: dict) -> bytes | None:
    kvs = range_response.get("kvs") or []
    return base64.b64decode(kvs[0].get("value", "")) if kvs else None


def _error_message(err: urllib.error.HTTPError) -> str:
    try:
        return json.loads(err.read()).get("message", "") or str(err.reason)
    except (ValueError, OSError):
        return str(err.reason)
