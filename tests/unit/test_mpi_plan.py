"""The MPI transport's pure parts: the order ranks join their ring's edges (no deadlock for
any ring size and replica count), port names, the ports a recovery's abort must spare, and
how the agent reads a spawned child's end (tests/multiproc/test_mpi_transport.py runs them
for real under mpirun)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from deadpool_megatron.agent.mpi_spawn import SpawnedProcess, mpi_unusable, read_status, this_node
from deadpool_megatron.checkpoint.mpi_transport import (
    PORT_BYTES,
    connect_plan,
    decode_port,
    encode_port,
)
from deadpool_megatron.control.client import mpi_ports
from deadpool_megatron.topology import Topology


def _run(plans: dict[int, list[tuple[str, int, int]]]) -> set[tuple[int, int, int]]:
    """Carry the plans out as MPI would: a connect and the matching accept (same pair, same
    distance) complete together; everything else waits. Returns the edges made; raises if
    the ranks deadlock."""
    at = dict.fromkeys(plans, 0)
    edges = set()
    while any(at[r] < len(plans[r]) for r in plans):
        moved = False
        for r, plan in plans.items():
            if at[r] >= len(plan) or plan[at[r]][0] != "connect":
                continue
            _, dst, h = plan[at[r]]
            if at[dst] < len(plans[dst]) and plans[dst][at[dst]] == ("accept", r, h):
                at[r] += 1
                at[dst] += 1
                edges.add((r, dst, h))
                moved = True
        if not moved:
            stuck = {r: plans[r][at[r]] for r in plans if at[r] < len(plans[r])}
            raise AssertionError(f"deadlock: {stuck}")
    return edges


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 8, 9])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_every_ring_joins_its_edges_without_deadlock(n, k):
    topo = Topology(n, 1, 1)
    ring = topo.ring(0)
    edges = _run({r: connect_plan(ring, r, k) for r in ring})
    expected = {(r, s) for r in ring for s in topo.ring_successors(r, k)}
    assert {(a, b) for a, b, _ in edges} == expected
    for r in ring:  # each rank accepts exactly its predecessors
        assert sorted(p for _, p, _ in (s for s in connect_plan(ring, r, k) if s[0] == "accept")) \
            == sorted(topo.ring_predecessors(r, k))  # fmt: skip


def test_a_ring_of_other_ranks_in_its_own_order():
    ring = [7, 3, 11]
    edges = _run({r: connect_plan(ring, r, 1) for r in ring})
    assert {(a, b) for a, b, _ in edges} == {(7, 3), (3, 11), (11, 7)}


def test_port_names_round_trip_at_a_fixed_length():
    port = "2453667841.0:2155282474"
    raw = encode_port(port)
    assert len(raw) == PORT_BYTES and decode_port(raw) == port
    with pytest.raises(ValueError, match="at most 1023"):
        encode_port("x" * PORT_BYTES)


def test_the_abort_spares_the_pmix_server_and_mpi_s_own_tcp_ports():
    env = {
        "PMIX_SERVER_URI41": "prterun-vm-14956@0.0;tcp4://127.0.0.1:37707",
        "PMIX_SERVER_URI2": "prterun-vm-14956@0.0;tcp6://[::1]:40001",
        "OMPI_MCA_btl_tcp_port_min_v4": "27000", "OMPI_MCA_btl_tcp_port_range_v4": "3",
        "MASTER_PORT": "29500",
    }  # fmt: skip
    assert mpi_ports(env) == {37707, 40001, 27000, 27001, 27002}
    assert mpi_ports({}) == set()


def test_the_mpi_transport_is_refused_outside_mpirun():
    reason = mpi_unusable({})
    assert reason is not None and "mpirun" in reason and "--with-ft ulfm" in reason
    under = mpi_unusable({"OMPI_COMM_WORLD_SIZE": "1"})  # under mpirun: mpi4py is what counts
    assert under is None if importlib.util.find_spec("mpi4py") else "setup_mpi.sh" in under


def test_a_spawned_child_s_status_comes_from_its_file_or_is_a_kill(tmp_path):
    status = tmp_path / "status"
    code = f"open({str(status)!r}, 'w').write('4'); import time; time.sleep(0.3)"
    child = subprocess.Popen([sys.executable, "-c", code])
    seen = SpawnedProcess(child.pid, None, str(status))
    with pytest.raises(subprocess.TimeoutExpired):
        seen.wait(0.05)
    assert seen.wait(30) == 4 and seen.poll() == 4
    assert not status.exists()  # read once, then removed
    child.wait()
    killed = subprocess.Popen([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"])
    assert SpawnedProcess(killed.pid, None, str(tmp_path / "none")).wait(30) == -9
    killed.wait()
    assert read_status(str(tmp_path / "none")) == -9


def test_children_are_spawned_on_this_node_by_its_name_in_the_allocation():
    assert this_node("vm", {"SLURMD_NODENAME": "nid001234"}) == "nid001234"
    assert this_node("vm", {}) == "vm"
