"""What the agent starts its children with: the launcher <-> process contract of runtime.py."""

from __future__ import annotations

import json

from deadpool_megatron.agent.children import Children, Launch
from deadpool_megatron.runtime import ROLE_SPARE, ROLE_WORKER, ProcessEnv


def test_workers_and_spares_learn_their_node_and_slot(tmp_path, capfd):
    # A spare's slot on its node is its device, and tells which ranks it builds for while idle
    # (recovery/placement.py's prebuild_targets): it gets LOCAL_RANK as a worker does.
    script = tmp_path / "env.py"
    script.write_text(
        "import json, os\n"
        "keys = ['RANK', 'LOCAL_RANK', 'GROUP_RANK', 'LOCAL_WORLD_SIZE', 'DEADPOOL_SPARE_INDEX']\n"
        "print('ENV', json.dumps({k: os.environ.get(k) for k in keys}), flush=True)\n"
    )
    children = Children(Launch(str(script), (), "127.0.0.1", 6, 2, node=1, fork_server=False))
    try:
        for child in (
            children.spawn(ROLE_WORKER, 3, 1, {}),
            children.spawn(ROLE_SPARE, 2, 2, {}),  # node 1's first spare, after its 2 workers
        ):
            assert child.proc.wait(60) == 0
            child.pump.join(10)
    finally:
        children.close()
    out = capfd.readouterr().out
    seen = {
        line.split("] ")[0]: json.loads(line.split("ENV ", 1)[1])
        for line in out.splitlines()
        if "ENV " in line
    }
    assert seen["[worker 3"] == {"RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1",
                                      "LOCAL_WORLD_SIZE": "2", "DEADPOOL_SPARE_INDEX": None}  # fmt: skip
    spare = seen["[spare 2"]
    assert spare == {"RANK": None, "LOCAL_RANK": "2", "GROUP_RANK": "1",
                     "LOCAL_WORLD_SIZE": "2", "DEADPOOL_SPARE_INDEX": "2"}  # fmt: skip
    env = ProcessEnv.from_environ({**{k: v for k, v in spare.items() if v}, "WORLD_SIZE": "6"})
    assert (env.node, env.local_rank, env.spare_index) == (1, 2, 2)
