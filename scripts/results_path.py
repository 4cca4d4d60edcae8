"""The benchmarks' `--out FILE.json`, checked before any job runs: a run of several minutes
must not end unable to write its results; and the PNG beside it."""

from __future__ import annotations

import argparse
import os
import sys


def results_file(value: str) -> str:
    """argparse `type=`: a JSON file to (over)write, beside which the PNG of the same name goes."""
    if os.path.isdir(value):
        raise argparse.ArgumentTypeError(
            f"{value!r} is a directory; give the results' file, e.g. {os.path.join(value, 'out.json')}"
        )
    return value


def pyplot():
    """matplotlib's pyplot drawing to files only, or None (said on stderr) where matplotlib is
    not installed: the results' JSON is written either way."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    return plt
