"""scripts/bench_teardown.py's short form: a real child touches memory, kills itself, and the
gap to its reaping is reported for each size, in the order asked, in pages of 4 KiB and in
huge pages, for one block of memory and for torch tensors of 0.5 MiB; and when the exit was
first seen decided in /proc, never after the reaping."""

from __future__ import annotations

import sys

import pytest

from jobs import ROOT

sys.path.insert(0, str(ROOT / "scripts"))

import bench_teardown  # noqa: E402


def test_each_size_gets_a_measured_gap_in_both_page_sizes():
    result = bench_teardown.main(["--mib", "8,64", "--repeats", "1"])
    assert result["mib"] == [8, 64]
    for key in ("exit_seen_ms", "exit_seen_ms_huge", "exit_seen_ms_small",
                "exit_seen_ms_small_huge", "exit_decided_ms", "exit_decided_ms_huge"):  # fmt: skip
        assert len(result[key]) == 2 and all(ms >= 0 for ms in result[key])
    for decided, seen in zip(result["exit_decided_ms"], result["exit_seen_ms"], strict=True):
        assert decided <= seen


@pytest.mark.parametrize("bad", ["0", "x", "8,-1"])
def test_bad_sizes_are_refused_before_anything_runs(bad, capsys):
    with pytest.raises(SystemExit):
        bench_teardown.main(["--mib", bad])
    assert "--mib" in capsys.readouterr().err
