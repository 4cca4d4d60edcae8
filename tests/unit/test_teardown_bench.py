"""scripts/bench_teardown.py's short form: a real child touches memory, kills itself, and the
gap to its reaping is reported for each size, in the order asked, in pages of 4 KiB and in
huge pages."""

from __future__ import annotations

import sys

import pytest

from jobs import ROOT

sys.path.insert(0, str(ROOT / "scripts"))

import bench_teardown  # noqa: E402


def test_each_size_gets_a_measured_gap_in_both_page_sizes():
    result = bench_teardown.main(["--mib", "8,64", "--repeats", "1"])
    assert result["mib"] == [8, 64]
    for key in ("exit_seen_ms", "exit_seen_ms_huge"):
        assert len(result[key]) == 2 and all(ms >= 0 for ms in result[key])


@pytest.mark.parametrize("bad", ["0", "x", "8,-1"])
def test_bad_sizes_are_refused_before_anything_runs(bad, capsys):
    with pytest.raises(SystemExit):
        bench_teardown.main(["--mib", bad])
    assert "--mib" in capsys.readouterr().err
