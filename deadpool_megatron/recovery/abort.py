"""Break this process's pending collectives, so that every peer's collective fails at once.

gloo has no abort: `ProcessGroup.abort()` does not unblock a pending gloo collective, and
destroying the groups does not close their connections while anything still references them
(FIELD-NOTES, and measured again here: after a transient failure, peers stayed blocked in a
DP reduce-scatter). Shutting down the TCP connections the groups opened does: gloo's pair sees
end-of-file, the local collective raises, and so does every peer's on the other end
("Connection closed by peer") within milliseconds; gloo then closes the descriptors itself.
Peers that were blocked abort their own connections in turn, so the stop spreads along every
communication edge, and the launcher's recovery order reaches whoever is not blocked.

The connections are the socket descriptors created while one generation's groups were built
(`record`). Each is checked to still be the same socket (inode) before it is shut down, and a
connection to the control plane (the store, etcd) is never touched. On NCCL, the groups are
aborted through torch instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator

import torch.distributed as dist

from ..megatron import gloo_p2p

log = logging.getLogger("deadpool.recovery")


def _sockets() -> dict[int, str]:
    """This process's socket descriptors: fd -> 'socket:[inode]'."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{name}")
            if target.startswith("socket:"):
                out[int(name)] = target
    return out


class CommunicatorAbort:
    """The connections of the current generation's process groups, and how to cut them."""

    def __init__(self, control_ports: set[int] | None = None):
        self.control_ports = set(control_ports or ())
        self._owned: dict[int, str] = {}
        self._lock = threading.Lock()
        self.aborted = 0  # connections shut down by the last abort()

    @contextlib.contextmanager
    def record(self) -> Iterator[None]:
        """Every socket created inside this block belongs to the generation's groups."""
        before = _sockets()
        gloo_p2p.reset()
        try:
            yield
        finally:
            created = {fd: ino for fd, ino in _sockets().items() if before.get(fd) != ino}
            with self._lock:
                self._owned.update(created)

    def forget(self) -> None:
        """The groups are gone (destroyed, or aborted and replaced)."""
        with self._lock:
            self._owned.clear()

    def abort(self) -> int:
        """Make every pending collective of this process, and its peers', fail now.

        Safe from any thread, idempotent; returns the number of connections shut down.
        """
        gloo_p2p.abort_pending()  # pipeline sends gloo would not wake
        if dist.is_initialized() and dist.get_backend() == "nccl":  # pragma: no cover (GPU)
            with contextlib.suppress(Exception):
                dist.distributed_c10d._abort_process_group()
        with self._lock:
            owned, self._owned = self._owned, {}
        current = _sockets()
        n = 0
        for fd, inode in owned.items():
            if current.get(fd) != inode:
                continue  # gloo closed it already (and the number may have been reused)
            try:
                sock = socket.socket(fileno=fd)
            except OSError:
                continue  # closed by gloo in the meantime
            try:
                if sock.type != socket.SOCK_STREAM or sock.family not in (
                    socket.AF_INET,
                    socket.AF_INET6,
                ):
                    continue
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue  # gloo's listener: nothing waits on it
                with contextlib.suppress(OSError):
                    if sock.getpeername()[1] in self.control_ports:
                        continue
                sock.shutdown(socket.SHUT_RDWR)
                n += 1
            except OSError:
                pass  # not connected (any more): nothing to break
            finally:
                sock.detach()  # gloo owns the descriptor and closes it
        self.aborted = n
        if n:
            log.info("aborted communicators: shut down %d connection(s)", n)
        return n
