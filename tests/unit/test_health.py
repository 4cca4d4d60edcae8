"""The device health check: the same probe result as at start-up, or the rank is unfit."""

import threading

import torch

from deadpool_megatron.failure.health import HealthCheck, HealthChecker


def test_a_healthy_device_passes_and_a_broken_one_is_named():
    check = HealthCheck(torch.device("cpu"))
    assert check.run() is None
    check.broken = True
    assert check.run() == "device cpu computed non-finite values in the probe"


def test_a_different_result_than_at_start_up_fails():
    check = HealthCheck(torch.device("cpu"))
    check.expected = check.expected + 1
    assert "different probe result" in check.run()


def test_the_checker_reports_the_first_failure_once():
    check = HealthCheck(torch.device("cpu"))
    check.broken = True
    reasons, done = [], threading.Event()

    def unfit(reason):
        reasons.append(reason)
        done.set()

    checker = HealthChecker(check, 0.01, unfit)
    checker.start()
    assert done.wait(10)
    checker.join(5)
    assert not checker.is_alive() and len(reasons) == 1
