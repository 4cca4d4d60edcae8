"""Store keys: every key of a job lies under the prefixes its last agent deletes in etcd, and
names the store uses for itself are no job's."""

import inspect

import pytest

from deadpool_megatron.control import keys
from deadpool_megatron.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

JOB = "slurm-42"
ARGS = {"generation": 3, "rank": 5, "node": 1, "count": 2, "spare_id": "spare-0",
        "fault": "kill@1:4", "launch": "host:29500", "point": "4:forward"}  # fmt: skip


def _job_keys() -> dict[str, str]:
    """Every key function whose first argument is a job (or the job a restart started as)."""
    made = {}
    for name, fn in inspect.getmembers(keys, inspect.isfunction):
        params = list(inspect.signature(fn).parameters)
        if name.startswith("_") or not params or params[0] not in ("job", "scope"):
            continue
        made[name] = fn(JOB, *(ARGS[p] for p in params[1:]))
    return made


def test_every_key_of_a_job_is_under_the_prefixes_deleted_when_it_finishes():
    made = _job_keys()
    assert {"membership", "launch", "training_end", "restart", "agents_left"} <= set(made)
    prefixes = (keys.job_prefix(JOB), keys.process_groups_prefix(JOB))
    for name, key in made.items():
        if name in ("job_prefix", "process_groups_prefix", "restarted_job"):
            continue  # prefixes and a job id, not keys
        if name == "process_group_prefix":
            key = keys.C10D_ROOT + key + "/"
        assert key.startswith(prefixes), (name, key)
    # A restart's keys are its own job's: deleted with the prefixes of keys.restarted_job.
    restarted = keys.restarted_job(JOB, 2)
    assert keys.membership(restarted).startswith(keys.job_prefix(restarted))
    assert not keys.job_prefix(restarted).startswith(keys.job_prefix(JOB))


@pytest.mark.parametrize("job", ["c10d", "launch"])
def test_the_stores_own_names_are_refused_as_job_ids(job):
    # deadpool/c10d/ holds every job's rendezvous: deleting a job called c10d would take them.
    with pytest.raises(ConfigError, match=f"job id '{job}' is reserved"):
        keys.membership(job)


@pytest.mark.parametrize("job", ["", "a/b", " a"])
def test_malformed_job_ids_are_refused(job):
    with pytest.raises(ConfigError, match="must be non-empty"):
        keys.job_prefix(job)
