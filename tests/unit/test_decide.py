"""What the agent does about each kind of classified failure, as a table."""

import pytest

from deadpool_megatron.agent.decide import Action, Response, respond
from deadpool_megatron.failure.classify import Classification, Decision
from deadpool_megatron.failure.evidence import (
    HealthCheckFailed,
    HeartbeatStale,
    InjectedTransient,
    ProcessExited,
)

EXITED = Classification(1, Decision.PERMANENT, "exited", ProcessExited(1, -9, 0.0))
REFUSED = Classification(1, Decision.PERMANENT, "exited 2", ProcessExited(1, 2, 0.0))
HUNG = Classification(1, Decision.PERMANENT, "hung", HeartbeatStale(1, 0.0, 3.0, "stopped"))
UNFIT = Classification(1, Decision.PERMANENT, "unfit", HealthCheckFailed(1, "nan", 0.0))
TRANSIENT = Classification(1, Decision.TRANSIENT, "raised", InjectedTransient(1, 0.0))


@pytest.mark.parametrize(
    "c, policy, protected, up, expected",
    [
        # checkpoint-restart stops every process, whatever failed
        (EXITED, "full", True, True, Response(Action.RESTART, False, False)),
        (HUNG, "full", False, False, Response(Action.RESTART, False, False)),
        # no protection: the job ends; a live hung process is fenced first; not up yet: the
        # failure waits for every rank to register (a hung process fenced first)
        (EXITED, "hotswap", False, True, Response(Action.END, False, False)),
        (HUNG, "hotswap", False, True, Response(Action.END, True, False)),
        (HUNG, "hotswap", True, False, Response(Action.WAIT, True, False)),
        (TRANSIENT, "hotswap", False, True, Response(Action.END, False, False)),
        # protected: hot-swap; an exited rank is replaced, a live permanent one fenced first
        (EXITED, "hotswap", True, True, Response(Action.HOTSWAP, False, True)),
        (HUNG, "hotswap", True, True, Response(Action.HOTSWAP, True, True)),
        (UNFIT, "hotswap", True, True, Response(Action.HOTSWAP, True, True)),
        # a rank that refused its input (status 2) ends the job: a spare or a restart would
        # be given the same input
        (REFUSED, "hotswap", True, True, Response(Action.END, False, False)),
        (REFUSED, "full", True, True, Response(Action.END, False, False)),
        (REFUSED, "hotswap", False, False, Response(Action.END, False, False)),
        # a transient failure resets in place: no fence, no spare
        (TRANSIENT, "hotswap", True, True, Response(Action.HOTSWAP, False, False)),
    ],
)
def test_response_to_each_classification(c, policy, protected, up, expected):
    assert respond(c, policy, protected, up) == expected


RELAUNCH = Response(Action.RELAUNCH, False, False)
END = Response(Action.END, False, False)
WAIT = Response(Action.WAIT, False, False)


@pytest.mark.parametrize(
    "c, policy, protected, registered, relaunched, expected",
    [
        # died before it registered, first time: its seat starts again
        (EXITED, "hotswap", True, False, False, RELAUNCH),
        # twice: not bad luck; unprotected: nothing registers
        (EXITED, "hotswap", True, False, True, END),
        (EXITED, "hotswap", False, False, False, END),
        # registered: its peers may have met it; the failure waits for generation 0
        (EXITED, "hotswap", True, True, False, WAIT),
        (EXITED, "hotswap", True, True, True, WAIT),
        (TRANSIENT, "hotswap", True, True, False, WAIT),
        # a live hung process is fenced first (its exit is looked at next)
        (HUNG, "hotswap", True, True, False, Response(Action.WAIT, True, False)),
        # a refused input ends the job
        (REFUSED, "hotswap", True, False, False, END),
        # checkpoint-restart restarts every process, as for any failure
        (EXITED, "full", True, False, False, Response(Action.RESTART, False, False)),
    ],
)
def test_response_before_the_job_is_up(c, policy, protected, registered, relaunched, expected):
    assert respond(c, policy, protected, False, registered, relaunched) == expected


def test_once_up_the_registration_no_longer_matters():
    assert respond(EXITED, "hotswap", True, True, False, False).action is Action.HOTSWAP


def test_an_error_the_replay_met_again_ends_the_job_whatever_else():
    from deadpool_megatron.failure.evidence import CollectiveError

    repeated = Classification(1, Decision.REPEATED, "the same error",
                              CollectiveError(1, "RuntimeError: bug", 0.0, where=(5, "forward")))  # fmt: skip
    for policy in ("hotswap", "full"):
        assert respond(repeated, policy, True, True) == Response(Action.END, False, False)


def test_why_the_job_ends_names_the_rank_its_process_and_the_status():
    from deadpool_megatron.agent.decide import why_it_ends
    from deadpool_megatron.errors import BAD_INPUT_EXIT

    line, reason, status = why_it_ends(EXITED, 4242)
    assert line == "worker rank 1 (pid 4242) was killed by signal SIGKILL; ending the job"
    assert (reason, status) == ("failure of rank 1", 1)
    line, reason, status = why_it_ends(REFUSED, 4242)
    assert "it refused its input" in line and status == BAD_INPUT_EXIT
    assert why_it_ends(TRANSIENT, 4242)[0].endswith("has no --deadpool protection; ending it")
    repeated = Classification(1, Decision.REPEATED, "the same error as 2 time(s) before",
                              InjectedTransient(1, 0.0))  # fmt: skip
    line, reason, status = why_it_ends(repeated, 4242)
    assert line.startswith("the same error as 2 time(s) before; ending the job (the traceback")
    assert (reason, status) == ("rank 1 failed the same way again", 1)


def test_a_recovery_that_fails_the_same_way_restarts_from_the_checkpoint_if_told_to():
    # An error of the recovery itself (its place is phase recovery): a spare meets it again,
    # a restart from the persistent checkpoint runs no recovery. Falls back only when the
    # job says so (--deadpool-on-unrecoverable checkpoint-restart); a repeated training
    # error ends the job either way.
    from deadpool_megatron.agent.decide import why_it_ends
    from deadpool_megatron.failure.evidence import CollectiveError

    bug = CollectiveError(1, "InjectedBug: bug", 0.0, where=(5, "recovery"))
    in_recovery = Classification(1, Decision.REPEATED, "the same error", ProcessExited(1, 1, 0.1),
                                 bug)  # fmt: skip
    restart = Response(Action.RESTART, False, False)
    assert respond(in_recovery, "hotswap", True, True, falls_back=True) == restart
    assert respond(in_recovery, "hotswap", True, True) == END
    line, _, _ = why_it_ends(in_recovery, 4242)
    assert line.endswith("a spare would meet it again; a restart from the checkpoint would not "
                         "(--deadpool-on-unrecoverable checkpoint-restart)")  # fmt: skip
    in_training = Classification(1, Decision.REPEATED, "the same error",
                                 CollectiveError(1, "bug", 0.0, where=(5, "forward")))  # fmt: skip
    assert respond(in_training, "hotswap", True, True, falls_back=True) == END
    assert why_it_ends(in_training, 4242)[0].endswith("a spare or a restart would meet it again")
