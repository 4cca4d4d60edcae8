"""Jobs of Megatron-LM's own pretrain_gpt.py, patched (patches/), under deadpool-launch on
CPU/gloo: the checkout they run in, the model they train, how they are launched.

Needs a Megatron-LM checkout (git clone https://github.com/NVIDIA/Megatron-LM) named by
MEGATRON_LM_DIR, and the Python modules its pretrain_gpt.py imports (six, regex, pydantic,
pybind11, triton); the tests skip, saying why, without them. They run the release TAG
(MEGATRON_LM_TAG: one with a series under patches/); test_megatron_lm_v019.py runs core_v0.19
beside it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deadpool_megatron.metrics import read_metrics
from jobs import JOB_TIMEOUT_S, ROOT

sys.path.insert(0, str(ROOT / "scripts"))

from bench_megatron_lm import python_first  # noqa: E402

TAGS = sorted(p.name.removeprefix("megatron-lm-") for p in (ROOT / "patches").glob("megatron-lm-*"))
TAG = os.environ.get("MEGATRON_LM_TAG", "core_v0.16.1")


def release(tag: str = TAG) -> tuple[int, ...]:
    """A release tag as numbers to compare: core_v0.18.2 -> (0, 18, 2)."""
    return tuple(int(n) for n in tag.removeprefix("core_v").split("."))


# core_v0.18/0.19 megatron.training imports typing.override (Python 3.12): on 3.11 the tests put
# typing_extensions' backport in its place (tests/py311/sitecustomize.py)
BACKPORTS = ROOT / "tests" / "py311"
# A small GPT on Megatron-LM's mock data, every CUDA-only fusion off, 4 ranks as PP2 x DP2;
# dropout at Megatron-LM's default (0.1): on CPU its masks come from the generator that the
# data loaders draw from (upstream.data_iterators_for_hot_swaps).
MODEL = shlex.split(
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8 --train-iters 12 "
    "--lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 --split 100,0,0 "
    "--distributed-backend gloo --transformer-impl local --no-gradient-accumulation-fusion "
    "--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion "
    "--no-persist-layer-norm --use-cpu-initialization --use-distributed-optimizer "
    "--eval-iters 0 --eval-interval 1000 "
    "--log-interval 1 --pipeline-model-parallel-size 2 --deadpool "
    "--deadpool-heartbeat-interval 0.5 --deadpool-heartbeat-timeout 2.0"
)
NEEDED = ("six", "regex", "pydantic", "pybind11", "triton")
DP4 = ["--pipeline-model-parallel-size", "1"]  # after MODEL's: the same job as DP4


def patched_checkout(tmp_path_factory, tag: str = TAG) -> Path:
    """MEGATRON_LM_DIR's `tag` cloned and patched in a temporary folder (the checkout itself
    is not touched); skips, saying why, without one or without the modules it needs."""
    if tag not in TAGS:
        raise ValueError(f"MEGATRON_LM_TAG={tag!r}: patches exist for {TAGS}")
    source = os.environ.get("MEGATRON_LM_DIR")
    if not source:
        pytest.skip(
            "MEGATRON_LM_DIR is not set: this test needs a Megatron-LM checkout "
            f"(git clone https://github.com/NVIDIA/Megatron-LM; tag {tag})"
        )
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"Megatron-LM's pretrain_gpt.py needs modules missing here: {missing}")
    checkout = tmp_path_factory.mktemp(f"megatron-lm-{tag}") / "Megatron-LM"
    is_git = subprocess.run(["git", "-C", source, "rev-parse", "--git-dir"],
                            capture_output=True).returncode == 0  # fmt: skip
    if is_git:  # a clone, or a bare mirror
        subprocess.run(["git", "clone", "-q", "--branch", tag, source, str(checkout)], check=True)
    else:
        shutil.copytree(source, checkout)
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "apply_megatron_patch.sh"), str(checkout)],
        capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "applied: 0002-training-deadpool-hooks.patch" in done.stdout
    return checkout


def job_env(checkout: Path) -> dict[str, str]:
    """What a process of `checkout`'s Megatron-LM needs in its environment: this interpreter
    first on PATH (python_first), and on PYTHONPATH the project and the backports its
    Megatron-LM needs of this Python (core_v0.18's and core_v0.19's typing.override on 3.11)."""
    models = (checkout / "megatron" / "training" / "models").glob("*.py")
    needs = sys.version_info < (3, 12) and any(
        re.search(r"^from typing import .*\boverride\b", m.read_text(), re.M) for m in models
    )
    return {"PYTHONPATH": os.pathsep.join([str(BACKPORTS)] * needs + [str(ROOT)]),
            "PATH": python_first(checkout.parent)}  # fmt: skip


def launch(
    checkout: Path, tmp_path: Path, name: str, extra: list[str], spares: int = 1,
    model: list[str] = MODEL, env: dict[str, str] | None = None, prefix: tuple[str, ...] = (),
    nproc: int = 4,
) -> tuple[int, str]:  # fmt: skip
    """deadpool-launch runs the job (output under tmp_path/NAME.log): exit status, output.
    `prefix`: what starts the launcher (mpirun ...)."""
    cmd = [
        *prefix, sys.executable, "-m", "deadpool_megatron.launch", "--nproc-per-node", str(nproc),
        "--spares", str(spares), "pretrain_gpt.py", *model,
        "--deadpool-metrics-jsonl", str(tmp_path / f"{name}.jsonl"), *extra,
    ]  # fmt: skip
    # Megatron-LM's check for tensor parallel reads this one: set by the tests that need it
    run_env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    run_env.update(job_env(checkout), **(env or {}))
    done = subprocess.run(cmd, cwd=checkout, env=run_env, capture_output=True, text=True,
                          timeout=2 * JOB_TIMEOUT_S)  # fmt: skip
    output = done.stdout + done.stderr
    (tmp_path / f"{name}.log").write_text(output)
    return done.returncode, output


def run(
    checkout: Path, tmp_path: Path, name: str, extra: list[str], **how
) -> tuple[dict, dict, str]:
    """The job, which must succeed: its per-iteration losses, final record, output."""
    returncode, output = launch(checkout, tmp_path, name, extra, **how)
    assert returncode == 0, output[-6000:]
    losses, final = read_metrics(str(tmp_path / f"{name}.jsonl"))
    return losses, final, output


def printed_lines(output: str) -> dict[int, str]:
    """Megatron-LM's iteration lines by iteration (the last printed), without their time."""
    lines = {}
    for line in re.findall(r"\] iteration +\d+/.*", output):
        iteration = int(re.search(r"iteration +(\d+)/", line).group(1))
        lines[iteration] = re.sub(r"elapsed time per iteration \(ms\): [0-9.]+ \|", "", line)
    return lines
