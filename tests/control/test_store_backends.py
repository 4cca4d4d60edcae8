"""The same store, membership and fencing tests against both real backends.

TCPStore is hosted in this process on a free loopback port; etcd is Debian's `etcd-server`
(installed with apt-get when missing), started on free loopback ports in a temporary data dir
and stopped by pid. Each test uses its own job id, so one server of each serves the session.
"""

import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from etcd_server import free_port, start_etcd_cluster
from waiting import STORE_CONNECT_S

from deadpool_megatron.control import keys
from deadpool_megatron.control.etcd_store import EtcdKVStore
from deadpool_megatron.control.membership import (
    Member,
    Membership,
    MembershipError,
    MembershipStore,
    StaleGeneration,
    replace,
)
from deadpool_megatron.control.signed import SignedKVStore
from deadpool_megatron.control.store import KVStore, StoreTimeout, StoreUnreachable
from deadpool_megatron.control.tcp_store import TcpKVStore

# func_only: the etcd fixture may need minutes of apt-get in a fresh CI image; it bounds each
# of its own steps instead.
pytestmark = pytest.mark.timeout(60, func_only=True)

Connect = Callable[[], KVStore]
RACERS = 8


@pytest.fixture(scope="session")
def tcp_host() -> Iterator[TcpKVStore]:
    host = TcpKVStore("127.0.0.1", 0, is_master=True, timeout_s=STORE_CONNECT_S)
    yield host
    host.close()


@pytest.fixture(params=["tcp", "etcd"])
def connect(request) -> Connect:
    """Opens a new client of the backend (one per racer, as separate processes would)."""
    if request.param == "tcp":
        port = request.getfixturevalue("tcp_host").port
        return lambda: TcpKVStore("127.0.0.1", port, timeout_s=STORE_CONNECT_S)
    url = request.getfixturevalue("etcd_url")
    return lambda: EtcdKVStore(url, timeout_s=5)


@pytest.fixture
def job() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


def initial(spares: tuple[str, ...] = ("spare-0", "spare-1")) -> Membership:
    return Membership(0, tuple(Member(r, f"w{r}", (r % 2, r // 2, 0)) for r in range(4)), spares)


def race(connect: Connect, attempt: Callable[[KVStore, int], object]) -> list[object]:
    """Runs `attempt(client, i)` in RACERS threads released together; returns results/errors."""
    clients = [connect() for _ in range(RACERS)]
    start, results = threading.Barrier(RACERS), [None] * RACERS

    def run(i: int) -> None:
        start.wait(timeout=10)
        try:
            results[i] = attempt(clients[i], i)
        except Exception as err:  # noqa: BLE001 - the race outcome is what we assert on
            results[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(RACERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for c in clients:
        c.close()
    return results


def test_get_set_add_delete(connect, job):
    store, key = connect(), keys.job_finished(job)
    assert store.get(key) is None  # absent: answered at once, not waited for
    store.set(key, b"1")
    assert store.get(key) == b"1"
    counter = keys.ranks_done(job)
    assert [store.add(counter, 1), store.add(counter, 5)] == [1, 6]
    assert store.delete(key) is True and store.delete(key) is False
    assert store.get(key) is None


def test_compare_and_swap_semantics(connect, job):
    store, key = connect(), keys.spare(job, "spare-0")
    assert store.compare_and_swap(key, None, b"a") == (True, b"a")
    assert store.compare_and_swap(key, None, b"b") == (False, b"a")  # must not exist: it does
    assert store.compare_and_swap(key, b"x", b"b") == (False, b"a")
    assert store.compare_and_swap(key, b"a", b"b") == (True, b"b")
    assert store.get(key) == b"b"
    assert store.compare_and_swap(keys.spare(job, "spare-1"), b"a", b"c") == (False, None)


def test_identical_racing_swaps_have_exactly_one_winner(connect, job):
    key = keys.recovery_order(job, 1)  # one order per generation: first writer wins
    results = race(connect, lambda c, i: c.compare_and_swap(key, None, b"same bytes"))
    assert sorted(ok for ok, _ in results) == [False] * (RACERS - 1) + [True]
    assert all(value == b"same bytes" for _, value in results)


def test_concurrent_adds_are_atomic(connect, job):
    key = keys.ranks_done(job)
    results = race(connect, lambda c, i: [c.add(key, 1) for _ in range(5)])
    assert sorted(n for r in results for n in r) == list(range(1, 5 * RACERS + 1))


def test_wait_returns_when_keys_appear_and_names_missing_ones(connect, job):
    store, a, b = connect(), keys.heartbeat(job, 0, 0), keys.heartbeat(job, 0, 1)
    threading.Timer(0.2, lambda: connect().set(a, b"beat")).start()
    store.wait([a], timeout_s=5)
    with pytest.raises(StoreTimeout, match=f"'{b}'"):
        store.wait([a, b], timeout_s=0.3)


def test_membership_is_created_once(connect, job):
    members = MembershipStore(connect(), job)
    assert members.current() is None
    members.create(initial())
    assert members.current() == initial()
    with pytest.raises(MembershipError, match=f"job {job} already has a membership"):
        MembershipStore(connect(), job).create(initial(spares=()))


def test_racing_commits_of_one_generation_have_exactly_one_winner(connect, job):
    MembershipStore(connect(), job).create(initial())
    plans = [replace(initial(), failed_rank=i % 4, spare_id=f"spare-{i % 2}") for i in range(8)]
    results = race(connect, lambda c, i: MembershipStore(c, job).commit(plans[i], 0))
    winners = [i for i, r in enumerate(results) if r is None]
    assert len(winners) == 1, results
    losers = [r for r in results if r is not None]
    assert all(isinstance(r, StaleGeneration) and r.current_generation == 1 for r in losers)
    assert MembershipStore(connect(), job).current() == plans[winners[0]]


def test_write_by_an_older_generation_is_refused(connect, job):
    members = MembershipStore(connect(), job)
    members.create(initial())
    gen1 = replace(initial(), 0)
    members.commit(gen1, writer_generation=0)
    zombie_plan = replace(initial(), 3)  # a fenced process still planning from generation 0
    with pytest.raises(StaleGeneration, match="generation 0 refused.*at generation 1"):
        MembershipStore(connect(), job).commit(zombie_plan, writer_generation=0)
    with pytest.raises(MembershipError, match="must commit generation 1, not 2"):
        members.commit(replace(gen1, 1), writer_generation=0)
    members.commit(replace(gen1, 1), writer_generation=1)
    assert members.current().generation == 2 and members.current().spares == ()


def test_spare_is_claimed_exactly_once_under_a_race(connect, job):
    MembershipStore(connect(), job).create(initial())
    results = race(connect, lambda c, i: MembershipStore(c, job).claim_spare("spare-0", 0, f"r{i}"))
    assert sorted(results) == [False] * (RACERS - 1) + [True]
    members = MembershipStore(connect(), job)
    assert members.claim_spare("spare-1", 0) is True  # another spare is still free
    with pytest.raises(StaleGeneration, match="generation 5 refused"):
        members.claim_spare("spare-0", by_generation=5)
    with pytest.raises(MembershipError, match="spare 'spare-7' is not free"):
        members.claim_spare("spare-7", by_generation=0)
    # A spare that joined after generation 0 was committed (a replenished pool), once; the
    # same claimer asking again in the same generation (planning again) still holds it.
    assert members.claim_spare("spare-7", 0, "r", joined=("spare-7",)) is True
    assert members.claim_spare("spare-7", 0, "s", joined=("spare-7",)) is False
    assert members.claim_spare("spare-7", 0, "r", joined=("spare-7",)) is True


def test_a_spare_withdraws_or_is_claimed_never_both(connect, job):
    # A spare told to stop (SIGTERM) takes itself out by the key a claim takes: whichever
    # comes first wins, so a recovery never waits for a spare that left.
    members = MembershipStore(connect(), job)
    members.create(initial())
    assert members.withdraw_spare("spare-0") is True
    assert members.claim_spare("spare-0", 0, "node 0") is False
    assert not members.claimable("spare-0", 0, "node 0")
    assert members.claimable("spare-1", 0, "node 0")
    assert members.claim_spare("spare-1", 0, "node 0") is True
    assert members.withdraw_spare("spare-1") is False  # claimed first: it takes its rank over
    assert members.claimable("spare-1", 0, "node 0")  # still this claimer's
    assert not members.claimable("spare-1", 0, "node 1")
    assert not members.claimable("spare-1", 1, "node 0")
    # Each claimer its own (one claimer asking again is told yes: with one name for all, a
    # claim that came first made every claimer's True, and the test failed whenever a claim
    # won the race).
    racers = race(connect, lambda c, i: (
        MembershipStore(c, job).withdraw_spare("spare-2") if i % 2
        else MembershipStore(c, job).claim_spare("spare-2", 0, f"node {i}", joined=("spare-2",))
    ))  # fmt: skip
    assert sum(racers) == 1, racers


def test_unreachable_tcp_store_names_its_endpoint():
    port = free_port()  # nothing listens here
    start = time.monotonic()
    with pytest.raises(StoreUnreachable, match=f"127.0.0.1:{port}"):
        TcpKVStore("127.0.0.1", port, timeout_s=0.5)
    assert time.monotonic() - start < 5


def test_tcp_store_that_goes_away_is_reported_unreachable():
    host = TcpKVStore("127.0.0.1", 0, is_master=True, timeout_s=STORE_CONNECT_S)
    port = host.port
    client = TcpKVStore("127.0.0.1", port, timeout_s=STORE_CONNECT_S)
    client.set("k", b"v")
    host.close()
    with pytest.raises(StoreUnreachable, match=f"127.0.0.1:{port}"):
        client.get("k")


def test_unreachable_etcd_names_every_endpoint():
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    start = time.monotonic()
    with pytest.raises(StoreUnreachable, match=f"{dead[0]},{dead[1]} is unreachable"):
        EtcdKVStore(",".join(dead), timeout_s=0.5).get("k")
    assert time.monotonic() - start < 5


def test_etcd_fails_over_to_an_endpoint_that_answers(etcd_url, job):
    store = EtcdKVStore(f"http://127.0.0.1:{free_port()},{etcd_url}", timeout_s=0.5)
    store.set(keys.job_finished(job), b"1")
    assert store.get(keys.job_finished(job)) == b"1"
    assert store.endpoint.startswith(etcd_url)  # the live one is now tried first


def test_delete_prefix_removes_exactly_the_prefix_in_etcd_and_is_unsupported_on_tcp(connect):
    store = connect()
    for key in ("p/gen/1/a", "p/gen/1/b/c", "p/gen/10/a", "p/gen/2/a", "p/gen/1"):
        store.set(key, b"v")
    removed = store.delete_prefix("p/gen/1/")
    if isinstance(store, TcpKVStore):
        assert removed is None and store.get("p/gen/1/a") == b"v"
        return
    assert removed == 2
    assert [store.get(k) for k in ("p/gen/1/a", "p/gen/1/b/c")] == [None, None]
    assert [store.get(k) for k in ("p/gen/10/a", "p/gen/2/a", "p/gen/1")] == [b"v"] * 3
    with pytest.raises(ValueError):
        store.delete_prefix("")


def test_a_tcp_store_has_no_term(connect):
    store = connect()
    if isinstance(store, TcpKVStore):
        assert store.term == 0


@pytest.mark.timeout(120)
def test_an_etcd_election_shows_as_a_new_term_to_every_client(tmp_path, job):
    # What NodeWatch restarts its timeouts on: a new leader's term in the answers.
    cluster = start_etcd_cluster(tmp_path, 3)
    try:
        store = SignedKVStore(EtcdKVStore(cluster.endpoints, timeout_s=20), b"s" * 16)
        store.set(keys.job_finished(job), b"1")
        before = store.term
        assert before > 0
        cluster.kill(cluster.leader())
        cluster.wait_for_leader()
        assert store.get(keys.job_finished(job)) == b"1"
        assert store.term > before
    finally:
        cluster.stop()
