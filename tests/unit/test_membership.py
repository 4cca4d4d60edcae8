"""Membership planning: pure, no store. The store-backed half is in tests/control."""

import pytest

from deadpool_megatron.control.membership import Member, Membership, MembershipError, replace
from deadpool_megatron.errors import DeadpoolError

pytestmark = pytest.mark.timeout(60)


def view(generation: int = 0, spares: tuple[str, ...] = ("spare-0", "spare-1")) -> Membership:
    # tp=2, pp=2, dp=1: rank -> (tp, pp, dp) as megatron lays it out (TP fastest).
    ranks = tuple(Member(r, f"w{r}", (r % 2, r // 2, 0)) for r in range(4))
    return Membership(generation, ranks, spares)


@pytest.mark.parametrize("failed", [0, 1, 3])  # rank 0 is replaced like any other
def test_spare_takes_the_failed_ranks_coordinates_in_the_next_generation(failed):
    before = view(generation=4)
    after = replace(before, failed, "spare-1")
    assert after.generation == 5
    assert after.member(failed) == Member(failed, "spare-1", before.member(failed).coords)
    assert after.spares == ("spare-0",)
    for rank in {0, 1, 2, 3} - {failed}:
        assert after.member(rank) == before.member(rank)


def test_first_spare_is_used_by_default_and_view_is_unchanged():
    before = view()
    after = replace(before, 2)
    assert after.member(2).process_id == "spare-0"
    assert before.member(2).process_id == "w2" and before.spares == ("spare-0", "spare-1")


def test_no_spare_left_names_the_failed_rank():
    with pytest.raises(DeadpoolError, match=r"no spare left to replace failed rank 3"):
        replace(view(spares=()), 3)


def test_unknown_spare_and_unknown_rank_are_named():
    with pytest.raises(MembershipError, match=r"spare 'spare-9' is not free"):
        replace(view(), 1, "spare-9")
    with pytest.raises(MembershipError, match=r"rank 7 is not in generation 0"):
        replace(view(), 7)


def test_two_replacements_use_up_the_pool():
    once = replace(view(), 0)
    twice = replace(once, 1)
    assert twice.generation == 2 and twice.spares == ()
    with pytest.raises(MembershipError, match="failed rank 2"):
        replace(twice, 2)


def test_json_round_trip_is_canonical():
    m = view(generation=3)
    assert Membership.decode(m.encode()) == m
    shuffled = Membership(3, tuple(reversed(m.ranks)), m.spares)
    assert shuffled.encode() == m.encode()  # CAS compares bytes: order must not matter


@pytest.mark.parametrize(
    "ranks, spares, message",
    [
        ([(0, "a", (0, 0, 0)), (0, "b", (1, 0, 0))], (), r"ranks \[0, 0\] are not unique"),
        ([(0, "a", (0, 0, 0))], ("a",), r"process ids \['a', 'a'\]"),
    ],
)
def test_invalid_views_are_rejected_with_the_bad_value(ranks, spares, message):
    with pytest.raises(MembershipError, match=message):
        Membership(0, tuple(ranks), spares)


def test_malformed_json_is_named():
    with pytest.raises(MembershipError, match=r"malformed Membership b'\{\"gen"):
        Membership.decode(b'{"gen": 1}')
