"""The etcd client against a real etcd that demands TLS, client certificates and a user:
certificates made with openssl for this test, auth enabled through etcd's own API, a token
lifetime of one second so that renewal is exercised."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from etcd_server import etcd_binary

from deadpool_megatron.agent.local import free_port
from deadpool_megatron.config import DeadpoolConfig
from deadpool_megatron.control.connect import etcd_client
from deadpool_megatron.control.etcd_store import EtcdKVStore
from deadpool_megatron.control.store import StoreUnreachable
from deadpool_megatron.endpoints import ENV_ETCD_PASSWORD, EtcdSecurity, etcd_security
from deadpool_megatron.errors import ConfigError, DeadpoolError

pytestmark = pytest.mark.timeout(120)
PASSWORD = "correct horse battery staple"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _certificates(d: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by it."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=ca",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=d)  # fmt: skip
    (d / "san.ext").write_text(
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "1", "-extfile", "san.ext", "-out", f"{name}.crt",
                 cwd=d)  # fmt: skip


def _start(d: Path, name: str, extra: list[str]) -> tuple[str, subprocess.Popen]:
    client, peer = f"https://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    log = open(d / f"{name}.log", "wb")  # noqa: SIM115 (lives with the process)
    proc = subprocess.Popen(
        [etcd_binary(), "--name", name, "--data-dir", str(d / name),
         "--listen-client-urls", client, "--advertise-client-urls", client,
         "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
         "--initial-cluster", f"{name}={peer}", "--cert-file", str(d / "server.crt"),
         "--key-file", str(d / "server.key"), *extra],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    return client, proc


def _until_up(store: EtcdKVStore, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            store.get("probe")
            return
        except StoreUnreachable:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"etcd did not start:\n{log.read_text()[-1500:]}")
            time.sleep(0.1)


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """Two etcds over TLS: one that demands client certificates, one with its users (auth
    enabled, tokens that live one second)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the test's certificates")
    d = tmp_path_factory.mktemp("etcd-tls")
    _certificates(d)
    certs_url, certs = _start(d, "certs", ["--trusted-ca-file", str(d / "ca.crt"),
                                           "--client-cert-auth"])  # fmt: skip
    users_url, users = _start(d, "users", ["--auth-token", "simple", "--auth-token-ttl", "1"])
    try:
        tls = EtcdSecurity(str(d / "ca.crt"), str(d / "client.crt"), str(d / "client.key"))
        _until_up(EtcdKVStore(certs_url, timeout_s=1.0, security=tls), certs, d / "certs.log")
        admin = EtcdKVStore(users_url, timeout_s=1.0, security=EtcdSecurity(str(d / "ca.crt")))
        _until_up(admin, users, d / "users.log")
        for path, body in (
            ("/v3/auth/user/add", {"name": "root", "password": PASSWORD}),
            ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
            ("/v3/auth/enable", {}),
        ):
            req = urllib.request.Request(users_url + path, data=json.dumps(body).encode())
            urllib.request.urlopen(req, timeout=5, context=admin._ssl).read()
        yield certs_url, users_url, d
    finally:
        for proc in (certs, users):
            proc.terminate()
            proc.wait(timeout=10)


def _settings(url: str, d: Path, **over) -> DeadpoolConfig:
    base = dict(deadpool_store="etcd", deadpool_etcd_endpoints=url,
                deadpool_etcd_cacert=str(d / "ca.crt"))  # fmt: skip
    return DeadpoolConfig(**{**base, **over})


def _with_cert(url: str, d: Path) -> DeadpoolConfig:
    return _settings(url, d, deadpool_etcd_cert=str(d / "client.crt"),
                     deadpool_etcd_key=str(d / "client.key"))  # fmt: skip


def _exercise(store: EtcdKVStore) -> None:
    store.set("deadpool/t", b"v1")
    assert store.get("deadpool/t") == b"v1"
    assert store.compare_and_swap("deadpool/t", b"v1", b"v2") == (True, b"v2")
    value = bytes(range(256))
    store.set("deadpool/bytes", value)
    assert store.get("deadpool/bytes") == value


def test_a_client_certificate_is_accepted_and_its_absence_refused(secured):
    certs_url, _, d = secured
    _exercise(etcd_client(_with_cert(certs_url, d)))
    with pytest.raises(StoreUnreachable):  # the TLS handshake fails without one
        etcd_client(_settings(certs_url, d), timeout_s=0.5).get("deadpool/t")


def test_an_unknown_ca_never_reaches_etcd(secured):
    certs_url, _, d = secured
    system_ca = _with_cert(certs_url, d)
    system_ca = DeadpoolConfig(**{**system_ca.__dict__, "deadpool_etcd_cacert": None})
    with pytest.raises(StoreUnreachable, match="CERTIFICATE_VERIFY_FAILED"):
        etcd_client(system_ca, timeout_s=0.5).get("deadpool/t")


def test_a_user_works_and_its_token_is_renewed_when_it_expires(secured, monkeypatch):
    _, users_url, d = secured
    monkeypatch.setenv(ENV_ETCD_PASSWORD, PASSWORD)
    store = etcd_client(_settings(users_url, d, deadpool_etcd_user="root"))
    _exercise(store)
    first = store._token
    time.sleep(2.5)  # past the 1 s token lifetime: etcd answers 401, the client renews it
    assert store.get("deadpool/t") == b"v2"
    assert store._token != first
    assert store.add("deadpool/n", 2) == 2


def test_a_wrong_password_or_no_user_is_refused_by_name(secured, monkeypatch):
    _, users_url, d = secured
    monkeypatch.setenv(ENV_ETCD_PASSWORD, "wrong")
    with pytest.raises(DeadpoolError, match="refused user 'root'"):
        etcd_client(_settings(users_url, d, deadpool_etcd_user="root")).get("deadpool/t")
    with pytest.raises(DeadpoolError, match="rejected /v3/kv/range"):  # auth on, no user
        etcd_client(_settings(users_url, d)).get("deadpool/t")


def test_bad_security_options_are_named(tmp_path):
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    with pytest.raises(ConfigError, match="--deadpool-etcd-cacert='/nope' is not a file"):
        etcd_security("/nope", None, None, None, "https://h:2379")
    with pytest.raises(
        ConfigError, match="--deadpool-etcd-cert and --deadpool-etcd-key go together"
    ):
        etcd_security(None, str(cert), None, None, "https://h:2379")
    with pytest.raises(ConfigError, match="cert and --deadpool-etcd-user cannot be combined"):
        etcd_security(None, str(cert), str(cert), "root", "https://h:2379", environ={})
    with pytest.raises(ConfigError, match="need https:// endpoints"):
        etcd_security(str(cert), None, None, None, "http://h:2379")
    with pytest.raises(ConfigError, match=r"needs the password in \$DEADPOOL_ETCD_PASSWORD"):
        etcd_security(None, None, None, "root", "http://h:2379", environ={})
    s = etcd_security(None, None, None, "root", "http://h:2379", environ={ENV_ETCD_PASSWORD: "p"})
    assert (s.user, s.password, s.tls) == ("root", "p", False)
