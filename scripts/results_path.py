"""The benchmarks' `--out FILE.json`, checked before any job runs: a run of several minutes
must not end unable to write its results."""

from __future__ import annotations

import argparse
import os


def results_file(value: str) -> str:
    """argparse `type=`: a JSON file to (over)write, beside which the PNG of the same name goes."""
    if os.path.isdir(value):
        raise argparse.ArgumentTypeError(
            f"{value!r} is a directory; give the results' file, e.g. {os.path.join(value, 'out.json')}"
        )
    return value
