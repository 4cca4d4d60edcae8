"""Node leases on a real in-process TCPStore with a fake clock: a node is lost only once its
lease stops moving for the node timeout, never before its first lease; what it hosted is
named; the hosting agent's word on a rank reaches a coordinator on another node."""

from deadpool_megatron.agent.nodes import Hosted, Lease, NodeWatch, count_node_lost
from deadpool_megatron.control import keys
from deadpool_megatron.control.context import JobContext
from deadpool_megatron.control.messages import AgentBeat, Heartbeat, RankLost
from deadpool_megatron.events import EventLog

JOB = "nodes-test"


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _lease(ctx, node, ranks=(), spares=(), generation=0):
    return Lease(ctx, node, lambda: Hosted(generation, tuple(ranks), tuple(spares)), 0.5)


def test_a_node_is_lost_once_its_lease_stops_moving_for_the_timeout(kv):
    ctx = JobContext(kv, JOB)
    clock = Clock()
    mine = _lease(ctx, 0)
    watch = NodeWatch(ctx, 0, [0, 1, 2], 2.0, lambda: mine.renewed, 3, clock=clock)
    one, two = _lease(ctx, 1, ranks=(2, 3)), _lease(ctx, 2, spares=("spare-4",))
    one.renew()
    assert watch.poll() == []  # node 2 never renewed: not watched yet, not lost
    two.renew()
    for _ in range(5):  # all renew every 0.5 s: nothing is lost however long it runs
        clock.t += 0.5
        for lease in (mine, one, two):
            lease.renew()
        assert watch.poll() == []
    for _ in range(2):  # node 1 stops renewing
        clock.t += 1.0
        mine.renew()
        two.renew()
        assert watch.poll() == []  # exactly the timeout since node 1's last move: still fresh
    mine.renew()
    clock.t += 0.01
    (lost,) = watch.poll()
    assert (lost.node, lost.ranks, lost.spares) == (1, (2, 3), ())
    assert watch.is_lost(1) and not watch.is_lost(2)
    assert watch.poll() == []  # reported once
    assert watch.lost_rank(3, 1) == f"node 1 (agent pid {lost.pid} on {lost.host}) is lost"
    assert watch.lost_rank(4, 1) is None
    assert watch.busy() == set()  # node 2 hosts no ranks, node 1 is lost
    assert watch.node_of_spare("spare-4") == 2 and watch.host_of(2) == 1


def test_a_lease_carries_what_the_agent_hosts_now_and_moves_every_renewal(kv):
    ctx = JobContext(kv, JOB)
    hosted = [Hosted(0, (0, 1), ("spare-0",))]
    lease = Lease(ctx, 3, lambda: hosted[-1], 0.5)
    lease.renew()
    first = ctx.get(keys.agent(JOB, 3), AgentBeat)
    hosted.append(Hosted(1, (0, 1, 5), ()))
    lease.renew()
    second = ctx.get(keys.agent(JOB, 3), AgentBeat)
    assert (first.generation, first.ranks, first.spares) == (0, (0, 1), ("spare-0",))
    assert (second.generation, second.ranks, second.spares, second.seq) == (1, (0, 1, 5), (), 2)


def test_the_hosting_agents_word_on_a_rank_reaches_the_coordinator(kv):
    ctx = JobContext(kv, JOB)
    watch = NodeWatch(ctx, 0, [0, 1], 2.0, lambda: 0, 3, clock=Clock())
    assert watch.lost_rank(3, 4) is None
    ctx.put(keys.rank_lost(JOB, 4, 3), RankLost("exited with SIGKILL"))
    assert watch.lost_rank(3, 4) == "exited with SIGKILL"
    assert watch.lost_rank(3, 5) is None  # another generation's recovery
    assert not watch.finished_rank(3, 4)
    ctx.put(keys.rank_lost(JOB, 5, 2), RankLost("finished training", finished=True))
    assert watch.finished_rank(2, 5) and watch.lost_rank(2, 5) is None  # done, not lost


def test_a_store_that_stalls_every_lease_accuses_nobody(kv):
    ctx = JobContext(kv, JOB)
    clock = Clock()
    mine = _lease(ctx, 0)
    watch = NodeWatch(ctx, 0, [0, 1], 2.0, lambda: mine.renewed, 3, clock=clock)
    other = _lease(ctx, 1, ranks=(2,))
    mine.renew()
    other.renew()
    assert watch.poll() == []
    clock.t += 5.0  # nobody's lease reached the store (an etcd election, say)
    assert watch.poll() == []
    mine.renew()
    mine.renew()  # the store answers again; node 1 is still silent
    assert watch.poll() == []
    mine.renew()  # three renewals of our own while node 1's lease stood still
    assert [b.node for b in watch.poll()] == [1]


def test_a_store_election_restarts_every_timeout_from_when_it_is_seen(kv):
    # CI: an etcd leader killed; node 1's lease and heartbeats, sent to a follower, hung
    # through the election and past it, while ours, through a member that answered, went on:
    # node 1 was counted lost, never having failed.
    ctx = JobContext(kv, JOB)
    clock, term = Clock(), [2]
    mine = _lease(ctx, 0)
    watch = NodeWatch(ctx, 0, [0, 1], 2.0, lambda: mine.renewed, 3, clock=clock,
                      term=lambda: term[0])  # fmt: skip
    other = _lease(ctx, 1, ranks=(2,))
    other.renew()
    assert watch.poll() == []
    for _ in range(3):  # node 1 falls silent; our store answers through the election
        clock.t += 0.5
        mine.renew()
        assert watch.poll() == []
    term[0] = 3  # the answers now carry a new leader's term
    for _ in range(4):  # 1.5 s ... 3.5 s of silence: still within a timeout of the election
        clock.t += 0.5
        mine.renew()
        assert watch.poll() == []
    other.renew()  # node 1's requests get through
    for _ in range(6):
        clock.t += 0.5
        mine.renew()
        other.renew()
        assert watch.poll() == []
    term[0] = 4  # another election, and node 1 is really gone this time
    assert watch.poll() == []  # seen now
    for _ in range(4):  # found one timeout after the election was seen, not sooner
        clock.t += 0.5
        mine.renew()
        assert watch.poll() == []
    clock.t += 0.01
    assert [b.node for b in watch.poll()] == [1]


def test_the_first_term_seen_is_no_election(kv):
    ctx = JobContext(kv, JOB)
    clock = Clock()
    mine = _lease(ctx, 0)
    watch = NodeWatch(ctx, 0, [0, 1], 2.0, lambda: mine.renewed, 3, clock=clock,
                      term=lambda: 7)  # fmt: skip
    _lease(ctx, 1).renew()
    assert watch.poll() == []
    for _ in range(4):
        clock.t += 0.5
        mine.renew()
    clock.t += 0.01
    assert [b.node for b in watch.poll()] == [1]


def test_a_late_lease_alone_proves_nothing_while_the_nodes_processes_beat(kv):
    ctx = JobContext(kv, JOB)
    clock = Clock()
    mine = _lease(ctx, 0)
    watch = NodeWatch(ctx, 0, [0, 1], 2.0, lambda: mine.renewed, 3, clock=clock)
    _lease(ctx, 1, ranks=(2,)).renew()  # node 1's agent renews once, then stalls
    assert watch.poll() == []
    for i in range(8):  # its rank 2 keeps beating for 4 s
        clock.t += 0.5
        mine.renew()
        ctx.put(keys.heartbeat(JOB, 0, 2), Heartbeat(clock.t, i, 42))
        assert watch.poll() == []
    for _ in range(4):  # and stops: 2 s later the node is lost
        clock.t += 0.5
        mine.renew()
        assert watch.poll() == []
    clock.t += 0.01
    assert [b.node for b in watch.poll()] == [1]


def test_before_the_job_is_up_a_lease_may_stand_still_for_the_start_up_timeout(kv):
    # CI: a node's agent, starved while every node started at once, left its lease standing
    # 2 s before the job was up, and the node-lost rule ended the whole job.
    ctx = JobContext(kv, JOB)
    clock = Clock()
    mine = _lease(ctx, 0)
    watch = NodeWatch(ctx, 0, [0, 1], 2.0, lambda: mine.renewed, 3, startup_timeout_s=30.0,
                      clock=clock)  # fmt: skip
    _lease(ctx, 1, ranks=(2,)).renew()
    assert watch.poll(up=False) == []
    for _ in range(58):  # 29 s of silence from node 1 while ours renews
        clock.t += 0.5
        mine.renew()
        assert watch.poll(up=False) == []
    clock.t += 1.01
    mine.renew()
    assert [b.node for b in watch.poll(up=False)] == [1]
    # Once the job is up the node timeout applies again, to a node silent as long.
    other = NodeWatch(ctx, 0, [0, 1], 2.0, lambda: mine.renewed, 3, startup_timeout_s=30.0,
                      clock=clock)  # fmt: skip
    assert other.poll(up=True) == []
    for _ in range(4):
        clock.t += 0.5
        mine.renew()
        assert other.poll(up=True) == []
    clock.t += 0.01
    assert [b.node for b in other.poll(up=True)] == [1]


def test_the_first_agent_to_count_a_node_lost_takes_its_ranks_and_drops_its_spares(kv):
    ctx = JobContext(kv, JOB)
    events = EventLog(None)
    for sid in ("spare-4", "spare-5"):
        kv.set(keys.spare(JOB, sid), b"{}")
    beat = AgentBeat(1, "host1", 77, 9, 100.0, 2, ranks=(2, 3), spares=("spare-4",))
    # rank 3 was moved to another node in generation 3, after this lease of generation 2
    assert count_node_lost(ctx, 0, beat, {3: 3, 2: 1}, 2.0, events) == [2]
    assert kv.get(keys.spare(JOB, "spare-4")) is None
    assert kv.get(keys.spare(JOB, "spare-5")) is not None
    assert count_node_lost(ctx, 2, beat, {}, 2.0, events) == []  # counted already
    assert beat.holder == "node 1 (agent pid 77 on host1)"
