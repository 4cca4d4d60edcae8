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
