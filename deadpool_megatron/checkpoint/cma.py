"""Cross-memory attach: read another process's memory with one copy (`process_vm_readv`).

Replicas between two ranks on one host otherwise cross the kernel twice (the sender's
`send` copies into socket buffers, the receiver's `recv` copies out), each copy a CPU cost
on cores that train. Open MPI's shared-memory transport moves large messages the same way
(its "cma" single-copy mechanism). Linux only; the kernel allows it between processes of one
user unless a security module (Yama's ptrace_scope, a seccomp profile) forbids it, which the
ring's probe finds out (tcp_connections.negotiate_pull) before any payload depends on it.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import sys


class PullRefused(OSError):
    """The kernel will not read that memory for us (not permitted, not a plain mapping, no
    such call here): the bytes have to come another way."""


class PeerGone(ConnectionError):
    """The process to read from no longer exists."""


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    call = getattr(libc, "process_vm_readv", None)
    if call is None:
        return None
    iov = ctypes.POINTER(_IoVec)
    call.argtypes = [ctypes.c_int, iov, ctypes.c_ulong, iov, ctypes.c_ulong, ctypes.c_ulong]
    call.restype = ctypes.c_ssize_t
    return call


_process_vm_readv = _load()
_REFUSED = {errno.EPERM, errno.EFAULT, errno.ENOSYS, errno.EINVAL, errno.EACCES}


def read_from(pid: int, address: int, into: memoryview) -> None:
    """Copy `len(into)` bytes at `address` in process `pid` into `into` (writable, contiguous).
    Raises PeerGone when the process has exited, PullRefused when the kernel refuses."""
    if _process_vm_readv is None:
        raise PullRefused(errno.ENOSYS, "process_vm_readv is not available here")
    n = len(into)
    if not n:
        return
    base = ctypes.addressof(ctypes.c_char.from_buffer(into))
    done = 0
    while done < n:  # the kernel may copy less than asked (a partial read)
        local = _IoVec(base + done, n - done)
        remote = _IoVec(address + done, n - done)
        got = _process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got < 0:
            code = ctypes.get_errno()
            if code == errno.EINTR:
                continue
            if code == errno.ESRCH:
                raise PeerGone(f"process {pid} has exited")
            if code in _REFUSED:
                raise PullRefused(code, f"reading process {pid}: {os.strerror(code)}")
            raise OSError(code, f"reading process {pid}: {os.strerror(code)}")
        if got == 0:
            raise PullRefused(errno.EFAULT, f"reading process {pid}: nothing at {address:#x}")
        done += got


def host_id() -> int:
    """This machine's running kernel, as a number (a hash of its boot id; 0 where there is
    none): two processes can read each other's memory only if theirs are equal."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as fh:
            boot = fh.read().strip()
    except OSError:
        return 0
    return int.from_bytes(hashlib.sha256(boot).digest()[:8], "little") if boot else 0
