"""An idle spare builds the model and optimizer of the ranks it may take over
(--deadpool-spare-prebuild): which ranks (a table), the agent's preference for a spare that
built the failed rank's, the plan naming it, who then builds and who replays, and the spare's
idle-loop builds with a build function standing in for megatron-core's (the real build and
takeover run in tests/multiproc/test_hotswap.py)."""

import dataclasses

import pytest
from test_coordinator import generation0, holdings, make  # noqa: F401 (autouse fixture)
from test_stages import TIMEOUTS, FakeAbort
from test_stages import plan as stage_plan

from deadpool_megatron.config import JobConfig
from deadpool_megatron.control import keys
from deadpool_megatron.control.context import JobContext
from deadpool_megatron.control.messages import PlanDecision, SparePrebuilt
from deadpool_megatron.errors import ConfigError
from deadpool_megatron.failure.progress import ProgressBoard
from deadpool_megatron.megatron.arguments import parse_job_args
from deadpool_megatron.megatron.prebuild import Prebuilt
from deadpool_megatron.process.prebuilds import SparePrebuilds
from deadpool_megatron.process.spare import spare_prebuilds
from deadpool_megatron.recovery.placement import (
    fitting_ranks,
    order_spares,
    prebuild_targets,
    spare_local_rank,
    spare_slot,
)
from deadpool_megatron.recovery.plan import anyone_builds
from deadpool_megatron.recovery.stages import ProcessRecovery
from deadpool_megatron.runtime import ProcessEnv
from deadpool_megatron.topology import Topology
from jobs import ROOT

DEMO = Topology(8, 2, 2)  # TP2 x PP2 x DP2: rank = tp + 2 * (dp + 2 * pp)


def test_a_state_fits_the_ranks_of_the_same_coordinates():
    # With the distributed optimizer the shard is the DP rank's: one rank per state.
    assert fitting_ranks(DEMO, 5, distributed_optimizer=True) == (5,)
    # Without it, every DP peer of the same TP rank and stage.
    assert fitting_ranks(DEMO, 5, distributed_optimizer=False) == (5, 7)
    assert fitting_ranks(DEMO, 0, distributed_optimizer=False) == (0, 2)


@pytest.mark.parametrize(
    ("spare", "count", "distopt", "expected"),
    [
        (0, 1, True, [0]),
        (1, 1, True, [1]),
        (1, 3, True, [3, 4, 5]),  # spares take consecutive ranks in turn
        (3, 3, True, [1, 2, 3]),  # ... wrapping around
        (0, 20, True, list(range(8))),  # never more than there are kinds
        (1, 2, False, [4, 5]),  # kinds (tp, pp): ranks 0, 1, 4, 5 stand for them
    ],
)
def test_spares_spread_their_builds_over_the_kinds_of_rank(spare, count, distopt, expected):
    assert prebuild_targets(DEMO, 0, spare, count, distopt) == expected  # one node


# DP6 on 3 worker nodes of 2 (ranks 2n, 2n+1 on node n) and spare node 3, as in the multi-node
# tests; TP2 x PP2 x DP2 on 2 nodes of 4 (node 0: stage 0, node 1: stage 1).
DP6 = Topology(6, 1, 1, ranks_per_node=2)
TP2PP2 = Topology(8, 2, 2, ranks_per_node=4)


@pytest.mark.parametrize(
    ("topo", "node", "slot", "count", "distopt", "expected"),
    [
        (DP6, 1, 0, 1, True, [2]),  # a worker node's spares build for that node's ranks
        (DP6, 1, 1, 1, True, [3]),  # ... in turn
        (DP6, 1, 0, 3, True, [2, 3]),  # ... and never for another node's
        (DP6, 2, 0, 2, True, [4, 5]),
        (DP6, 3, 0, 3, True, [0, 2, 4]),  # a spare node's slot i: local rank i of every node
        (DP6, 3, 1, 2, True, [1, 3]),
        (DP6, 4, 1, 2, True, [5, 1]),  # a second spare node starts at another node
        (DP6, 1, 0, 1, False, [2]),  # one kind for all: any rank stands for it
        (TP2PP2, 1, 0, 2, False, [4, 5]),  # stage 1's kinds (tp, pp): ranks 4 and 5
        (TP2PP2, 1, 1, 2, False, [4, 5]),  # two kinds on the node: the spares share them
        (TP2PP2, 2, 1, 2, False, [1, 5]),  # spare node, slot 1: TP rank 1 of either stage
        (TP2PP2, 2, 2, 2, False, [2, 6]),  # slot 2: local rank 2 (TP rank 0, DP rank 1)
    ],
)
def test_spares_build_for_the_ranks_they_would_be_seated_on(
    topo, node, slot, count, distopt, expected
):
    assert prebuild_targets(topo, node, slot, count, distopt) == expected


@pytest.mark.parametrize(("spare_node", "local_ranks"), [(False, [4, 5]), (True, [0, 1])])
def test_a_spare_finds_its_slot_from_the_local_rank_the_launcher_gave_it(spare_node, local_ranks):
    # 4 workers per node: a worker node's spares come after them, a spare node's from 0.
    assert [spare_local_rank(s, 4, spare_node) for s in range(2)] == local_ranks
    assert [spare_slot(r, 4) for r in local_ranks] == [0, 1]
    assert spare_slot(2, 4) == 2  # a fresh spare in lost worker 2's place takes its slot


SPARES = {"spare-0": 0, "spare-1": 0, "spare-2": 0}


def test_the_agent_seats_a_spare_that_built_for_the_failed_rank():
    seat = lambda failed, built: dict(  # noqa: E731
        zip(sorted(failed), order_spares(failed, SPARES, set(), {0}, built))
    )
    assert seat({3: 0}, {}) == {3: "spare-0"}  # nobody built: the usual order
    assert seat({3: 0}, {"spare-0": (1,), "spare-2": (3,)}) == {3: "spare-2"}
    # Two failures: each gets its own builder; a builder for a later rank is kept for it.
    built = {"spare-0": (5,), "spare-1": (2,)}
    assert seat({2: 0, 5: 0}, built) == {2: "spare-1", 5: "spare-0"}
    assert seat({1: 0, 5: 0}, built) == {1: "spare-1", 5: "spare-0"}
    assert seat({1: 0, 2: 0}, {"spare-0": (2,)}) == {1: "spare-1", 2: "spare-0"}


def test_the_plan_names_the_ranks_whose_spare_built_for_them(kv):
    coord, _ = make(kv)
    rec = coord.order({3}, "rank 3 exited", 1.0)
    holdings(kv, 1, [0, 1, 2])
    held = coord.gather(rec, lost=lambda r: None, on_lost=None, sleep=lambda s: None)
    plan = coord.decide(rec, held, ["spare-0", "spare-1"], {"spare-0": (3,), "spare-1": (2,)})
    assert plan.replaced == {3: "spare-0"} and plan.prebuilt == (3,)
    decision = PlanDecision.decode(kv.get(keys.recovery_plan("coord-test", 1)))
    assert decision.plan == plan  # through the store and back
    # A spare that built for another rank is seated all the same, without the claim.
    rec2 = coord.order({3}, "spare-0 exited", 2.0)
    holdings(kv, 2, [0, 1, 2])
    plan2 = coord.decide(rec2, coord.gather(rec2, lambda r: None, None), ["spare-1"],
                         {"spare-1": (2,)})  # fmt: skip
    assert plan2.replaced == {3: "spare-1"} and plan2.prebuilt == ()


def test_a_plan_from_before_prebuilds_reads_as_none_prebuilt(kv):
    coord, _ = make(kv)
    rec = coord.order({3}, "rank 3 exited", 1.0)
    holdings(kv, 1, [0, 1, 2])
    plan = coord.decide(rec, coord.gather(rec, lambda r: None, None), ["spare-0"])
    doc = PlanDecision(plan, 6).to_doc()
    del doc["prebuilt"]
    assert PlanDecision.from_doc(doc).plan.prebuilt == ()
    assert SparePrebuilt.decode(SparePrebuilt((1, 3)).encode()) == SparePrebuilt((1, 3))


def test_who_builds_decides_whether_the_ranks_that_keep_their_state_replay(kv):
    coord, _ = make(kv)
    rec = coord.order({3}, "rank 3 exited", 1.0)
    holdings(kv, 1, [0, 1, 2])
    plan = coord.decide(rec, coord.gather(rec, lambda r: None, None), ["spare-0"],
                        {"spare-0": (3,)})  # fmt: skip
    # Survivors keep theirs and the spare built while idle: nobody builds, nobody replays.
    assert not anyone_builds(plan, keep_model=True)
    # Survivors build: the spare (and any survivor that keeps its state) replays.
    assert anyone_builds(plan, keep_model=False)
    # The spare did not build while idle: it builds, the survivors replay.
    assert anyone_builds(dataclasses.replace(plan, prebuilt=()), keep_model=True)
    # A transient reset with kept states: nobody builds.
    assert not anyone_builds(dataclasses.replace(plan, replaced={}, prebuilt=()), True)


class Built:
    def __init__(self, rank):
        self.rank, self.build_s = rank, 0.01


def test_the_idle_loop_builds_one_rank_per_poll_and_publishes_what_it_covers():
    published, builds = [], []

    def build(rank):
        builds.append(rank)
        return Built(rank)

    fits = {1: (1, 3), 2: (2,)}.__getitem__
    pre = SparePrebuilds([1, 2], build, fits, published.append)
    pre.poll()
    assert builds == [1] and published == [(1, 3)]  # a claim is seen between two builds
    pre.poll()
    pre.poll()  # nothing left to build
    assert builds == [1, 2] and published == [(1, 3), (1, 2, 3)]
    assert pre.take(3).rank == 1  # the state that fits the claimed rank
    assert pre.built == {}  # the others are let go


def test_a_failed_build_stops_the_builds_and_keeps_what_was_built():
    published = []

    def build(rank):
        if rank == 2:
            raise RuntimeError("out of memory")
        return Built(rank)

    pre = SparePrebuilds([1, 2, 3], build, lambda r: (r,), published.append)
    for _ in range(3):
        pre.poll()
    assert published == [(1,)] and sorted(pre.built) == [1]
    assert pre.take(2) is None and pre.take(1) is None  # taking lets every other go


def test_a_spare_builds_for_the_ranks_of_its_node_and_slot():
    # What deadpool-launch starts spares with (tests/unit/test_children.py): GROUP_RANK and
    # LOCAL_RANK. DP6 on 3 worker nodes of 2 with a spare node 3, the distributed optimizer.
    cfg = parse_job_args(["--config", str(ROOT / "configs" / "demo.yaml"),
                          "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size",
                          "1", "--global-batch-size", "12", "--deadpool-spare-prebuild", "3"], 6)  # fmt: skip

    def targets(node: int, local_rank: int) -> tuple[int, ...]:
        env = ProcessEnv.from_environ({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2",
                                       "GROUP_RANK": str(node), "LOCAL_RANK": str(local_rank),
                                       "DEADPOOL_SPARE_INDEX": "0", "DEADPOOL_ROLE": "spare"})  # fmt: skip
        return spare_prebuilds(cfg, env, client=None).targets

    assert targets(1, 2) == (2, 3)  # node 1's spare, after its 2 workers: node 1's ranks
    assert targets(3, 0) == (0, 2, 4)  # the spare node's first slot: every node's local rank 0
    assert targets(3, 1) == (1, 3, 5)


def test_a_negative_prebuild_count_is_refused_before_anything_starts():
    with pytest.raises(ConfigError, match="--deadpool-spare-prebuild=-1 must be 0"):
        parse_job_args(["--deadpool-spare-prebuild", "-1"], 1)


class Recovery(ProcessRecovery):
    """A claimed spare's recovery with its prebuilt state given (no process groups here)."""

    def __init__(self, kv, prebuilt):
        env = ProcessEnv("worker", 3, 4, 3, 4, "127.0.0.1", None, 0, "prebuild-test", False, True)
        super().__init__(JobConfig(), env, JobContext(kv, "prebuild-test"), None, ProgressBoard(),
                         FakeAbort(), protect=None, timeouts=TIMEOUTS, prebuilt=prebuilt)  # fmt: skip


def test_a_claimed_spare_keeps_its_prebuilt_state_only_when_the_plan_counts_on_it(kv):
    prebuilt = Prebuilt(3, state="rank 3's state", hooks=[], roles={1: ("WORLD", None)},
                        build_s=0.1)  # fmt: skip
    counted = dataclasses.replace(stage_plan(1), replaced={3: "spare-0"}, prebuilt=(3,))
    recovery = Recovery(kv, prebuilt)
    assert recovery._adopt_prebuilt(counted)
    assert recovery._kept.state == "rank 3's state" and recovery._roles == prebuilt.roles
    # The plan was made before the spare published its build: it builds, as its peers expect.
    recovery = Recovery(kv, prebuilt)
    assert not recovery._adopt_prebuilt(dataclasses.replace(counted, prebuilt=()))
    assert recovery._kept is None
    # The plan counts on a build the spare does not have: it builds, and its peers learn so
    # before any build collective (recovery/kept.py, tests/unit/test_keep_or_build.py).
    recovery = Recovery(kv, None)
    assert not recovery._adopt_prebuilt(counted) and recovery._kept is None
