"""Start a real zygote (deadpool_megatron/agent/zygote.py) for a test and stop it after."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from deadpool_megatron.agent.zygote import listening

READY_S = 300.0  # its imports, on a machine whose cores another test may be using


@contextlib.contextmanager
def running_zygote(
    preload: str | None = None, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen, Path]]:
    """The zygote's process and socket, once it listens (its imports done)."""
    folder = Path(tempfile.mkdtemp(prefix="deadpool-zygote-"))  # short: a socket's path
    path, log = folder / "zygote.sock", folder / "zygote.log"  # has at most 107 bytes
    cmd = [sys.executable, "-m", "deadpool_megatron.agent.zygote", "--socket", str(path)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*cmd, *(["--preload", preload] if preload is not None else [])],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + READY_S
        while not listening(str(path)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the zygote did not start (rc {proc.poll()}):\n"
                                   f"{log.read_text(errors='replace')[-3000:]}")  # fmt: skip
            time.sleep(0.05)
        yield proc, path
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)
