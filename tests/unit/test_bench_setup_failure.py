"""scripts/bench_setup_failure.py: bad input refused before any job runs, and the two
strategies' commands (the same job and fault; a spare and --deadpool for the hot-swap, a
restart from --save for the baseline)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from jobs import ROOT

sys.path.insert(0, str(ROOT / "scripts"))

import bench_setup_failure as bench  # noqa: E402


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--victim", "4"], "--victim 4 must be a rank in [0, 3]"),
        (["--nproc", "3"], "--nproc 3 must be 2 or more and divisible by --pp 2"),
        (["--repeats", "0"], "--repeats 0 and --iters 10 must be 1 or more"),
    ],
)
def test_bad_input_is_refused_before_any_job(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        bench.parse_args(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_both_strategies_run_the_same_job_and_fault():
    a = bench.parse_args(["--victim", "2"])
    hotswap = bench._command(a, "hotswap", True, Path("/w"))
    restart = bench._command(a, "ckpt_restart", True, Path("/w"))
    assert "kill@2:0:setup" in hotswap and "kill@2:0:setup" in restart
    assert "--deadpool" in hotswap and hotswap[hotswap.index("--spares") + 1] == "1"
    assert restart[restart.index("--restart-policy") + 1] == "full" and "--save" in restart
    free = bench._command(a, "hotswap", False, Path("/w"))
    assert "--deadpool-inject" not in free

    def flags(command):
        return command[command.index("pretrain_gpt.py") + 1 :]

    job = flags(free)[:-1]  # the failure-free job's flags, without --deadpool
    assert flags(hotswap)[: len(job)] == job == flags(restart)[: len(job)]


@pytest.mark.parametrize("phase", ["groups", "launch"])
def test_the_phase_names_where_the_victim_is_killed(phase):
    a = bench.parse_args(["--phase", phase])
    assert f"kill@1:0:{phase}" in bench._command(a, "hotswap", True, Path("/w"))
    with pytest.raises(SystemExit):
        bench.parse_args(["--phase", "forward"])
