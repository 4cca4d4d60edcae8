"""A rank's health check: is its device still computing correctly?

A process can be alive and heartbeating on a device that has gone bad (an ECC error, a
degraded GPU returning wrong numbers). The check runs a small fixed computation on the rank's
device and compares it bit for bit with the result it gave at start-up; a mismatch, a
non-finite value or a device error makes the rank unfit: the classifier calls it permanent
(resetting in place would fail again) and a spare replaces it.
"""

from __future__ import annotations

import threading

import torch

SIZE = 64


def _probe(device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(20261129)
    a = torch.rand(SIZE, SIZE, generator=g).to(device)
    b = torch.rand(SIZE, SIZE, generator=g).to(device)
    out = (a @ b).sum(dim=0)
    if device.type == "cuda":  # pragma: no cover (GPU)
        torch.cuda.synchronize(device)
    return out.cpu()


class HealthCheck:
    def __init__(self, device: torch.device):
        self.device = device
        self.expected = _probe(device)
        self.broken = False  # fault injection: unhealthy@RANK:ITER

    def break_device(self) -> None:
        """Fault injection (unhealthy@RANK:ITER): every later probe computes a wrong result."""
        self.broken = True

    def run(self) -> str | None:
        """None when healthy, else what is wrong (one line)."""
        try:
            got = _probe(self.device)
        except Exception as err:  # a device error is itself the finding
            return f"device {self.device} failed the probe: {type(err).__name__}: {err}"
        if self.broken:
            got = got.clone()
            got[0] = float("nan")
        if not torch.isfinite(got).all():
            return f"device {self.device} computed non-finite values in the probe"
        if not torch.equal(got, self.expected):
            return f"device {self.device} computed a different probe result than at start-up"
        return None


class HealthChecker(threading.Thread):
    """Runs `check` every `interval_s` seconds and calls `on_unfit(reason)` once, at the first
    failure (the launcher then fences the process and replaces it)."""

    def __init__(self, check: HealthCheck, interval_s: float, on_unfit):
        super().__init__(name="deadpool-health", daemon=True)
        self.check = check
        self.interval_s = interval_s
        self.on_unfit = on_unfit
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            reason = self.check.run()
            if reason is not None:
                self.on_unfit(reason)
                return

    def stop(self) -> None:
        self._stop_event.set()
