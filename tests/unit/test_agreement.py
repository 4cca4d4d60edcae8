"""What the ranks, and the nodes' agents, compare before they go on: each one's own view in,
one verdict out, the same on every member, naming who saw what."""

import pytest

from deadpool_megatron.agreement import (
    agreed_checkpoint,
    launch_differences,
    refuse_unlike_launches,
    spans,
)
from deadpool_megatron.errors import CheckpointError, ConfigError

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "ids, text",
    [([], ""), ([3], "3"), ([0, 1, 2, 5], "0-2, 5"), ([7, 1, 0, 8, 0], "0-1, 7-8")],
)
def test_members_are_named_in_spans(ids, text):
    assert spans(ids) == text


@pytest.mark.parametrize("found, iteration", [([10, 10, 10], 10), ([None, None], None)])
def test_ranks_that_found_the_same_checkpoint_load_it(found, iteration):
    assert agreed_checkpoint("/ckpt", found) == iteration


def test_one_error_every_rank_met_is_raised_as_it_is():
    with pytest.raises(CheckpointError, match=r"^/ckpt/t names iteration 5 but .* is missing$"):
        agreed_checkpoint("/ckpt", ["/ckpt/t names iteration 5 but /ckpt/i5 is missing"] * 4)


def test_ranks_that_found_different_checkpoints_are_all_refused_with_who_found_what():
    found = [10, 10, None, 10, "cannot read /ckpt/t", 5]
    with pytest.raises(CheckpointError) as refused:
        agreed_checkpoint("/ckpt", found)
    text = str(refused.value)
    assert text.startswith("the ranks found different checkpoints under --load /ckpt: ")
    assert ("ranks 0-1, 3: iteration 10; rank 2: no checkpoint; rank 4: cannot read /ckpt/t; "
            "rank 5: iteration 5.") in text  # fmt: skip
    assert "storage every node shares" in text


def _launch(node_flags=None, **shape):
    base = {"script": "pretrain_gpt.py", "nnodes": 2, "spare_nodes": 1, "nproc_per_node": 4,
            "spares": 1, "restart_policy": "hotswap", "max_restarts": 10}  # fmt: skip
    flags = {"train_iters": 14, "lr": 0.003, "data_path": ["1", "a"], "metrics_jsonl": "m"}
    flags.update(node_flags or {})
    return {**base, **shape, "flags": flags}


def test_alike_launches_pass_though_each_node_writes_its_own_logs():
    launches = {0: _launch(), 1: _launch({"metrics_jsonl": "n", "deadpool_event_log": "e"})}
    assert launch_differences(launches) == []
    refuse_unlike_launches(launches)


def test_every_difference_is_one_line_naming_each_nodes_value():
    launches = {
        0: _launch(),
        1: _launch({"train_iters": 20, "data_path": ["1", "b"]}, spares=2),
        2: _launch({"train_iters": 20}),
    }
    assert launch_differences(launches) == [
        "deadpool-launch --spares: nodes 0, 2: 1; node 1: 2",
        "--data-path: nodes 0, 2: ['1', 'a']; node 1: ['1', 'b']",
        "--train-iters: node 0: 14; nodes 1-2: 20",
    ]
    with pytest.raises(ConfigError, match=r"job's 3 nodes were launched with different settings"):
        refuse_unlike_launches(launches)


def test_a_node_whose_script_told_no_flags_is_compared_by_its_launch_alone():
    told_none = {**_launch(), "flags": None}
    assert launch_differences({0: _launch(), 1: told_none}) == []
    assert launch_differences({0: _launch(), 1: {**told_none, "script": "other.py"}}) == [
        "the script: node 0: 'pretrain_gpt.py'; node 1: 'other.py'"
    ]
