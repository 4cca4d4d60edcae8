"""An idle spare's wait for its assignment, on a fake clock and an in-process store: SIGTERM
withdraws it unless a recovery claimed it first (then it still takes its rank over), the
job's end stops the wait, and the idle work runs at every look."""

import pytest
from waiting import FakeClock

from deadpool_megatron.control import keys
from deadpool_megatron.control.context import JobContext
from deadpool_megatron.control.membership import Member, Membership, MembershipStore
from deadpool_megatron.control.messages import Flag, SpareAssignment
from deadpool_megatron.process.spare import IdleWatch, JobFinished, wait_for_assignment

pytestmark = pytest.mark.timeout(60)

JOB = "idle-test"
ME = "spare-0"
POLL_S = 0.05


class Scene:
    """The spare's world, advanced by the wait's own sleeps: `at[n]` runs before look n."""

    def __init__(self, kv):
        self.ctx = JobContext(kv, JOB)
        self.members = MembershipStore(kv, JOB)
        self.members.create(Membership(0, (Member(0, "w0", (0, 0, 0)),), (ME,)))
        self.clock = FakeClock()
        self.signalled = False
        self.chores = 0
        self.at: dict[int, object] = {}
        self.looks = 0

    def sleep(self, seconds: float) -> None:
        self.clock.sleep(seconds)

    def look(self) -> None:
        self.looks += 1
        happen = self.at.get(self.looks)
        if happen is not None:
            happen()

    def chore(self) -> None:
        self.chores += 1

    def wait(self) -> tuple[IdleWatch, SpareAssignment | str]:
        idle = IdleWatch(ME, lambda: self.signalled, self.members,
                         lambda: self.ctx.get(keys.job_finished(JOB), Flag) is not None,
                         [self.look, self.chore])  # fmt: skip
        try:
            got = wait_for_assignment(self.ctx, ME, idle, POLL_S, self.clock, self.sleep)
        except JobFinished as why:
            got = str(why)
        return idle, got


def test_sigterm_while_unclaimed_withdraws_and_no_recovery_can_claim_it_after(kv):
    s = Scene(kv)
    s.at[3] = lambda: setattr(s, "signalled", True)
    idle, got = s.wait()
    assert got == "stopped by SIGTERM" and not idle.claimed
    # the signal came during look 3's idle work: the next look, one interval later, withdraws
    # before any idle work
    assert s.looks == 3 and s.clock.now == pytest.approx(3 * POLL_S)
    assert not s.members.claim_spare(ME, 0, claimer="node 0")
    assert not s.members.claimable(ME, 0, "node 0")


def test_sigterm_after_a_claim_still_takes_the_rank_over_when_the_assignment_comes(kv):
    s = Scene(kv)
    s.at[2] = lambda: s.members.claim_spare(ME, 0, claimer="node 0")
    s.at[3] = lambda: setattr(s, "signalled", True)
    s.at[40] = lambda: s.ctx.put(keys.assignment(JOB, ME), SpareAssignment(5, 1))
    idle, got = s.wait()
    assert got == SpareAssignment(5, 1) and idle.claimed
    assert s.looks == 40 and s.chores == 40  # the idle work went on while it waited
    assert s.clock.now == pytest.approx(39 * POLL_S)


def test_the_jobs_end_stops_the_wait_without_withdrawing(kv):
    s = Scene(kv)
    s.at[4] = lambda: s.ctx.put(keys.job_finished(JOB), Flag("done"))
    _, got = s.wait()
    assert got == "job finished" and s.looks == 4
    assert s.members.claimable(ME, 0, "node 0")  # not withdrawn: it just left with the job
