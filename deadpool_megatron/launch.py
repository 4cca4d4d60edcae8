"""deadpool-launch: the command line of the node agent (agent/) that starts a job's workers
and spares on this node and watches them.

It checks its own arguments and the script's (a "preflight" run of the script with
DEADPOOL_PREFLIGHT=1, which must validate its flags and exit) before starting anything,
forwards SIGINT/SIGTERM to the agent, and returns the job's exit status: with --deadpool a
failure is hot-swapped, with --restart-policy full the job restarts from its newest
checkpoint, and otherwise it ends with one clear line when a worker dies. A worker that
refuses its input once running (status 2) ends the job the same way: it is not a failure.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import stat
import sys

from .agent.agent import RESTART, Agent
from .agent.joining import join
from .agent.mpi_spawn import mpi_unusable
from .agent.settings import LaunchSettings, preflight
from .agent.zygote import ENV_FORK_ZYGOTE
from .control.signed import ENV_JOB_SECRET, job_secret, new_secret
from .control.store import StoreUnreachable
from .errors import ConfigError, LaunchError
from .logging_setup import setup_logging
from .runtime import ENV_PREFLIGHT, finalize_mpi

log = logging.getLogger("deadpool.launch")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deadpool-launch",
        description="The agent of one node: start N workers and S spare processes of SCRIPT "
        "here (a spare node: N spares), host the job's TCPStore (node 0; with "
        "--deadpool-store etcd nobody does), watch them and the other nodes, and hot-swap "
        "failures. Run one per node, each with the same flags: the agents compare theirs "
        "and the script's before any process starts, and refuse (status 2) a job whose "
        "nodes differ.",
        epilog="Environment: DEADPOOL_JOB_SECRET signs what the job writes to its store (at "
        "least 16 characters, the same on every node; one node draws its own when unset); "
        "DEADPOOL_ETCD_PASSWORD is the password of --deadpool-etcd-user. Children get "
        "OMP_NUM_THREADS=1 (one intra-op thread each) and THP_MEM_ALLOC_ENABLE=1 (torch's "
        "large CPU allocations on transparent huge pages) unless the environment sets them.",
    )
    parser.add_argument("--nproc-per-node", type=int, required=True, metavar="N",
                        help="Worker processes on this node.")  # fmt: skip
    parser.add_argument("--spares", type=int, default=0, metavar="S",
                        help="Spare processes on this node (default: 0).")  # fmt: skip
    parser.add_argument("--nnodes", type=int, default=1,
                        help="Worker nodes in the job (default: 1); one agent runs on each.")  # fmt: skip
    parser.add_argument("--spare-nodes", type=int, default=0, metavar="M",
                        help="Spare nodes beyond --nnodes (default: 0): their agents start "
                        "--nproc-per-node spare processes each, and a lost worker node's ranks "
                        "move onto one of them together. Needs --deadpool.")  # fmt: skip
    parser.add_argument("--node-rank", type=int, default=None,
                        help="This node's index (default: this launcher's rank under mpirun, "
                        "else 0): 0 to NNODES-1 are worker nodes, NNODES to NNODES+M-1 spare "
                        "nodes.")  # fmt: skip
    parser.add_argument("--join", action="store_true",
                        help="Join the running job whose store --master-addr/--master-port "
                        "(or --deadpool-store etcd and --job-id) name, as one more spare node: "
                        "a fresh node refilling the spare nodes that lost nodes used up. "
                        "Give it every flag the job's nodes were given, except --node-rank: it "
                        "takes the next index past NNODES+M-1. Needs --deadpool and a job of "
                        "several nodes.")  # fmt: skip
    parser.add_argument("--master-addr", default="127.0.0.1",
                        help="Address of node 0, whose agent hosts the TCPStore (default: "
                        "127.0.0.1).")  # fmt: skip
    parser.add_argument("--master-port", type=int, default=0,
                        help="Store port on node 0; 0 picks a free one on a single node.")  # fmt: skip
    parser.add_argument("--job-id", default=None,
                        help="Job id, the same on every node (default: a random one, agreed "
                        "by the agents through the store; required with several nodes on "
                        "--deadpool-store etcd). In etcd, a finished job's keys are deleted; "
                        "an id whose keys another launch left there is refused.")  # fmt: skip
    parser.add_argument(
        "--restart-policy", choices=("hotswap", "full"), default="hotswap",
        help="What a failure costs. hotswap (default): a job with --deadpool recovers in place "
        "(a spare replaces a lost rank), falling back to a full restart only when that is "
        "impossible and --deadpool-on-unrecoverable says so; a job without --deadpool ends. "
        "full: checkpoint-restart, the baseline: stop every process, start the job again and "
        "load the newest complete checkpoint under --save.",
    )  # fmt: skip
    parser.add_argument("--max-restarts", type=int, default=10, metavar="N",
                        help="Full restarts allowed before the job gives up (default: 10).")  # fmt: skip
    parser.add_argument("--no-preflight", action="store_true",
                        help="Skip the argument check for a script that does not honour "
                        f"{ENV_PREFLIGHT}=1.")  # fmt: skip
    parser.add_argument("--no-fork-server", action="store_true",
                        help="Start every worker and spare with its own Python interpreter "
                        "(each imports torch and megatron-core itself) instead of forking it "
                        "from this node's fork server, which imports them once. The agent "
                        "falls back to this by itself where forking is unsafe (the imports "
                        "started threads or CUDA).")  # fmt: skip
    parser.add_argument("--mpi-spawn", action="store_true",
                        help="Start every worker and spare through MPI_Comm_spawn, each an MPI "
                        "job of its own (this launcher under mpirun --with-ft ulfm), so that "
                        "they can reach each other over MPI; implied by the script's "
                        "--deadpool-transport mpi.")  # fmt: skip
    parser.add_argument("--fork-zygote", default=os.environ.get(ENV_FORK_ZYGOTE, ""),
                        metavar="PATH",
                        help="Fork this node's fork server from the zygote listening at PATH "
                        "(python -m deadpool_megatron.agent.zygote --socket PATH, started "
                        "once per node), which has imported torch and megatron-core already, "
                        "so that the first child starts without waiting for those imports. "
                        "Where it is unreachable or refuses (another interpreter, other "
                        "preloads or import-time environment) the agent starts its own, and "
                        f"says why. Default: ${ENV_FORK_ZYGOTE}, else none.")  # fmt: skip
    parser.add_argument("script", help="Training script, e.g. pretrain_gpt.py.")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="Its arguments.")
    return parser


def _mpirun_rank() -> int:
    """This launcher's rank where mpirun started one per node, else 0."""
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", "")
    return int(rank) if rank.isdigit() else 0


def validate_launch_args(a: argparse.Namespace) -> None:
    if a.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node={a.nproc_per_node} must be at least 1")
    if a.spares < 0:
        raise ConfigError(f"--spares={a.spares} must be 0 or more")
    if a.nnodes < 1:
        raise ConfigError(f"--nnodes={a.nnodes} must be at least 1")
    if a.spare_nodes < 0:
        raise ConfigError(f"--spare-nodes={a.spare_nodes} must be 0 or more")
    nodes = a.nnodes + a.spare_nodes
    if a.join:
        if a.node_rank is not None:
            raise ConfigError(f"--node-rank={a.node_rank} with --join: a joining node takes "
                              f"the next free index past {nodes - 1} itself (drop --node-rank)")  # fmt: skip
        if nodes < 2:
            raise ConfigError(
                f"--join into a job of {nodes} node (--nnodes {a.nnodes} + --spare-nodes "
                f"{a.spare_nodes}): only a job launched on several nodes watches nodes' "
                "leases and has a store other nodes reach (launch it with --spare-nodes 1, say)"
            )
        if a.mpi_spawn:
            raise _no_join_over_mpi("--mpi-spawn")
    elif a.node_rank is None:
        a.node_rank = _mpirun_rank()
    if not a.join and not 0 <= a.node_rank < nodes:
        raise ConfigError(
            f"--node-rank={a.node_rank} must lie in [0, {nodes - 1}] "
            f"(--nnodes {a.nnodes} + --spare-nodes {a.spare_nodes})"
        )
    allocated = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES")
    if allocated and allocated.isdigit() and nodes > int(allocated) and not a.join:
        raise ConfigError(
            f"--nnodes {a.nnodes} + --spare-nodes {a.spare_nodes} = {nodes} nodes, but the "
            f"Slurm allocation has {allocated}; ask for fewer or allocate more (sbatch --nodes)"
        )
    if a.mpi_spawn and (reason := mpi_unusable()) is not None:
        raise ConfigError(reason)
    if (
        a.fork_zygote
        and os.path.exists(a.fork_zygote)
        and not stat.S_ISSOCK(os.stat(a.fork_zygote).st_mode)
    ):
        raise ConfigError(f"--fork-zygote={a.fork_zygote} is not a socket: give the --socket "
                          "PATH of a running zygote (python -m deadpool_megatron.agent.zygote)")  # fmt: skip
    if not 0 <= a.master_port < 65536:
        raise ConfigError(f"--master-port={a.master_port} must lie in [0, 65535]")
    if nodes > 1 and a.master_port == 0:
        raise ConfigError(
            "--master-port 0 (pick a free port) only works on one node; with several, pass "
            "the same free port to every node's agent"
        )
    if a.max_restarts < 0:
        raise ConfigError(f"--max-restarts={a.max_restarts} must be 0 or more")
    if not os.path.isfile(a.script):
        raise ConfigError(f"script {a.script!r} does not exist")
    if job_secret() is None and nodes > 1:
        raise ConfigError(
            f"--nnodes {a.nnodes} + --spare-nodes {a.spare_nodes} = {nodes} nodes need "
            f"{ENV_JOB_SECRET} set, to the same value on every node (it "
            "signs what the job writes to its store; the Slurm script draws one). By hand: "
            "export DEADPOOL_JOB_SECRET=$(python -c 'import secrets; "
            "print(secrets.token_hex(32))') before starting each node's agent"
        )


def _no_join_over_mpi(cause: str) -> ConfigError:
    return ConfigError(f"--join with {cause}: Open MPI joins processes only inside the mpirun "
                       "that started the job's launchers")  # fmt: skip


def validate_nodes(a: argparse.Namespace, settings: LaunchSettings, check_mpi: bool) -> None:
    """What only the script's flags tell: spare capacity the job could never use, and MPI's
    spawn where --deadpool-transport mpi implies it (`check_mpi`; an explicit --mpi-spawn was
    checked with the launcher's own flags)."""
    if a.join and check_mpi:  # before MPI's own check: no MPI set-up would make it work
        raise _no_join_over_mpi("--deadpool-transport mpi")
    if check_mpi and (reason := mpi_unusable()) is not None:
        raise ConfigError(reason)
    if a.spare_nodes and not settings.protection.deadpool:
        raise ConfigError(
            f"--spare-nodes {a.spare_nodes} without --deadpool: an unprotected job cannot "
            "hand a lost node's ranks to a spare node (add --deadpool, or drop the spare nodes)"
        )
    if a.spare_nodes and a.restart_policy == "full":
        raise ConfigError(
            f"--spare-nodes {a.spare_nodes} with --restart-policy full: a checkpoint-restart "
            "never uses spares (use --restart-policy hotswap, or drop the spare nodes)"
        )
    if a.join and not settings.protection.deadpool:
        raise ConfigError("--join without --deadpool: an unprotected job cannot hand a lost "
                          "node's ranks to a joined node (the job's nodes have --deadpool too)")  # fmt: skip
    if a.join and a.restart_policy == "full":
        raise ConfigError("--join with --restart-policy full: a checkpoint-restart never uses "
                          "spares (use --restart-policy hotswap)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("[launcher]")
    try:
        validate_launch_args(args)
    except ConfigError as err:
        print(f"deadpool-launch: error: {err}", file=sys.stderr)
        return ConfigError.exit_code
    if ENV_JOB_SECRET not in os.environ:  # one node: this launch draws the job's secret
        os.environ[ENV_JOB_SECRET] = new_secret()
    settings = LaunchSettings()
    if not args.no_preflight:
        world_size = args.nnodes * args.nproc_per_node
        rc, settings = preflight(args.script, args.script_args, world_size, args.spares)
        if rc != 0:
            return rc
        implied = not args.mpi_spawn and settings.protection.deadpool_transport == "mpi"
        args.mpi_spawn = args.mpi_spawn or implied
        try:
            validate_nodes(args, settings, check_mpi=implied)
        except ConfigError as err:
            print(f"deadpool-launch: error: {err}", file=sys.stderr)
            return ConfigError.exit_code
    if args.join:
        try:
            args.node_rank, args.job_id = join(args, settings.protection, settings.flags)
        except (StoreUnreachable, ConfigError, LaunchError) as err:
            print(f"deadpool-launch: error: {err}", file=sys.stderr)
            return 1 if isinstance(err, LaunchError) else ConfigError.exit_code
    agent = Agent(args, settings)
    signal.signal(signal.SIGINT, agent.signals.note)
    signal.signal(signal.SIGTERM, agent.signals.note)
    try:
        agent.host_store()
    except (StoreUnreachable, ConfigError, LaunchError) as err:
        print(f"deadpool-launch: error: {err}", file=sys.stderr)
        agent.close()  # its progress boards
        return 1 if isinstance(err, LaunchError) else ConfigError.exit_code
    rc = 1
    try:
        agent.start()
        while True:
            rc = agent.watch()
            if rc != RESTART:
                return rc
    finally:
        agent.close()
        # Under mpirun (--mpi-spawn): a rank that exits without MPI_Finalize makes mpirun end
        # the other nodes' launchers; one whose peer launcher was lost can wait in it for
        # ever, so it exits with its status after 10 s.
        finalize_mpi(rc, timeout_s=10.0)


if __name__ == "__main__":
    sys.exit(main())
