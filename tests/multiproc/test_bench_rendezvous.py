"""scripts/bench_rendezvous.py in its short form: real processes build generation 0's groups
both ways (torch's blocking store gets, and the stoppable store's polls); bad input is refused
before any process starts."""

from __future__ import annotations

import json

import pytest

from jobs import run_script

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

SCRIPT = "bench_rendezvous.py"


def test_both_ways_build_the_groups_and_the_last_line_compares_them():
    done = run_script(SCRIPT, "--nproc", "2", "--tp", "1", "--pp", "1", "--rounds", "2",
                      timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["nproc"] == 2 and result["rounds"] == 2
    assert result["blocking_s"] > 0 and result["stoppable_s"] > 0
    assert result["ratio"] == pytest.approx(result["stoppable_s"] / result["blocking_s"], abs=2e-3)


@pytest.mark.parametrize(
    "argv, message",
    [(["--nproc", "6"], "--nproc 6 must be 2 or more and divisible by --tp 2 x --pp 2"),
     (["--rounds", "0"], "--rounds 0, --tp 2 and --pp 2 must be 1 or more")],
)  # fmt: skip
def test_bad_input_is_refused_before_any_process(argv, message):
    done = run_script(SCRIPT, *argv)
    assert done.returncode == 2 and message in done.stderr
