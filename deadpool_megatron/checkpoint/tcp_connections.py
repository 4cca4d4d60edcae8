"""A generation's replica ring over TCP set up (`--deadpool-transport tcp`): the address each
rank listens on, its connections to its ring successors and from its predecessors, and which
edges move large messages by the receiver's own read of the sender's memory. tcp_transport.py
drives the connections afterwards.

Set-up (`connect_ring`): each rank listens on a fresh port, the addresses are exchanged by
the caller (a collective over the ring's members), every rank connects to its successors
and then accepts its predecessors; a connection opens with a hello naming its two ends and
the generation, and one that does not name this rank's expected predecessor in this
generation is refused.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import ipaddress
import logging
import os
import socket
import struct
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from . import cma

log = logging.getLogger("deadpool.replicate")

HELLO = struct.Struct("<8sqqq")  # magic, sender's rank, receiver's rank, generation
MAGIC = b"DPREPL01"
HELLO_TIMEOUT_S = 5.0
PROBE = struct.Struct("<8sqQ16s")  # magic, sender's pid (0: no offer), address of the token, token
PROBE_MAGIC = b"DPPULL01"


@dataclass(frozen=True)
class Address:
    host: str
    port: int


def listen(host: str) -> socket.socket:
    """A listening socket on a fresh port of `host` (the interface peers reach this rank on)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(64)
    return sock


def reachable_host(master_addr: str) -> str:
    """This machine's address on the interface that routes to `master_addr` (the job's
    MASTER_ADDR, on the cluster network): a UDP socket's connect chooses it without sending
    anything. On the master's own node, where MASTER_ADDR is the node's name and /etc/hosts
    maps that to a loopback address (Debian's 127.0.1.1), peers on other nodes could not reach
    that: the address the default route leaves from is taken instead (if there is one)."""
    addr = _route_to(master_addr)
    if ipaddress.ip_address(addr).is_loopback and not _names_loopback(master_addr):
        with contextlib.suppress(OSError):
            return _route_to(OUTSIDE)
    return addr


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name` (as GLOO_SOCKET_IFNAME names one); a
    ValueError naming it if it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            ifreq = fcntl.ioctl(
                probe.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode())
            )
        except OSError as err:
            raise ValueError(f"network interface {name!r} has no IPv4 address here ({err}); "
                             f"GLOO_SOCKET_IFNAME names the interface ranks reach each other on") from None  # fmt: skip
    return socket.inet_ntoa(ifreq[20:24])


SIOCGIFADDR = 0x8915  # linux/sockios.h
OUTSIDE = "198.18.0.1"  # RFC 2544's benchmarking range: routed by the default route, never sent to


def _route_to(host: str) -> str:
    info = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)[0]
    with socket.socket(info[0], socket.SOCK_DGRAM) as probe:
        probe.connect(info[4])
        return probe.getsockname()[0]


def _names_loopback(host: str) -> bool:
    """`localhost`, or a loopback address written out: a job on one machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name


def connect_ring(
    me: int,
    generation: int,
    listener: socket.socket,
    successors: Mapping[int, Address],
    predecessors: Iterable[int],
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[dict[int, socket.socket], dict[int, socket.socket]]:
    """Connect to every successor, then accept every predecessor (connections complete in the
    listener's backlog, so no rank waits for another's accept: no cycle). Returns the
    connections to send on and to receive on, by peer; closes the listener."""
    send_to: dict[int, socket.socket] = {}
    recv_from: dict[int, socket.socket] = {}
    try:
        for dst, addr in successors.items():
            sock = socket.create_connection((addr.host, addr.port), timeout=timeout_s)
            send_to[dst] = sock
            sock.sendall(HELLO.pack(MAGIC, me, dst, generation))
        expected = set(predecessors)
        deadline = clock() + timeout_s
        while expected - set(recv_from):
            left = deadline - clock()
            try:
                if left <= 0:
                    raise TimeoutError
                listener.settimeout(left)
                sock, peer = listener.accept()
            except TimeoutError:
                raise TimeoutError(
                    f"rank {me}: no replica connection from rank(s) "
                    f"{sorted(expected - set(recv_from))} within {timeout_s:g} s"
                ) from None
            # A peer sends its hello as it connects: one that does not is not a peer, and
            # must not hold the accept of the one behind it until the deadline.
            sock.settimeout(max(min(deadline - clock(), HELLO_TIMEOUT_S), 0.001))
            try:
                magic, src, dst, gen = HELLO.unpack(_read_exactly(sock, HELLO.size))
            except (OSError, ConnectionError) as err:
                sock.close()
                log.warning("refused a replica connection from %s: %s", peer, err)
                continue
            if (
                magic != MAGIC
                or dst != me
                or gen != generation
                or src not in expected - set(recv_from)
            ):
                sock.close()
                log.warning("refused a replica connection from %s: it names rank %d -> %d of "
                            "generation %d; expected one of %s -> %d of generation %d", peer, src,
                            dst, gen, sorted(expected - set(recv_from)), me, generation)  # fmt: skip
                continue
            recv_from[src] = sock
    except BaseException:
        for sock in [*send_to.values(), *recv_from.values()]:
            sock.close()
        raise
    finally:
        listener.close()
    log.info("replica ring of generation %d over tcp: sending to rank(s) %s, receiving from %s",
             generation, sorted(send_to), sorted(recv_from))  # fmt: skip
    return send_to, recv_from


def _read_exactly(sock: socket.socket, n: int, before: str = "its hello") -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed before {before}")
        data += chunk
    return data


def negotiate_pull(
    send_to: Mapping[int, socket.socket],
    recv_from: Mapping[int, socket.socket],
    timeout_s: float,
    offer: bool = True,
) -> tuple[set[int], dict[int, int]]:
    """Which edges move large messages by the receiver's own read of the sender's memory.

    Every sender offers its pid and the address of a random token (pid 0 with `offer` off);
    every receiver tries to read the token there and answers whether it got it: on another
    host, in another PID namespace, or where the kernel forbids it, it does not. Each rank
    sends its probes before it waits for any, and answers before it reads answers: no cycle.
    Returns the successors that will read from this rank, and the pid of every predecessor
    this rank reads from."""
    token = os.urandom(16)
    probe = ctypes.create_string_buffer(token, len(token))
    pulled_by: set[int] = set()
    pull_from: dict[int, int] = {}
    refused: dict[int, str] = {}
    for sock in [*send_to.values(), *recv_from.values()]:
        sock.settimeout(timeout_s)
    for sock in send_to.values():
        sock.sendall(PROBE.pack(PROBE_MAGIC, os.getpid() if offer else 0,
                                ctypes.addressof(probe), token))  # fmt: skip
    for src, sock in recv_from.items():
        magic, pid, address, expected = PROBE.unpack(_read_exactly(sock, PROBE.size, "its probe"))
        if magic != PROBE_MAGIC:
            raise ConnectionError(f"rank {src} sent no probe: the two ends run different versions")
        got = bytearray(len(expected))
        if pid and offer:
            try:
                cma.read_from(pid, address, memoryview(got))
            except OSError as err:  # refused, or a namesake process of another namespace gone
                refused[src] = str(err)
            else:
                if bytes(got) != expected:
                    refused[src] = "its pid names another process here (another host?)"
        ok = bool(pid and offer) and src not in refused
        sock.sendall(b"\x01" if ok else b"\x00")
        if ok:
            pull_from[src] = pid
    for dst, sock in send_to.items():
        if _read_exactly(sock, 1, "its answer to the probe") == b"\x01":
            pulled_by.add(dst)
    del probe  # read by the receivers until here
    for src, why in refused.items():
        log.info("replicas from rank %d are streamed: reading its memory failed (%s)", src, why)
    if pull_from:
        log.info("replicas from rank(s) %s are read from their memory (one copy)",
                 sorted(pull_from))  # fmt: skip
    return pulled_by, pull_from
