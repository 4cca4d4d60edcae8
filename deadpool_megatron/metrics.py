"""Megatron-style iteration lines and the per-iteration metrics file.

The metrics file is the witness every failure test compares against: losses as exact hex
floats per iteration, and a final state digest. It is appended to, so an iteration a recovery
replays has one line per execution: the replay can be compared with the original.
"""

from __future__ import annotations

import json
import logging
import os
import time

log = logging.getLogger("deadpool.train")


def iteration_line(
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    iteration_ms: float,
    lr: float,
    global_batch_size: int,
    loss: float,
    tokens_per_s: float,
) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return (
        f" [{stamp}] iteration {iteration:8d}/{train_iters:8d} | consumed samples: "
        f"{consumed_samples:12d} | elapsed time per iteration (ms): {iteration_ms:.1f} | "
        f"learning rate: {lr:.6E} | global batch size: {global_batch_size:5d} | "
        f"lm loss: {loss:.6E} | tokens/s: {tokens_per_s:.0f} |"
    )


class MetricsWriter:
    """Appends JSON lines; flushed per line so a killed job leaves every finished iteration."""

    def __init__(self, path: str | None):
        self._fh = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._fh = open(path, "a", buffering=1)  # noqa: SIM115 (lives as long as the job)

    def iteration(self, iteration: int, loss: float, iteration_ms: float) -> None:
        self._write(
            {
                "iteration": iteration,
                "lm_loss": loss,
                "lm_loss_hex": float.hex(loss),
                "iteration_ms": round(iteration_ms, 3),
                "time": time.time(),  # when it finished (benchmarks measure time lost from it)
            }
        )

    def final(self, iteration: int, state_digest: str | None) -> None:
        self._write({"event": "final", "iteration": iteration, "state_digest": state_digest})

    def _write(self, record: dict) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_metrics(path: str) -> tuple[dict[int, str], dict | None]:
    """(iteration -> loss hex, final record) from a metrics file; later lines win on replay."""
    runs, final = _read(path)
    return {iteration: losses[-1] for iteration, losses in runs.items()}, final


def read_executions(path: str) -> dict[int, list[str]]:
    """iteration -> the loss hex of every execution, in the order they ran (a replayed
    iteration has more than one)."""
    return _read(path)[0]


def every_execution_equal(runs: dict[int, list[str]], baseline: dict[int, str]) -> bool:
    """The same iterations as the failure-free run, and every execution of each (replays
    included) with its loss, bit for bit."""
    return set(runs) == set(baseline) and all(set(r) == {baseline[i]} for i, r in runs.items())


def _read(path: str) -> tuple[dict[int, list[str]], dict | None]:
    runs: dict[int, list[str]] = {}
    final = None
    with open(path) as fh:
        for line in fh:
            record = json.loads(line)
            if record.get("event") == "final":
                final = record
            elif "iteration" in record:
                runs.setdefault(record["iteration"], []).append(record["lm_loss_hex"])
    return runs, final
