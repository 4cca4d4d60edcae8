"""--exit-signal-handler's handler: the signal is noted, the process goes on."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from reentry import interrupt_at_every_opcode

from deadpool_megatron.config import JobConfig
from deadpool_megatron.megatron.arguments import parse_job_args
from deadpool_megatron.process.exit_signal import ExitSignal

pytestmark = pytest.mark.timeout(60)


def test_sigterm_is_noted_not_obeyed_and_the_previous_handler_comes_back():
    before = signal.getsignal(signal.SIGTERM)
    noted = ExitSignal()
    try:
        assert not noted()
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not noted() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert noted()  # and this process is still here
    finally:
        noted.restore()
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_handler_entered_again_at_any_point_of_itself_returns():
    # Python runs a handler between any two bytecodes of the main thread, the handler's own
    # included: a second signal (Slurm's SIGTERM, then the agent's) enters it again wherever
    # the first call is. Simulated here at every opcode of the first call, and of what it
    # calls: each nested call must return (a lock held by the outer call would never be free).
    noted = ExitSignal.__new__(ExitSignal)  # the handler alone: none installed
    noted.signum, noted._received = signal.SIGTERM, False
    nested = []

    def run():
        nested.append(
            interrupt_at_every_opcode(
                lambda: noted._note(signal.SIGTERM, None),
                lambda: noted._note(signal.SIGTERM, None),
            )
        )

    handler = threading.Thread(target=run, daemon=True)
    handler.start()
    handler.join(5)
    assert not handler.is_alive(), "a nested call waits for the call it interrupted"
    assert nested[0] >= 2 and noted()


CHILD = """
import sys, time
from deadpool_megatron.process.exit_signal import ExitSignal
noted = ExitSignal()
print("ready", flush=True)
sys.stdin.readline()  # the signals have been sent
print("noted" if noted() else "not noted", flush=True)
"""


def test_signals_two_at_a_time_never_stop_the_process():
    # What a worker of a Slurm step gets: SIGTERM from slurmstepd and the agent's forwarded
    # SIGTERM at once. Pairs of signals, back to back, for 2 s, into 4 processes: each must
    # answer afterwards (with a handler that set a threading.Event, half of them hung).
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )  # fmt: skip
        for _ in range(4)
    ]
    try:
        for child in children:
            assert child.stdout.readline().strip() == "ready"
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            for child in children:
                os.kill(child.pid, signal.SIGTERM)
                os.kill(child.pid, signal.SIGTERM)
            time.sleep(0.001)
        answers = []
        for child in children:
            out, _ = child.communicate("go\n", timeout=20)
            answers.append((out.strip(), child.returncode))
        assert answers == [("noted", 0)] * 4
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_the_flag_is_off_unless_given():
    assert JobConfig().training.exit_signal_handler is False
    cfg = parse_job_args(["--exit-signal-handler"], world_size=1)
    assert cfg.training.exit_signal_handler is True


@pytest.mark.parametrize("flag", [True, False])
def test_the_process_entry_installs_the_handler_before_training_and_hands_it_over(
    flag, monkeypatch
):
    # Installed before the set-up starts (a Slurm notice that comes during it is noted, not a
    # death), and the same handler the trainer asks: without the flag, none.
    from deadpool_megatron.process.entry import run_process

    monkeypatch.setattr("deadpool_megatron.process.entry.setup_logging", lambda prefix: None)
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "DEADPOOL_ROLE", "DEADPOOL_PREFLIGHT"):
        monkeypatch.delenv(name, raising=False)
    before = signal.getsignal(signal.SIGTERM)
    seen = {}

    def train(cfg, env, exit_signal) -> int:
        seen["handler"] = signal.getsignal(signal.SIGTERM)
        seen["exit_signal"] = exit_signal
        if exit_signal is not None:
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 5
            while not exit_signal() and time.monotonic() < deadline:
                time.sleep(0.01)
            seen["noted"] = exit_signal()
            exit_signal.restore()
        return 7

    argv = ["--exit-signal-handler"] if flag else []
    try:
        assert run_process(lambda env: parse_job_args(argv, env.world_size), train) == 7
    finally:
        signal.signal(signal.SIGTERM, before)
    if flag:
        assert isinstance(seen["exit_signal"], ExitSignal)
        assert seen["handler"] == seen["exit_signal"]._note
        assert seen["noted"]
    else:
        assert seen["exit_signal"] is None and seen["handler"] is before
