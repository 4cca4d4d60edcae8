"""Break this process's pending collectives, so that every peer's collective fails at once.

gloo has no abort: `ProcessGroup.abort()` does not unblock a pending gloo collective, and
destroying the groups does not close their connections while anything still references them
(FIELD-NOTES, and measured again here: after a transient failure, peers stayed blocked in a
DP reduce-scatter). Shutting down the TCP connections the groups opened does: gloo's pair sees
end-of-file, the local collective raises, and so does every peer's on the other end
("Connection closed by peer") within milliseconds; gloo then closes the descriptors itself.
Peers that were blocked abort their own connections in turn, so the stop spreads along every
communication edge, and the launcher's recovery order reaches whoever is not blocked.

Every TCP connection of the process is cut except the control plane's (the store, etcd, by
port) and listeners: a pending operation may wait on any group's connection, and the groups are
all rebuilt anyway. NCCL communicators are aborted through torch's `ProcessGroup.abort()`
(public since torch 2.6), each group on its own, and a group that fails to abort is logged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket

import torch.distributed as dist

from ..megatron import gloo_ops
from ..megatron.groups import live_groups

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


def abort_groups(groups: list, backend: str) -> list[str]:
    """`abort()` every group of `backend` (its pending collectives fail, its communicator is
    freed); returns the errors, each logged with the group it concerns."""
    errors = []
    for group in groups:
        try:
            if dist.get_backend(group) != backend:
                continue
            if hasattr(group, "abort"):
                group.abort()
            else:  # torch before ProcessGroup.abort() was public
                dist.distributed_c10d._abort_process_group(group)
        except Exception as err:  # one group failing to abort must not stop the others
            name = group.group_name if hasattr(group, "group_name") else repr(group)
            errors.append(f"{name}: {type(err).__name__}: {err}")
            log.error("could not abort %s group %s: %s: %s", backend, name,
                      type(err).__name__, err)  # fmt: skip
    return errors


class CommunicatorAbort:
    """Cut every connection of this process's process groups (all of them: whichever group a
    pending operation waits on), never the control plane's."""

    def __init__(self, control_ports: set[int] | None = None):
        self.control_ports = set(control_ports or ())

    def rearm(self) -> None:
        """New groups are about to be built: their operations wait normally again."""
        gloo_ops.reset()

    def abort(self) -> int:
        """Make every pending collective of this process, and its peers', fail now.

        Safe from any thread, idempotent; returns the number of connections shut down.
        """
        gloo_ops.abort_pending()  # operations gloo would not wake
        if dist.is_initialized() and dist.get_backend() == "nccl":  # pragma: no cover (GPU)
            abort_groups(live_groups(), "nccl")
        n = 0
        for fd in _sockets():
            try:
                sock = socket.socket(fileno=fd)
            except OSError:
                continue  # closed in the meantime
            try:
                if sock.type != socket.SOCK_STREAM or sock.family not in (
                    socket.AF_INET,
                    socket.AF_INET6,
                ):
                    continue
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue  # a listener: nothing waits on it
                ports = {sock.getsockname()[1]}
                with contextlib.suppress(OSError):
                    ports.add(sock.getpeername()[1])
                if ports & self.control_ports:
                    continue  # the store, etcd: the recovery needs them
                sock.shutdown(socket.SHUT_RDWR)
                n += 1
            except OSError:
                pass  # not connected (any more): nothing to break
            finally:
                sock.detach()  # gloo owns the descriptor and closes it
        if n:
            log.info("aborted communicators: shut down %d connection(s)", n)
        return n
