"""--exit-signal-handler's handler: the signal is noted, the process goes on."""

import os
import signal
import time

import pytest

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
