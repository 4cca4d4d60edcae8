"""The metrics file keeps every execution of a replayed iteration."""

from deadpool_megatron.metrics import MetricsWriter, read_executions, read_metrics


def test_a_replayed_iteration_keeps_every_execution_in_order(tmp_path):
    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(str(path))
    for iteration, loss in [(1, 2.5), (2, 2.25), (2, 2.0), (3, 1.5)]:
        writer.iteration(iteration, loss, 10.0)
    writer.final(3, "abc")
    writer.close()
    assert read_executions(str(path)) == {
        1: [float.hex(2.5)],
        2: [float.hex(2.25), float.hex(2.0)],
        3: [float.hex(1.5)],
    }
    losses, final = read_metrics(str(path))
    assert losses[2] == float.hex(2.0) and final["state_digest"] == "abc"  # the last one wins


def test_every_execution_must_equal_the_failure_free_loss():
    from deadpool_megatron.metrics import every_execution_equal

    base = {1: "0x1.0p+1", 2: "0x1.8p+0"}
    assert every_execution_equal({1: ["0x1.0p+1"], 2: ["0x1.8p+0", "0x1.8p+0"]}, base)
    assert not every_execution_equal({1: ["0x1.0p+1"], 2: ["0x1.9p+0", "0x1.8p+0"]}, base)
    assert not every_execution_equal({1: ["0x1.0p+1"]}, base)  # an iteration missing
