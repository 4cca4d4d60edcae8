"""A real etcd server for tests: Debian's etcd-server, installed with apt-get when missing,
started on free loopback ports in a temporary data dir and stopped by pid."""

import os
import shutil
import socket
import subprocess

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def etcd_binary() -> str:
    found = shutil.which("etcd")
    if found:
        return found
    if shutil.which("apt-get") is None:
        pytest.skip("etcd is not on PATH and apt-get is not available to install etcd-server")
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    if sudo and shutil.which("sudo") is None:
        pytest.skip("etcd is not on PATH and installing etcd-server needs root (no sudo)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = [*sudo, "apt-get", "install", "-y", "etcd-server"]
    done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        subprocess.run([*sudo, "apt-get", "update"], env=env, capture_output=True, timeout=600)
        done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
    found = shutil.which("etcd")
    if found is None:
        pytest.skip(f"`apt-get install -y etcd-server` failed: {(done.stderr or '')[-500:]}")
    return found
