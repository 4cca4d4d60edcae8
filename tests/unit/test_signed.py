"""The control store only takes the job's own writes: values sealed with the job's secret on a
real (in-process) TCPStore; forged, foreign and replayed values read as absent."""

import pytest

from deadpool_megatron.control import keys
from deadpool_megatron.control.context import JobContext
from deadpool_megatron.control.membership import Member, Membership, MembershipStore, replace
from deadpool_megatron.control.messages import FailureReport, RecoveryOrder
from deadpool_megatron.control.signed import (
    ENV_JOB_SECRET,
    ForgedRecord,
    SignedKVStore,
    job_secret,
    signed,
)
from deadpool_megatron.errors import ConfigError

JOB = "signed-test"
SECRET = b"0123456789abcdef0123456789abcdef"


def test_the_jobs_records_round_trip_and_nobody_elses_are_read(kv, caplog):
    store = SignedKVStore(kv, SECRET)
    ctx = JobContext(store, JOB)
    key = keys.report(JOB, 0, 1)
    ctx.put(key, FailureReport("collective_error", "boom", 1.0))
    assert ctx.get(key, FailureReport).message == "boom"
    # a forged write straight to the store (anyone who can reach its port)
    kv.set(key, FailureReport("injected_transient", "forged", 2.0).encode())
    assert ctx.get(key, FailureReport) is None
    assert ctx.get(key, FailureReport) is None
    assert sum("did not sign" in m for m in caplog.messages) == 1  # logged once per key
    # another job's secret
    other = JobContext(SignedKVStore(kv, b"another-secret-of-32-characters!"), JOB)
    other.put(key, FailureReport("collective_error", "foreign", 3.0))
    assert ctx.get(key, FailureReport) is None


def test_a_genuine_record_replayed_under_another_key_is_refused(kv):
    store = SignedKVStore(kv, SECRET)
    store.set("order/1", b'{"generation":1}')
    kv.set("order/2", kv.get("order/1"))  # the bytes are genuine, the key is not theirs
    assert store.get("order/1") == b'{"generation":1}'
    assert store.get("order/2") is None


def test_compare_and_swap_works_on_sealed_values_and_refuses_a_forged_one(kv):
    store = SignedKVStore(kv, SECRET)
    assert store.compare_and_swap("m", None, b"a") == (True, b"a")
    assert store.compare_and_swap("m", None, b"b") == (False, b"a")
    assert store.compare_and_swap("m", b"a", b"b") == (True, b"b")
    kv.set("m", b"forged")
    with pytest.raises(ForgedRecord, match="m holds a value"):
        store.compare_and_swap("m", b"b", b"c")


def test_membership_compare_and_swap_through_a_signed_store(kv):
    store = SignedKVStore(kv, SECRET)
    members = MembershipStore(store, JOB)
    ranks = tuple(Member(r, f"w{r}", (0, 0, r)) for r in range(2))
    members.create(Membership(0, ranks, ("spare-0",)))
    members.commit(replace(members.current(), 1, "spare-0"), writer_generation=0)
    assert members.current().generation == 1
    assert kv.get(keys.membership(JOB)) != store.get(keys.membership(JOB))  # sealed there


def test_an_order_nobody_signed_is_not_obeyed(kv):
    store = SignedKVStore(kv, SECRET)
    ctx = JobContext(store, JOB)
    key = keys.recovery_order(JOB, 1)
    kv.set(key, RecoveryOrder("forged: stop everything", (0, 1)).encode())
    assert ctx.get(key, RecoveryOrder) is None


def test_the_secret_comes_from_the_environment_and_a_short_one_is_refused(kv):
    assert job_secret({}) is None
    assert job_secret({ENV_JOB_SECRET: "x" * 16}) == b"x" * 16
    with pytest.raises(ConfigError, match="DEADPOOL_JOB_SECRET has 5 characters"):
        job_secret({ENV_JOB_SECRET: "short"})
    assert signed(kv, None) is kv
    assert isinstance(signed(kv, SECRET), SignedKVStore)
