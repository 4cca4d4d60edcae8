"""Do the members of one job see the same thing: every rank the same checkpoint, every node's
agent the same launch? Pure comparisons of what each member reported, which name who saw
what. Every member compares the same reports, so every one raises the same error, and none
goes on alone into a collective the others never join."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from .errors import CheckpointError, ConfigError

# Flags that may differ between nodes: where a node writes its own logs, keeps its caches, or
# finds its own credentials. Every other flag shapes the training every rank takes part in.
PER_NODE_FLAGS = frozenset({
    "metrics_jsonl", "deadpool_event_log", "data_cache_path",
    "deadpool_etcd_cacert", "deadpool_etcd_cert", "deadpool_etcd_key",
})  # fmt: skip

# deadpool-launch's own flags that every node must be given alike.
LAUNCH_SHAPE = ("script", "nnodes", "spare_nodes", "nproc_per_node", "spares",
                "restart_policy", "max_restarts")  # fmt: skip


def spans(ids: Sequence[int]) -> str:
    """`[0, 1, 2, 5]` -> "0-2, 5"."""
    out: list[str] = []
    ordered = sorted(set(ids))
    start = prev = None
    for i in [*ordered, None]:
        if start is not None and (i is None or i != prev + 1):
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if i is not None and start is None:
            start = i
        prev = i
    return ", ".join(out)


def who_saw_what(seen: Mapping[int, Hashable], noun: str, show: Callable[[Any], str] = str) -> str:
    """ "ranks 0-3: 10; rank 4: none", grouped by value in the order values first appear."""
    groups: dict[Hashable, list[int]] = {}
    for member in sorted(seen):
        groups.setdefault(seen[member], []).append(member)
    return "; ".join(
        f"{noun}{'s' if len(members) > 1 else ''} {spans(members)}: {show(value)}"
        for value, members in groups.items()
    )


def agreed_checkpoint(root: str, found: Sequence[int | str | None]) -> int | None:
    """The iteration of the checkpoint under --load `root` that every rank found (None: no
    rank found one), given each rank's finding in rank order: an iteration, None for none,
    or the error it met. Raises CheckpointError, the same on every rank, otherwise."""
    errors = {e for e in found if isinstance(e, str)}
    if len(set(found)) == 1:
        if errors:
            raise CheckpointError(errors.pop())
        return found[0]
    if len(errors) == 1 and all(isinstance(e, str) for e in found):
        raise CheckpointError(errors.pop())

    def show(value: int | str | None) -> str:
        if value is None:
            return "no checkpoint"
        return f"iteration {value}" if isinstance(value, int) else value

    raise CheckpointError(
        f"the ranks found different checkpoints under --load {root}: "
        f"{who_saw_what(dict(enumerate(found)), 'rank', show)}. Every rank must read the same "
        "directory: --load must lie on storage every node shares, and no other job may save there"
    )


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def launch_differences(launches: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """One line per setting the nodes' agents were given differently ("--train-iters: node 0:
    14; node 1: 20"), from each node's launch: deadpool-launch's shape (`LAUNCH_SHAPE`) and,
    under "flags", the training script's parsed flags (None where the script told none:
    launched with --no-preflight, or a script that does not answer it). Flags in
    `PER_NODE_FLAGS` may differ."""
    lines = []

    def compare(name: str, values: Mapping[int, Any]) -> None:
        shown = {node: repr(value) for node, value in values.items()}
        if len(set(shown.values())) > 1:
            lines.append(f"{name}: {who_saw_what(shown, 'node')}")

    for key in LAUNCH_SHAPE:
        name = "the script" if key == "script" else f"deadpool-launch {flag_name(key)}"
        compare(name, {n: launch.get(key) for n, launch in launches.items()})
    told = {n: launch["flags"] for n, launch in launches.items() if launch.get("flags") is not None}
    for name in sorted({name for flags in told.values() for name in flags} - PER_NODE_FLAGS):
        compare(flag_name(name), {n: flags.get(name) for n, flags in told.items()})
    return lines


def refuse_unlike_launches(
    launches: Mapping[int, Mapping[str, Any]], joining: int | None = None
) -> None:
    """Raise ConfigError naming every difference between the nodes' launches (`joining`: the
    node among them that would join the running job, compared with the launched ones)."""
    lines = launch_differences(launches)
    if not lines:
        return
    if joining is None:
        what = f"the job's {len(launches)} nodes were launched with different settings"
    else:
        what = (f"node {joining}, joining the job, was launched unlike its "
                f"{len(launches) - 1} launched node(s)")  # fmt: skip
    raise ConfigError(
        f"{what}; give every node the same deadpool-launch and training flags (the training "
        "flags as each node's script parsed them, defaults included):\n  " + "\n  ".join(lines)
    )
