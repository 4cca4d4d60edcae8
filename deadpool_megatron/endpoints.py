"""The form of --deadpool-etcd-endpoints, checked where flags are validated and where the etcd
client connects (a module of its own so that neither imports the other)."""

from __future__ import annotations

from collections.abc import Sequence

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
