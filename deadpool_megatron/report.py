"""deadpool-report EVENT_LOG: the job's failures and recoveries as a timeline table and PNG."""

from __future__ import annotations

import argparse
import sys

from .events import FAILURE_DETECTED, RECOVERY_DONE, RECOVERY_PHASE, read_events


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


def plot_timeline(events: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(e["time"] for e in events)
    names = sorted({e["event"] for e in events})
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.45 * len(names)))
    for y, name in enumerate(names):
        xs = [e["time"] - t0 for e in events if e["event"] == name]
        ax.scatter(xs, [y] * len(xs), marker="|" if name != FAILURE_DETECTED else "x", s=200)
        for e in events:
            if e["event"] == name and e.get("rank") is not None:
                ax.annotate(f"r{e['rank']}", (e["time"] - t0, y), textcoords="offset points",
                            xytext=(3, 6), fontsize=7)  # fmt: skip
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("seconds since the first event")
    ax.set_title("deadpool-megatron event timeline")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deadpool-report", description=__doc__)
    parser.add_argument("event_log", help="JSON-lines file written with --deadpool-event-log")
    parser.add_argument("--png", default=None, help="timeline picture (default: EVENT_LOG.png)")
    args = parser.parse_args(argv)
    try:
        events = read_events(args.event_log)
    except FileNotFoundError:
        print(f"deadpool-report: error: {args.event_log!r} does not exist", file=sys.stderr)
        return 2
    if not events:
        print(f"deadpool-report: {args.event_log} holds no events")
        return 0
    print(format_table(timeline_rows(events)))
    recoveries = format_recoveries(recovery_summaries(events))
    if recoveries:
        print(recoveries)
    png = args.png or args.event_log.rsplit(".", 1)[0] + ".png"
    plot_timeline(events, png)
    print(f"timeline picture: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
