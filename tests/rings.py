"""A DP ring of tcp replica transports inside one test process, each rank's set-up on a thread
of its own (as each rank's training thread sets its ring up), for the transport's tests."""

from __future__ import annotations

import threading

from deadpool_megatron.checkpoint.tcp_connections import (
    Address,
    connect_ring,
    listen,
    negotiate_pull,
)
from deadpool_megatron.checkpoint.tcp_transport import (
    TcpTransport,
)


def tcp_ring(
    n: int, generation: int = 3, timeout_s: float = 10.0, pull: bool | None = None
) -> list[TcpTransport]:
    """`n` ranks, each sending to its successor. `pull`: None sets the ring up without the
    probe (every byte streams), else the probe runs with the offer on or off."""
    listeners = [listen("127.0.0.1") for _ in range(n)]
    addresses = {r: Address("127.0.0.1", lst.getsockname()[1]) for r, lst in enumerate(listeners)}
    out: dict[int, TcpTransport] = {}

    def rank(r: int) -> None:
        succ, pred = (r + 1) % n, (r - 1) % n
        send_to, recv_from = connect_ring(r, generation, listeners[r], {succ: addresses[succ]},
                                          [pred], timeout_s)  # fmt: skip
        pulled_by, pull_from = (
            (set(), {}) if pull is None else negotiate_pull(send_to, recv_from, timeout_s, pull)
        )
        out[r] = TcpTransport(send_to, recv_from, timeout_s, pulled_by=pulled_by,
                              pull_from=pull_from)  # fmt: skip

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if sorted(out) != list(range(n)):
        raise RuntimeError(f"only ranks {sorted(out)} of {n} set their ring up")
    return [out[r] for r in range(n)]
