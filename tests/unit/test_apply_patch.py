"""scripts/apply_megatron_patch.sh picks the series by the checkout's release, and changes
nothing where it has none or where a patch does not apply."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _checkout(tmp_path: Path, minor: int, patch: int) -> Path:
    """A folder shaped like a Megatron-LM checkout (not a git one) of release 0.MINOR.PATCH."""
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    (tmp_path / "megatron" / "training").mkdir()
    (tmp_path / "megatron" / "core" / "package_info.py").write_text(
        f'MAJOR = 0\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = ""\n'
    )
    (tmp_path / "pretrain_gpt.py").write_text("print('not the release')\n")
    (tmp_path / "megatron" / "training" / "training.py").write_text("\n")
    return tmp_path


def _apply(checkout: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "apply_megatron_patch.sh"), str(checkout)],
        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin",
                                                         "PYTHON": sys.executable},
    )  # fmt: skip


@pytest.mark.parametrize(("minor", "patch", "series"), [(16, 1, "core_v0.16.1"),
                                                         (17, 1, "core_v0.17.1"),
                                                         (18, 2, "core_v0.18.2"),
                                                         (19, 1, "core_v0.19.0")])  # fmt: skip
def test_the_series_is_the_one_of_the_checkouts_release(tmp_path, minor, patch, series):
    # core_v0.19.0's package says 0.19.1: its series names that in package_version
    checkout = _checkout(tmp_path, minor, patch)
    done = _apply(checkout)
    assert done.returncode == 1
    assert "does not apply: 0001-pretrain_gpt-run-pretrain-under-deadpool.patch" in done.stderr
    assert f"differs from Megatron-LM {series} where the hooks go" in done.stderr
    assert (checkout / "pretrain_gpt.py").read_text() == "print('not the release')\n"


def test_a_release_without_a_series_is_refused_naming_those_with_one(tmp_path):
    done = _apply(_checkout(tmp_path, 18, 0))
    assert done.returncode == 1
    assert (
        "is Megatron-LM core_v0.18.0; patches exist for: core_v0.16.1 core_v0.17.1 core_v0.18.2 "
        "core_v0.19.0" in done.stderr
    )
