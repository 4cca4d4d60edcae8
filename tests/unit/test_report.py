"""The event log and deadpool-report: lines from several writers, a table, a picture."""

import json

import pytest

from deadpool_megatron.events import FAILURE_DETECTED, FENCED, EventLog, read_events
from deadpool_megatron.report import (
    format_recoveries,
    format_table,
    main,
    recovery_summaries,
    timeline_rows,
)


def test_two_writers_append_whole_lines(tmp_path):
    path = str(tmp_path / "events.jsonl")
    launcher, worker = EventLog(path), EventLog(path, rank=3, generation=lambda: 1)
    launcher.emit(FENCED, at=10.5, rank=3, pid=42)
    worker.emit("fault_injected", at=10.0, fault="hang@3:5")
    launcher.close()
    worker.close()
    events = read_events(path)
    assert [e["event"] for e in events] == [FENCED, "fault_injected"]
    assert events[1] == {"time": 10.0, "event": "fault_injected", "generation": 1, "rank": 3,
                         "fault": "hang@3:5"}  # fmt: skip


def test_table_is_relative_to_the_first_event_and_sorted():
    events = [
        {"time": 12.25, "event": FAILURE_DETECTED, "generation": 0, "rank": 3, "kind": "permanent",
         "detect_latency_s": 0.0625},
        {"time": 12.0, "event": "fault_injected", "generation": 0, "rank": 3, "fault": "kill@3:5"},
    ]  # fmt: skip
    rows = timeline_rows(events)
    assert [r[1] for r in rows] == ["fault_injected", FAILURE_DETECTED]
    assert rows[1][0].strip() == "0.250" and "detect_latency_s=0.062" in rows[1][4]
    table = format_table(rows)
    assert table.splitlines()[0].split()[:4] == ["t", "(s)", "event", "gen"]


def test_report_cli_writes_a_png_and_names_a_missing_file(tmp_path, capsys):
    path = tmp_path / "e.jsonl"
    path.write_text(
        "\n".join(json.dumps(e) for e in [
            {"time": 1.0, "event": "fault_injected", "generation": 0, "rank": 1},
            {"time": 1.2, "event": FAILURE_DETECTED, "generation": 0, "rank": 1},
        ]) + "\n"
    )  # fmt: skip
    assert main([str(path)]) == 0
    png = tmp_path / "e.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "failure_detected" in capsys.readouterr().out
    assert main([str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl' does not exist" in capsys.readouterr().err


def test_recovery_summary_lists_phases_in_order():
    events = [
        {"time": 1.0, "event": "recovery_phase", "generation": 1, "rank": None,
         "phase": "detect", "duration_s": 0.05},
        {"time": 1.0, "event": "recovery_phase", "generation": 1, "rank": None,
         "phase": "transfer_state", "duration_s": 0.02},
        {"time": 1.1, "event": "recovery_done", "generation": 1, "rank": None, "total_s": 0.6,
         "replayed_iterations": 1, "bytes_moved": 2**20, "replaced": {"3": "spare-0"}},
    ]  # fmt: skip
    (summary,) = recovery_summaries(events)
    assert list(summary["phases"]) == ["detect", "transfer_state"]
    text = format_recoveries([summary])
    assert text.startswith("recovery into generation 1 (rank 3 -> spare-0): 0.60 s")
    assert "1 iteration(s) re-executed, 1.00 MiB moved; detect 0.050 s" in text


def test_lanes_put_each_event_on_its_rank_or_spare_and_recoveries_are_windows():
    from deadpool_megatron.report import lanes, recovery_windows

    events = [
        {"time": 10.0, "event": "fault_injected", "generation": 0, "rank": 3},
        {"time": 10.5, "event": "fault_injected", "generation": 0, "spare": 1, "rank": None},
        {"time": 10.2, "event": FAILURE_DETECTED, "generation": 0, "rank": 3},
        {"time": 10.3, "event": "recovery_started", "generation": 1, "rank": None},
        {"time": 10.4, "event": "spare_claimed", "generation": 1, "spare": "spare-0",
         "replaces": 3, "rank": None},
        {"time": 11.3, "event": "recovery_done", "generation": 1, "rank": None},
        {"time": 12.0, "event": "spare_started", "generation": 1, "spare": 2, "rank": None},
        {"time": 12.5, "event": "heartbeat", "generation": 1, "rank": 0},  # not marked
    ]  # fmt: skip
    got = lanes(events)
    assert list(got) == ["rank 3", "spare 1", "spare 2"]
    assert [e for _, e in got["rank 3"]] == ["fault_injected", FAILURE_DETECTED, "spare_claimed"]
    assert [t for t, _ in got["rank 3"]] == pytest.approx([0.0, 0.2, 0.4])
    assert got["spare 1"] == [(0.5, "fault_injected")]
    windows = recovery_windows(events)
    assert len(windows) == 1 and windows[0][2] == 1
    assert windows[0][0] == pytest.approx(0.3) and windows[0][1] == pytest.approx(1.3)


def test_report_draws_the_loss_beside_the_failure_free_twin(tmp_path, capsys):
    events = tmp_path / "e.jsonl"
    events.write_text(json.dumps({"time": 1.0, "event": "fault_injected", "generation": 0,
                                  "rank": 1}) + "\n")  # fmt: skip
    losses = [2.5, 2.25, 2.0]
    lines = [json.dumps({"iteration": i + 1, "lm_loss_hex": x.hex()}) for i, x in enumerate(losses)]
    (tmp_path / "run.jsonl").write_text("\n".join([*lines, lines[1]]) + "\n")  # 2 re-executed
    (tmp_path / "twin.jsonl").write_text("\n".join(lines) + "\n")
    png = tmp_path / "p.png"
    assert main([str(events), "--png", str(png), "--metrics", str(tmp_path / "run.jsonl"),
                 "--baseline", str(tmp_path / "twin.jsonl")]) == 0  # fmt: skip
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([str(events), "--metrics", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl' does not exist" in capsys.readouterr().err
