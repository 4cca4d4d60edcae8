"""What the agent does about a classified failure: a pure table, tested alone."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..errors import BAD_INPUT_EXIT
from ..failure.classify import Classification, Decision, in_recovery
from ..failure.evidence import ProcessExited, describe_exit


class Action(enum.Enum):
    END = "end"  # log it and end the job (no protection, or a refused input)
    RESTART = "restart"  # checkpoint-restart: stop everything, start again from --save
    HOTSWAP = "hotswap"  # recover in place: a spare takes the rank, or it resets itself
    # start the rank's process again in its own seat: it died before it registered, so no
    # peer has met it yet and generation 0 can still be formed with the new process
    RELAUNCH = "relaunch"
    # hold the failure until every rank has registered (generation 0 is recorded), then
    # hot-swap it: a registered rank's peers may have met it in their rendezvous
    WAIT = "wait"


@dataclass(frozen=True)
class Response:
    action: Action
    fence: bool  # kill the failed process first: it is alive but hung or unfit
    replace: bool  # a spare takes its rank (permanent); False: it resets in place


def respond(
    c: Classification, restart_policy: str, protected: bool, up: bool,
    registered: bool = True, relaunched: bool = False, falls_back: bool = False,
) -> Response:  # fmt: skip
    """`restart_policy`: deadpool-launch's (hotswap or full); `protected`: the job runs with
    --deadpool; `up`: generation 0's membership is recorded (every rank registered);
    `registered`: the failed rank's process had registered (a live one may any moment, so
    it counts as registered); `relaunched`: its seat was started again once already (a
    second death before registering is not bad luck); `falls_back`: what cannot be recovered
    in memory restarts from the persistent checkpoint (--deadpool-on-unrecoverable)."""
    alive = not isinstance(c.evidence, ProcessExited)
    permanent = c.kind is Decision.PERMANENT
    if c.kind is Decision.REPEATED and falls_back and in_recovery(c.cause):
        # the recovery itself fails the same way: a restart from the checkpoint runs none
        return Response(Action.RESTART, fence=False, replace=False)
    if refused_its_input(c) or c.kind is Decision.REPEATED:  # a spare or a restart would
        return Response(Action.END, fence=False, replace=False)  # meet the same again
    if restart_policy == "full":
        return Response(Action.RESTART, fence=False, replace=False)  # every process stops
    if not protected:
        # A hung process is fenced so that the log says so; the end stops everyone anyway.
        return Response(Action.END, fence=alive and permanent, replace=False)
    if not up and registered:
        return Response(Action.WAIT, fence=alive and permanent, replace=False)
    if not up:
        # It died in its imports or its first connection to the store: nothing of it is in
        # the job yet, so its seat starts again; twice, and the job ends.
        return Response(Action.END if relaunched else Action.RELAUNCH, False, False)
    return Response(Action.HOTSWAP, fence=permanent and alive, replace=permanent)


def why_it_ends(c: Classification, pid: int) -> tuple[str, str, int]:
    """For Action.END: the line the agent logs, the job's end reason and its exit status
    (`pid`: the failed rank's process)."""
    rank = c.rank
    if refused_its_input(c):
        return (f"worker rank {rank} (pid {pid}) {describe_exit(c.evidence.returncode)}: it "
                "refused its input (its error is above); a spare would be given the same, so "
                "the job ends", f"rank {rank} refused its input", BAD_INPUT_EXIT)  # fmt: skip
    if c.kind is Decision.REPEATED:
        again = "a spare or a restart would meet it again"
        if in_recovery(c.cause):
            again = ("a spare would meet it again; a restart from the checkpoint would not "
                     "(--deadpool-on-unrecoverable checkpoint-restart)")  # fmt: skip
        return (f"{c.reason}; ending the job (the traceback is in rank {rank}'s log): {again}",
                f"rank {rank} failed the same way again", 1)  # fmt: skip
    if isinstance(c.evidence, ProcessExited):
        line = (
            f"worker rank {rank} (pid {pid}) {describe_exit(c.evidence.returncode)}; ending the job"
        )
    else:
        line = f"rank {rank} failed and the job has no --deadpool protection; ending it"
    return line, f"failure of rank {rank}", 1


def refused_its_input(c: Classification) -> bool:
    """The rank exited with the status of a process that refuses its input (a checkpoint
    under --load that is missing, flags found wrong after start), not of a failure."""
    return isinstance(c.evidence, ProcessExited) and c.evidence.returncode == BAD_INPUT_EXIT
