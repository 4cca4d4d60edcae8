"""Which errors are a rank's own (logged with their traceback), and when a recovery attempt
meets the one that started it again (the rank gives up instead of waiting out a timeout)."""

from __future__ import annotations

import pytest

from deadpool_megatron.failure.injector import InjectedFault
from deadpool_megatron.megatron.gloo_ops import AbortedByRecovery
from deadpool_megatron.recovery.exchange import RecoveryOrdered, Superseded
from deadpool_megatron.recovery.own_failure import OwnFailure, caused_here


@pytest.mark.parametrize(
    "err, own",
    [
        (AssertionError("Torch not compiled with CUDA enabled"), True),
        (RuntimeError("CUDA out of memory"), True),
        (RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:4"), False),
        (RuntimeError("Timed out waiting 30000ms for recv operation to complete"), False),
        (AbortedByRecovery("communication aborted: a recovery was ordered"), False),
        (RecoveryOrdered("generation 2"), False),
        (Superseded("generation 3 was ordered"), False),
        (InjectedFault("raise@1:4"), False),
    ],
)  # fmt: skip
def test_own_errors_are_told_from_what_a_failure_elsewhere_does_to_a_survivor(err, own):
    assert caused_here(err) is own


def test_an_attempt_that_fails_with_the_error_that_started_the_recovery_is_a_repeat():
    own = OwnFailure()
    assert own.interrupted(AssertionError("set CUDA_DEVICE_MAX_CONNECTIONS to 1"))
    assert own.repeated(AssertionError("set CUDA_DEVICE_MAX_CONNECTIONS to 1"))
    assert not own.repeated(AssertionError("another check"))  # a new error: wait for an order
    assert not own.repeated(ValueError("set CUDA_DEVICE_MAX_CONNECTIONS to 1"))


def test_a_recovery_started_by_a_failure_elsewhere_has_nothing_to_repeat():
    own = OwnFailure()
    own.interrupted(AssertionError("boom"))
    # the next recovery starts from a peer's loss: an attempt failing with the old error
    # then is not this recovery's cause coming back
    assert not own.interrupted(RuntimeError("Connection reset by peer"))
    assert not own.repeated(AssertionError("boom"))
    assert not OwnFailure().repeated(AssertionError("boom"))  # a spare: nothing started it
