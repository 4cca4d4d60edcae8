"""Command-line flags and YAML job files, derived mechanically from config.py's dataclasses:
one flag per field (``num_layers`` -> ``--num-layers``) with the field's help text, and the
merge defaults < config file < command line."""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from typing import Any

from .config import CONFIG_GROUPS, JobConfig
from .errors import ConfigError


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(annotation: Any) -> type:
    """`int | None` -> int, `list[str]` -> str."""
    if isinstance(annotation, str):
        annotation = eval(annotation, vars(typing), {})  # annotations are postponed strings
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is list:
        return args[0]
    if args:
        return args[0]
    return annotation


_METAVARS = {int: "N", float: "X", str: "STR"}


def add_config_flags(
    parser: argparse.ArgumentParser, groups: tuple[str, ...] | None = None
) -> None:
    """Add one flag per field of every config group (or of `groups`), with its help text."""
    for group_name, cls in CONFIG_GROUPS.items():
        if groups is not None and group_name not in groups:
            continue
        group = parser.add_argument_group(group_name)
        for f in dataclasses.fields(cls):
            meta = f.metadata
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            kind = _base_type(f.type)
            if kind is bool:
                group.add_argument(
                    _flag(f.name),
                    action=argparse.BooleanOptionalAction,
                    default=None,
                    help=f"{meta['help']} (default: {default})",
                )
                continue
            group.add_argument(
                _flag(f.name),
                type=kind,
                default=None,
                choices=meta["choices"],
                nargs=meta["nargs"],
                metavar=_METAVARS.get(kind, "STR") if meta["choices"] is None else None,
                help=f"{meta['help']} (default: {default})",
            )


def load_config_file(path: str) -> dict[str, Any]:
    """Read a YAML job file: a flat mapping of flag names (dashes or underscores) to values."""
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(
            f"--config {path!r}: no such file; pass a YAML file such as configs/demo.yaml"
        )
    with open(path) as fh:
        raw = yaml.safe_load(fh) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path!r}: expected a mapping of flag names to values")
    known = {f.name for cls in CONFIG_GROUPS.values() for f in dataclasses.fields(cls)}
    out = {}
    for key, value in raw.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in known:
            raise ConfigError(
                f"--config {path!r}: unknown key {key!r}; keys are flag names, e.g. num-layers"
            )
        out[name] = value
    return out


def build_job_config(
    ns: argparse.Namespace, file_values: dict[str, Any] | None = None
) -> JobConfig:
    """Merge defaults < config file < command line into a JobConfig."""
    file_values = file_values or {}
    groups = {}
    for group_name, cls in CONFIG_GROUPS.items():
        kwargs = {}
        for f in dataclasses.fields(cls):
            cli = getattr(ns, f.name, None)
            if cli is not None:
                kwargs[f.name] = cli
            elif f.name in file_values:
                value = file_values[f.name]
                kind = _base_type(f.type)
                if isinstance(value, list) or value is None:
                    kwargs[f.name] = value
                elif kind is list or typing.get_origin(f.type) is list:
                    kwargs[f.name] = [value]
                else:
                    kwargs[f.name] = kind(value)
        groups[group_name] = cls(**kwargs)
    return JobConfig(**groups)
