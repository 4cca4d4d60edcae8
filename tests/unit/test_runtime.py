"""What a training process reads of its environment: deadpool-launch's contract, and torchrun's
(the restart baseline), whose store outlives a restart."""

from __future__ import annotations

from deadpool_megatron.runtime import ENV_JOB_ID, ENV_ROLE, ProcessEnv

TORCHRUN = {
    "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
}  # fmt: skip


def test_each_torchrun_attempt_meets_under_a_job_id_of_its_own():
    first = ProcessEnv.from_environ(TORCHRUN)
    again = ProcessEnv.from_environ({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert (first.restart_count, again.restart_count) == (0, 1)
    assert first.job_id != again.job_id and "none" in first.job_id
    assert not first.under_launcher and first.master_port == 29500


def test_rank_0_hosts_the_store_only_when_torchrun_does_not_share_its_own():
    assert not ProcessEnv.from_environ({**TORCHRUN, "RANK": "0"}).hosts_store
    unshared = {**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "False"}
    assert ProcessEnv.from_environ({**unshared, "RANK": "0"}).hosts_store
    assert not ProcessEnv.from_environ(unshared).hosts_store  # rank 3 connects


def test_deadpool_launch_names_the_job_and_hosts_the_store():
    env = ProcessEnv.from_environ({**TORCHRUN, ENV_JOB_ID: "abc", ENV_ROLE: "worker"})
    assert env.job_id == "abc" and env.under_launcher and not env.hosts_store
    plain = ProcessEnv.from_environ({})
    assert (plain.job_id, plain.rank, plain.world_size, plain.restart_count) == ("local", 0, 1, 0)
