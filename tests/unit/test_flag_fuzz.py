"""Bad flags, fuzzed over combinations: pretrain_gpt.py and deadpool-launch either accept the
command line or end with exit status 2 and one message naming a flag or value that was given;
never a traceback, never a second message."""

from __future__ import annotations

import argparse
import contextlib
import io
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from deadpool_megatron import launch
from deadpool_megatron.errors import ConfigError
from deadpool_megatron.megatron.arguments import build_parser, parse_job_args

ROOT = Path(__file__).resolve().parents[2]
DEMO = ["--config", str(ROOT / "configs" / "demo.yaml")]
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

INTS = st.one_of(st.integers(-3, 70), st.sampled_from([10**9, -(10**9), 2**31]))
FLOATS = st.one_of(
    st.floats(-2.0, 2.0), st.sampled_from([math.nan, math.inf, -math.inf, 0.0, 1.0, 1e30])
)
JUNK = st.sampled_from(["", "x", "-1", "1.5", "nan", "/nonexistent/path", "kill@", "a b"])


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest not in ("help", "config")]


def _value(action: argparse.Action) -> st.SearchStrategy[list[str]]:
    """The tokens for one flag: its name and a value of its type, or junk."""
    name = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        return st.sampled_from([[name], [f"--no-{name[2:]}"]])
    if action.nargs == 0:  # store_true
        return st.just([name])
    if action.choices:
        good = st.sampled_from(list(action.choices)).map(str)
    elif action.type is int:
        good = INTS.map(str)
    elif action.type is float:
        good = FLOATS.map(repr)
    else:
        good = JUNK
    values = st.lists(st.one_of(good, JUNK), min_size=1, max_size=2)
    if action.nargs not in ("*", "+"):
        values = st.one_of(good, JUNK).map(lambda v: [v])
    return values.map(lambda v: [name, *v])


def _command_lines(parser: argparse.ArgumentParser) -> st.SearchStrategy[list[str]]:
    flags = st.sampled_from(_options(parser)).flatmap(_value)
    return st.lists(flags, min_size=1, max_size=4).map(lambda parts: sum(parts, []))


def _named(message: str, argv: list[str], extra: tuple[str, ...] = ()) -> bool:
    tokens = {t for t in argv if t} | {t.split("=")[0] for t in argv if t.startswith("--")}
    return any(t in message for t in tokens | set(extra))


def _outcome(call) -> tuple[int, str]:
    """(0 or the exit status, what was printed as the error)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            call()
        except ConfigError as e:
            return ConfigError.exit_code, str(e)
        except SystemExit as e:  # argparse's own errors: usage, then one error line
            return e.code, err.getvalue()
    return 0, ""


@FUZZ
@given(argv=_command_lines(build_parser()), world=st.sampled_from([1, 2, 3, 4, 6, 8, 16]))
def test_pretrain_gpt_flags_are_accepted_or_refused_with_one_message(argv, world):
    code, message = _outcome(lambda: parse_job_args([*DEMO, *argv], world))
    if code == 0:
        return
    assert code == 2, (argv, code, message)
    errors = [line for line in message.splitlines() if line.strip()]
    if "usage:" in message:  # argparse: one usage line block, then one error line
        errors = [line for line in errors if "error:" in line]
    assert len(errors) == 1, (argv, message)
    assert _named(message, argv, (f"world size {world}", f"size is {world}")), (argv, message)


def _launch(argv: list[str]) -> None:
    args = launch.build_parser().parse_args(argv)
    launch.validate_launch_args(args)


@FUZZ
@given(argv=_command_lines(launch.build_parser()))
@example(argv=["--nproc-per-node", "1", "--spare-nodes", "1", "--master-port", "1"])  # found once
def test_launcher_flags_are_accepted_or_refused_with_one_message(argv):
    argv = [*argv, str(ROOT / "pretrain_gpt.py")]
    code, message = _outcome(lambda: _launch(argv))
    if code == 0:
        return
    assert code == 2, (argv, code, message)
    errors = [line for line in message.splitlines() if "error:" in line or "usage:" not in message]
    assert len([e for e in errors if e.strip()]) == 1, (argv, message)
    flags = tuple(o for a in _options(launch.build_parser()) for o in a.option_strings)
    assert _named(message, argv, flags), (argv, message)  # a default it conflicts with, too


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_floats_are_refused_by_name(value):
    code, message = _outcome(lambda: parse_job_args([*DEMO, "--lr", value], 8))
    assert code == 2 and "--lr" in message, message
