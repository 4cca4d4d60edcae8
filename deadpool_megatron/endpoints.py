"""The form of --deadpool-etcd-endpoints and of etcd's TLS and auth options, checked where
flags are validated and where the etcd client connects (a module of its own so that neither
imports the other)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .errors import ConfigError


def parse_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    """``http://a:2379,http://b:2379`` (the --deadpool-etcd-endpoints form) -> URL list."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    urls = [e.strip().rstrip("/") for e in items if e.strip()]
    if not urls:
        raise ConfigError(f"--deadpool-etcd-endpoints={endpoints!r} names no endpoint")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"etcd endpoint {url!r} must be a URL such as http://127.0.0.1:2379")
    return urls


ENV_ETCD_PASSWORD = "DEADPOOL_ETCD_PASSWORD"


@dataclass(frozen=True)
class EtcdSecurity:
    """How the etcd client proves who it is and checks who it talks to: a CA bundle for
    https endpoints, a client certificate and key (etcd's --client-cert-auth), and an etcd
    user whose password comes from the environment (never a flag: flags show in `ps`)."""

    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None

    @property
    def tls(self) -> bool:
        return bool(self.cacert or self.cert)


def etcd_security(
    cacert: str | None,
    cert: str | None,
    key: str | None,
    user: str | None,
    endpoints: str | Sequence[str],
    environ: Mapping[str, str] | None = None,
) -> EtcdSecurity:
    """Checked options (ConfigError naming the flag and what would do)."""
    env = os.environ if environ is None else environ
    for flag, path in (("--deadpool-etcd-cacert", cacert), ("--deadpool-etcd-cert", cert),
                       ("--deadpool-etcd-key", key)):  # fmt: skip
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"{flag}={path!r} is not a file")
    if (cert is None) != (key is None):
        raise ConfigError(
            "--deadpool-etcd-cert and --deadpool-etcd-key go together (the client certificate "
            f"and its private key); got cert={cert!r}, key={key!r}"
        )
    if cert is not None and user is not None:
        raise ConfigError(
            "--deadpool-etcd-cert and --deadpool-etcd-user cannot be combined: etcd's HTTP "
            "gateway refuses a user's requests that carry a client certificate (with "
            "--client-cert-auth and auth enabled, the certificate's CN is the user); use one"
        )
    plain = [u for u in parse_endpoints(endpoints) if u.startswith("http://")]
    if (cacert or cert) and plain:
        raise ConfigError(
            f"etcd TLS options need https:// endpoints; {plain} would send everything in clear"
        )
    password = None
    if user is not None:
        password = env.get(ENV_ETCD_PASSWORD)
        if not password:
            raise ConfigError(
                f"--deadpool-etcd-user={user!r} needs the password in ${ENV_ETCD_PASSWORD}"
            )
    return EtcdSecurity(cacert, cert, key, user, password)
