"""deadpool-report EVENT_LOG: the job's failures and recoveries as a table and a picture.

The picture has one lane per rank and per spare (faults, detections, fencings, claims, with
every recovery shaded across all lanes), one stacked bar per recovery (its phases), and, given
the run's metrics file and its failure-free twin's, the loss of every execution of every
iteration beside the twin's."""

from __future__ import annotations

import argparse
import os
import sys

from .events import (
    FAILURE_DETECTED,
    FAULT_INJECTED,
    FENCED,
    RECOVERY_DONE,
    RECOVERY_PHASE,
    RECOVERY_STARTED,
    SPARE_CLAIMED,
    SPARE_LOST,
    SPARE_STARTED,
    read_events,
)
from .metrics import every_execution_equal, read_executions, read_metrics

MARKERS = {FAULT_INJECTED: ("v", "tab:red"), FAILURE_DETECTED: ("x", "black"),
           FENCED: ("s", "tab:purple"), SPARE_CLAIMED: ("^", "tab:green"),
           SPARE_STARTED: ("+", "tab:blue"), SPARE_LOST: ("*", "tab:gray")}  # fmt: skip


def timeline_rows(events: list[dict]) -> list[tuple[str, ...]]:
    """Pure: one row per event, times relative to the first event."""
    if not events:
        return []
    t0 = min(e["time"] for e in events)
    rows = []
    for e in sorted(events, key=lambda e: e["time"]):
        details = {
            k: v
            for k, v in e.items()
            if k not in ("time", "event", "generation", "rank") and v is not None
        }
        detail = ", ".join(
            f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in details.items()
        )
        rank = "-" if e.get("rank") is None else str(e["rank"])
        rows.append(
            (f"{e['time'] - t0:9.3f}", e["event"], str(e.get("generation", 0)), rank, detail)
        )
    return rows


def recovery_summaries(events: list[dict]) -> list[dict]:
    """Pure: one summary per finished recovery, with its phases in the order they ran."""
    out, phases = [], {}
    for e in sorted(events, key=lambda e: e["time"]):
        if e["event"] == RECOVERY_PHASE:
            phases.setdefault(e["generation"], {})[e["phase"]] = e["duration_s"]
        elif e["event"] == RECOVERY_DONE:
            out.append({**e, "phases": phases.get(e["generation"], {})})
    return out


def format_recoveries(summaries: list[dict]) -> str:
    lines = []
    for r in summaries:
        replaced = ", ".join(f"rank {k} -> {v}" for k, v in r["replaced"].items()) or "in place"
        lines.append(
            f"recovery into generation {r['generation']} ({replaced}): {r['total_s']:.2f} s from "
            f"the failure to the first resumed iteration, {r['replayed_iterations']} "
            f"iteration(s) re-executed, {r['bytes_moved'] / 2**20:.2f} MiB moved; "
            + ", ".join(f"{k} {v:.3f} s" for k, v in r["phases"].items())
        )
    return "\n".join(lines)


def format_table(rows: list[tuple[str, ...]]) -> str:
    header = ("t (s)", "event", "gen", "rank", "details")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    lines = []
    for r in [header, *rows]:
        cells = [r[i].ljust(widths[i]) for i in range(4)]
        lines.append("  ".join([*cells, r[4]]))
    return "\n".join(lines)


def lanes(events: list[dict]) -> dict[str, list[tuple[float, str]]]:
    """Pure: lane name ("rank N", "spare K") -> (seconds since the first event, event) for
    the events the picture marks, ranks first, in number order."""
    if not events:
        return {}
    t0 = min(e["time"] for e in events)
    out: dict[tuple[int, int], list[tuple[float, str]]] = {}
    for e in sorted(events, key=lambda e: e["time"]):
        if e["event"] not in MARKERS:
            continue
        if e["event"] == SPARE_CLAIMED:  # in the lane of the rank the spare takes
            key = (0, int(e["replaces"]))
        elif e["event"] in (SPARE_STARTED, SPARE_LOST) or e.get("spare") is not None:
            key = (1, int(str(e["spare"]).rsplit("-", 1)[-1]))
        elif isinstance(e.get("rank"), int):
            key = (0, e["rank"])
        else:
            continue
        out.setdefault(key, []).append((e["time"] - t0, e["event"]))
    return {f"{'rank' if k[0] == 0 else 'spare'} {k[1]}": out[k] for k in sorted(out)}


def recovery_windows(events: list[dict]) -> list[tuple[float, float, int]]:
    """Pure: (start, end, generation) of every finished recovery, from its order to its first
    resumed iteration, in seconds since the first event."""
    if not events:
        return []
    t0 = min(e["time"] for e in events)
    started = {e["generation"]: e["time"] for e in events if e["event"] == RECOVERY_STARTED}
    windows = []
    for e in events:
        if e["event"] == RECOVERY_DONE and e["generation"] in started:
            windows.append((started[e["generation"]] - t0, e["time"] - t0, e["generation"]))
    return sorted(windows)


def plot_report(
    events: list[dict],
    path: str,
    runs: dict[int, list[str]] | None = None,
    baseline: dict[int, str] | None = None,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = lanes(events)
    summaries = recovery_summaries(events)
    panels = 1 + bool(summaries) + bool(runs)
    heights = (
        [1.0 + 0.35 * max(len(rows), 1)]
        + [0.6 + 0.3 * len(summaries)] * bool(summaries)
        + [2.6] * bool(runs)
    )
    fig, axes = plt.subplots(panels, 1, figsize=(12.5, sum(heights) + 0.8),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)  # fmt: skip
    axes = list(axes[:, 0])
    ax = axes.pop(0)
    for start, end, generation in recovery_windows(events):
        ax.axvspan(start, end, color="tab:orange", alpha=0.2)
        ax.text(start, len(rows) - 0.4, f"g{generation}", fontsize=7)
    for y, marks in enumerate(rows.values()):
        ax.axhline(y, color="0.9", lw=0.8, zorder=0)
        for event, (marker, color) in MARKERS.items():
            xs = [t for t, e in marks if e == event]
            if xs:
                ax.scatter(xs, [y] * len(xs), marker=marker, color=color, s=60, label=event)
    handles = {h.get_label(): h for h in ax.collections}
    ax.legend(handles.values(), handles.keys(), fontsize=7, loc="upper left",
              bbox_to_anchor=(1.0, 1.0))  # fmt: skip
    ax.set_yticks(range(len(rows)), list(rows))
    ax.set_ylim(-0.7, len(rows) + 0.2)
    ax.set_xlabel("seconds since the first event (shaded: a recovery, order to first iteration)")
    ax.set_title("deadpool-megatron: failures and recoveries")
    if summaries:
        ax = axes.pop(0)
        names = list(dict.fromkeys(k for r in summaries for k in r["phases"]))
        colors = plt.get_cmap("tab20")(range(len(names)))
        for y, r in enumerate(summaries):
            left = 0.0
            for name, color in zip(names, colors, strict=True):
                width = r["phases"].get(name, 0.0)
                ax.barh(y, width, left=left, color=color, label=name if y == 0 else None)
                left += width
        ax.set_yticks(range(len(summaries)), [f"g{r['generation']}" for r in summaries])
        ax.set_xlabel("recovery phases (s)")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if runs:
        ax = axes.pop(0)
        if baseline:
            its = sorted(baseline)
            ax.plot(its, [float.fromhex(baseline[i]) for i in its], color="0.6", lw=3,
                    label="failure-free twin")  # fmt: skip
        first = sorted(runs)
        ax.plot(first, [float.fromhex(runs[i][0]) for i in first], ".", color="tab:blue",
                label="this run")  # fmt: skip
        replays = [(i, float.fromhex(x)) for i in first for x in runs[i][1:]]
        if replays:
            ax.plot(*zip(*replays, strict=True), "o", mfc="none", color="tab:red",
                    label="re-executed after a failure")  # fmt: skip
        equal = baseline is not None and every_execution_equal(runs, baseline)
        ax.set_title(f"loss per iteration; bitwise equal to the twin: {'yes' if equal else 'no'}"
                     if baseline else "loss per iteration", fontsize=9)  # fmt: skip
        ax.set_xlabel("iteration")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deadpool-report", description=__doc__)
    parser.add_argument("event_log", help="JSON-lines file written with --deadpool-event-log")
    parser.add_argument("--png", default=None, help="the picture (default: EVENT_LOG.png)")
    parser.add_argument("--metrics", default=None,
                        help="the run's --metrics-jsonl file: its losses go in the picture")  # fmt: skip
    parser.add_argument("--baseline", default=None,
                        help="the failure-free twin's --metrics-jsonl, drawn beside them")  # fmt: skip
    args = parser.parse_args(argv)
    for what in (args.event_log, args.metrics, args.baseline):
        if what is not None and not os.path.isfile(what):
            print(f"deadpool-report: error: {what!r} does not exist", file=sys.stderr)
            return 2
    events = read_events(args.event_log)
    if not events:
        print(f"deadpool-report: {args.event_log} holds no events")
        return 0
    print(format_table(timeline_rows(events)))
    recoveries = format_recoveries(recovery_summaries(events))
    if recoveries:
        print(recoveries)
    png = args.png or args.event_log.rsplit(".", 1)[0] + ".png"
    runs = read_executions(args.metrics) if args.metrics else None
    baseline = read_metrics(args.baseline)[0] if args.baseline else None
    plot_report(events, png, runs, baseline)
    print(f"picture: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
