"""What the agent acts on, learnt from the training script's own flags: deadpool-launch runs the
script once with DEADPOOL_PREFLIGHT=1, which validates its flags (bad input ends here, with one
message, before any process starts) and writes the settings the agent needs."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from ..config import DeadpoolConfig, ParallelConfig
from ..failure.inject import parse_faults
from ..runtime import ENV_PREFLIGHT, ENV_PREFLIGHT_OUT, ENV_SPARES

PREFLIGHT_TIMEOUT_S = 120


@dataclass(frozen=True)
class LaunchSettings:
    """The workers' own DeadpoolConfig (one definition, one default per knob), plus the job's
    shape and checkpoint directories."""

    protection: DeadpoolConfig = field(default_factory=DeadpoolConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    save: str | None = None
    load: str | None = None
    flags: dict | None = None  # every flag of the script as it parsed them; None: not told

    @classmethod
    def from_preflight(cls, d: dict) -> LaunchSettings:
        names = {f.name for f in dataclasses.fields(DeadpoolConfig)}
        return cls(
            protection=DeadpoolConfig(**{k: v for k, v in d.items() if k in names}),
            parallel=ParallelConfig(**d.get("parallel", {})),
            save=d.get("save"),
            load=d.get("load"),
            flags=d.get("flags"),
        )

    @property
    def on_unrecoverable(self) -> str:
        return self.protection.deadpool_on_unrecoverable or "stop"

    def spare_kills(self) -> list:
        return [f for f in parse_faults(self.protection.deadpool_inject or "") if f.on_spare]


def preflight(script: str, script_args: list[str], world_size: int, spares: int):
    """(exit status, settings): run the script once to check its flags and learn settings."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "settings.json")
        env = dict(os.environ, WORLD_SIZE=str(world_size))
        env.update({ENV_PREFLIGHT: "1", ENV_PREFLIGHT_OUT: out, ENV_SPARES: str(spares)})
        done = subprocess.run(
            [sys.executable, script, *script_args],
            env=env, capture_output=True, text=True, timeout=PREFLIGHT_TIMEOUT_S,
        )  # fmt: skip
        if done.returncode != 0:
            sys.stderr.write(done.stderr or done.stdout)
            return done.returncode, LaunchSettings()
        if not os.path.exists(out):  # a script that does not honour the preflight
            return 0, LaunchSettings()
        with open(out) as fh:
            return 0, LaunchSettings.from_preflight(json.load(fh))
