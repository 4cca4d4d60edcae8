"""The rendezvous store whose waits give up on a recovery order (control/c10d.StoppableStore),
over a real TCPStore hosted in the test, on a fake clock: a wait returns once the key is set,
raises what `stop` raises once it does, and times out naming the keys; the other operations
pass through to the wrapped store."""

import datetime

import pytest
import torch.distributed as dist
from waiting import STORE_CONNECT_S, FakeClock

from deadpool_megatron.control.c10d import StoppableStore, poll_cap
from deadpool_megatron.control.store import StoreTimeout

pytestmark = pytest.mark.timeout(60)


class Ordered(Exception):
    pass


@pytest.fixture
def tcp():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=STORE_CONNECT_S))  # fmt: skip
    yield dist.PrefixStore("gen3", store)


class World:
    """The store's polls are the fake clock's sleeps: `at[n]` happens at the n-th one."""

    def __init__(self):
        self.clock = FakeClock()
        self.sleeps = 0
        self.at = {}
        self.ordered = False

    def sleep(self, seconds: float) -> None:
        self.clock.sleep(seconds)
        self.sleeps += 1
        happen = self.at.get(self.sleeps)
        if happen is not None:
            happen()

    def stop(self) -> None:
        if self.ordered:
            raise Ordered("generation 4 was ordered")


def _store(tcp, world: World, timeout_s: float = 600.0) -> StoppableStore:
    return StoppableStore(tcp, world.stop, timeout_s, 0.005, world.clock, world.sleep)


def test_the_pause_between_polls_grows_with_the_job_up_to_one_second():
    # 2000 polls a second in all while every rank waits: 5 ms up to 10 ranks, 0.5 s at 1000
    assert [poll_cap(n) for n in (2, 8, 10, 16, 1000, 2000, 16384)] == [
        0.005, 0.005, 0.005, 0.008, 0.5, 1.0, 1.0
    ]  # fmt: skip


def test_a_get_waits_for_the_key_and_returns_its_value(tcp):
    world = World()
    world.at[5] = lambda: tcp.set("rank_1", b"addr-1")
    store = _store(tcp, world)
    assert store.get("rank_1") == b"addr-1"
    assert world.sleeps == 5
    assert store.get("rank_1") == b"addr-1" and world.sleeps == 5  # present: no wait


def test_an_order_ends_the_wait_with_what_stop_raises(tcp):
    world = World()
    world.at[12] = lambda: setattr(world, "ordered", True)
    store = _store(tcp, world)
    with pytest.raises(Ordered, match="generation 4"):
        store.wait(["rank_0", "rank_1"])
    assert world.sleeps == 12  # seen at the very next poll
    # the pauses grow from 1 ms to 5 ms: a key that shows up is seen within 5 ms
    assert world.clock.now == pytest.approx(0.001 + 0.002 + 0.004 + 9 * 0.005)


def test_a_wait_times_out_naming_the_keys(tcp):
    world = World()
    store = _store(tcp, world, timeout_s=1.0)
    with pytest.raises(StoreTimeout, match=r"\['rank_7'\] did not appear within 0.5 s"):
        store.wait(["rank_7"], datetime.timedelta(seconds=0.5))
    assert 0.5 <= world.clock.now < 0.51
    store.set_timeout(datetime.timedelta(seconds=0.25))
    with pytest.raises(StoreTimeout, match="within 0.25 s"):
        store.get("rank_7")


def test_the_other_operations_pass_through(tcp):
    store = _store(tcp, World())
    store.set("a", b"1")
    assert tcp.get("a") == b"1" and store.check(["a"]) and not store.check(["b"])
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("a", b"1", b"2") == b"2" and tcp.get("a") == b"2"
    assert store.delete_key("a") and not store.check(["a"])
