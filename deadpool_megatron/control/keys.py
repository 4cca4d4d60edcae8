"""Every key the control plane reads or writes, declared in one place.

All keys live under ``deadpool/<job id>/`` so several jobs can share one etcd cluster, and keys
that only mean something within one membership generation carry it, so a straggler of an
older generation writes where nobody of the current one looks.
"""

from __future__ import annotations

from ..errors import ConfigError

ROOT = "deadpool"
RESERVED = ("c10d", "launch")  # names under ROOT that are not jobs


def _job(job: str) -> str:
    if not job or "/" in job or job.strip() != job:
        raise ConfigError(f"job id {job!r} must be non-empty, without '/' or surrounding spaces")
    if job in RESERVED:
        raise ConfigError(f"job id {job!r} is reserved for the store's own keys; pick another")
    return f"{ROOT}/{job}"


def job_prefix(job: str) -> str:
    """Prefix of every key of `job` (for listing or cleaning up a finished job)."""
    return _job(job) + "/"


C10D_ROOT = "deadpool/c10d/"  # torch's rendezvous keys, when they live in etcd


def process_groups_prefix(job: str) -> str:
    """Prefix of every generation's process-group rendezvous of `job`, when it lives in etcd."""
    return C10D_ROOT + job + "/"


def process_group_prefix(job: str, generation: int) -> str:
    """Where `generation`'s process groups meet in the torch store (not a control-plane key):
    a recovery (new generation) or a restarted job (new job id) never meets a dead process's
    addresses there."""
    return f"{job}/gen{generation}"


def membership(job: str) -> str:
    """The current `Membership` (JSON); changed only by compare-and-swap."""
    return f"{_job(job)}/membership"


def generation_prefix(job: str, generation: int) -> str:
    """Everything the job's processes and agents write for one generation (heartbeats,
    reports, the order, holdings, the plan, ...): retired together once it is over."""
    return f"{_job(job)}/gen/{generation}/"


def heartbeat(job: str, generation: int, rank: int) -> str:
    """Last beat (monotonic counter or timestamp) of `rank` in `generation`."""
    return f"{_job(job)}/gen/{generation}/heartbeat/{rank}"


def spare(job: str, spare_id: str) -> str:
    """Registration of an idle spare (`messages.spare_id`), written by the spare itself."""
    return f"{_job(job)}/spare/{spare_id}"


def spare_claim(job: str, spare_id: str) -> str:
    """Who claimed a spare; created once, by compare-and-swap, so only one claimer wins."""
    return f"{_job(job)}/spare/{spare_id}/claim"


def job_finished(job: str) -> str:
    """Set once every worker has succeeded; tells idle spares to exit."""
    return f"{_job(job)}/finished"


def report(job: str, generation: int, rank: int) -> str:
    """Failure evidence a worker reports about itself (an exception it caught)."""
    return f"{_job(job)}/gen/{generation}/report/{rank}"


def injected(job: str, rank: int) -> str:
    """The last fault injected into `rank` (an Injection: when, in which generation); the
    agent measures detection latency from it, across generations."""
    return f"{_job(job)}/injected/{rank}"


def ranks_done(job: str) -> str:
    """How many ranks have succeeded, added per node once all of a node's workers have (the
    agent that brings it to the world size sets job_finished)."""
    return f"{_job(job)}/ranks_done"


def spare_heartbeat(job: str, spare_id: str) -> str:
    """Last beat of an idle spare (spares have no rank and no generation)."""
    return f"{_job(job)}/spare/{spare_id}/heartbeat"


def registration(job: str, generation: int, rank: int) -> str:
    """The process (host:pid) that holds `rank` in `generation`, written by itself."""
    return f"{_job(job)}/gen/{generation}/registration/{rank}"


def recovery_order(job: str, generation: int) -> str:
    """The launcher's order to stop and recover into `generation` (JSON: failed ranks, why).
    Every process of the job watches for the next generation's order."""
    return f"{_job(job)}/gen/{generation}/order"


def holdings(job: str, generation: int, rank: int) -> str:
    """What a live rank holds for the recovery into `generation`: committed snapshot
    iterations, verified replicas, and the iteration it had completed."""
    return f"{_job(job)}/gen/{generation}/holdings/{rank}"


def recovery_plan(job: str, generation: int) -> str:
    """The plan of the recovery into `generation` (or why it cannot be done)."""
    return f"{_job(job)}/gen/{generation}/plan"


def footprint(job: str, rank: int) -> str:
    """The host buffers rank `rank`'s protection pipeline allocates (written at start-up;
    the same in every generation, as the rank's coordinates are)."""
    return f"{_job(job)}/footprint/{rank}"


def training_end(job: str) -> str:
    """The iteration the job's training stops after (written by its first generation)."""
    return f"{_job(job)}/training_end"


def spare_prebuilt(job: str, spare_id: str) -> str:
    """The ranks an idle spare built a model and optimizer for (written by the spare)."""
    return f"{_job(job)}/spare/{spare_id}/prebuilt"


def assignment(job: str, spare_id: str) -> str:
    """The rank and generation a claimed spare takes over (written after the claim)."""
    return f"{_job(job)}/spare/{spare_id}/assignment"


def arrived(job: str, generation: int, rank: int) -> str:
    """A process is ready to build `generation`'s communicators (rendezvous barrier)."""
    return f"{_job(job)}/gen/{generation}/arrived/{rank}"


def recovered(job: str, generation: int, rank: int) -> str:
    """A rank finished its first iteration in `generation` (JSON: phase durations)."""
    return f"{_job(job)}/gen/{generation}/recovered/{rank}"


def fault_fired(job: str, fault: str) -> str:
    """An injected fault has fired: each fires once per job, not once per process (a spare
    replaying the failed rank's iteration must not fail again)."""
    return f"{_job(job)}/fault/{fault}"


def fault_arrived(job: str, point: str, rank: int) -> str:
    """`rank` has reached `point` (ITER:PHASE), where it and other ranks are to fail together."""
    return f"{_job(job)}/fault_point/{point}/{rank}"


def launch(job: str) -> str:
    """Which launch owns `job`'s keys (`JobLaunch`, created by its first agent): a store that
    outlives launches (etcd) may still hold another launch's under the same job id."""
    return f"{_job(job)}/launch"


def node_launch(job: str, node: int) -> str:
    """What `node`'s agent was launched with (`NodeLaunch`), compared by every agent before
    any process starts."""
    return f"{_job(job)}/node_launch/{node}"


def launches_compared(job: str) -> str:
    """How many agents have compared the nodes' launches (node 0's, which may host the store,
    waits for all before it ends a launch they refused)."""
    return f"{_job(job)}/launches_compared"


def launch_identity(launch: str) -> str:
    """The job id agreed by the agents of one launch (`launch`: the store's address)."""
    return f"{ROOT}/launch/{launch}/job"


def joined_nodes(scope: str) -> str:
    """How many nodes have joined the job started as `scope` since its launch (`deadpool-launch
    --join`): the next one takes node index `--nnodes + --spare-nodes + count`. A counter the
    store adds, under the job's first id so that its checkpoint-restarts share it."""
    return f"{_job(scope)}/joined_nodes"


def agent(job: str, node: int) -> str:
    """A node agent's lease (`AgentBeat`): what it hosts, renewed every heartbeat interval."""
    return f"{_job(job)}/agent/{node}"


def rank_lost(job: str, generation: int, rank: int) -> str:
    """The hosting agent's word that `rank` will never report for the recovery into
    `generation` (`RankLost`)."""
    return f"{_job(job)}/gen/{generation}/lost/{rank}"


def restarted_job(scope: str, count: int) -> str:
    """The job id of checkpoint-restart number `count` of the job started as `scope`: a fresh
    key space, so that nothing of the stopped processes is read again."""
    return f"{scope}-r{count}"


def restart(scope: str, count: int) -> str:
    """Checkpoint-restart number `count` of the job started as `scope` (`RestartOrder`);
    created once, every agent follows it."""
    return f"{_job(scope)}/restart/{count}"


def node_lost(job: str, node: int) -> str:
    """Set when a recovery counted `node` lost (its lease lapsed); an agent that finds its own
    node here stops its processes: they no longer hold any rank."""
    return f"{_job(job)}/node_lost/{node}"


def agents_left(job: str) -> str:
    """How many agents have seen the job finish (node 0's, which hosts the TCPStore, waits
    for all of them before it closes the store)."""
    return f"{_job(job)}/agents_left"
