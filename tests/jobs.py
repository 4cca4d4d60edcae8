"""Run real jobs through deadpool-launch, as a user would, and read what they leave behind."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from deadpool_megatron.agent.forks import ForkServer
from deadpool_megatron.agent.forkserver import server_env, worker_defaults
from deadpool_megatron.agent.zygote import ENV_FORK_ZYGOTE
from deadpool_megatron.metrics import read_executions, read_metrics

ROOT = Path(__file__).resolve().parents[1]
JOB_TIMEOUT_S = 300
SIGNIFICANT = re.compile(r" (WARNING|ERROR|CRITICAL) |Traceback|Error\b|Exception\b|\] +File ")


@dataclass
class JobResult:
    returncode: int
    output: str
    losses: dict[int, str]
    final: dict | None
    executions: dict[int, list[str]] = field(default_factory=dict)  # every run of an iteration

    @property
    def digest(self) -> str | None:
        return self.final["state_digest"] if self.final else None

    def failure(self, limit: int = 8000) -> str:
        """What a failed job's output says about why: its warning, error and traceback lines
        from the first (a spare's crash is otherwise scrolled away by the survivors' echoes of
        it), then the output's end, `limit` characters at most in all."""
        marked = [line[:240] for line in self.output.splitlines() if SIGNIFICANT.search(line)]
        head = "\n".join(marked)[: limit // 2]  # the first ones: the cause comes before its echoes
        tail = self.output[-(limit - len(head)) :]
        return f"{len(marked)} warning/error line(s), the first:\n{head}\n--- output's end:\n{tail}"


def launch_cmd(
    nproc: int,
    args: list[str],
    spares: int = 0,
    launcher: list[str] | None = None,
    script: Path = ROOT / "pretrain_gpt.py",
) -> list[str]:
    return [
        sys.executable, "-m", "deadpool_megatron.launch",
        "--nproc-per-node", str(nproc), "--spares", str(spares), *(launcher or []),
        str(script), *args,
    ]  # fmt: skip


def torchrun_cmd(nproc: int, args: list[str], max_restarts: int) -> list[str]:
    """The restart path users know: torchrun restarts every process after a failure."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
        str(ROOT / "pretrain_gpt.py"), *args,
    ]  # fmt: skip


def run_job(
    tmp_path: Path,
    nproc: int,
    args: list[str],
    spares: int = 0,
    name: str = "run",
    launcher: list[str] | None = None,
    script: Path = ROOT / "pretrain_gpt.py",
    env: dict[str, str] | None = None,
    torchrun_restarts: int | None = None,
    prefix: list[str] | None = None,
) -> JobResult:
    """Run a job to completion (bounded by JOB_TIMEOUT_S) and parse its metrics file; `env`:
    variables set for the launcher on top of this process's; `torchrun_restarts`: launched
    by torchrun with that many restarts instead of deadpool-launch; `prefix`: what starts the
    launcher (mpirun ...)."""
    metrics = tmp_path / f"{name}.jsonl"
    argv = [*args, "--metrics-jsonl", str(metrics)]
    proc = subprocess.Popen(
        [*(prefix or []), *launch_cmd(nproc, argv, spares, launcher, script)]
        if torchrun_restarts is None else torchrun_cmd(nproc, argv, torchrun_restarts),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the launcher forwards it to every process it started
        out, err = proc.communicate(timeout=30)
        (tmp_path / f"{name}.log").write_text(out + err)
        raise AssertionError(
            f"job timed out after {JOB_TIMEOUT_S} s:\n{(out + err)[-6000:]}"
        ) from None
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    (tmp_path / f"{name}.log").write_text(done.stdout + done.stderr)
    return _result(done.returncode, done.stdout + done.stderr, metrics)


def run_failure_free(
    tmp_path_factory, folder: str, nproc: int, args: list[str], name: str = "baseline"
) -> JobResult:
    """The failure-free run a test's recovered jobs are compared with, bit for bit (in a
    fresh folder named after `folder`); it must succeed."""
    result = run_job(tmp_path_factory.mktemp(folder), nproc, args, name=name)
    assert result.returncode == 0, result.failure()
    return result


def run_job_and_kill(
    tmp_path: Path,
    nproc: int,
    args: list[str],
    victim_rank: int | None,
    after_iteration: int,
    signum: int = signal.SIGKILL,
    spares: int = 0,
    when_logged: str | None = None,
) -> tuple[JobResult, int, float]:
    """Start a job, send `signum` to worker `victim_rank` (None: the launcher) from outside
    once `after_iteration` is logged (or, given `when_logged`, once a line holding it is);
    returns the result, the victim's pid and the wall time of the signal."""
    metrics = tmp_path / "killed.jsonl"
    proc = subprocess.Popen(
        launch_cmd(nproc, [*args, "--metrics-jsonl", str(metrics)], spares),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    victim_pid = proc.pid if victim_rank is None else None
    signalled_at = None
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        for line in proc.stdout:
            lines.append(line)
            if f"started worker rank {victim_rank} " in line:
                victim_pid = int(line.rsplit("pid ", 1)[1].split(")")[0])
            if victim_pid and when_logged is not None:
                if when_logged in line:
                    signalled_at = time.time()
                    os.kill(victim_pid, signum)
                    break
            elif victim_pid and metrics.exists():
                losses, _ = read_metrics(str(metrics))
                if after_iteration in losses:
                    signalled_at = time.time()
                    os.kill(victim_pid, signum)
                    break
            if time.monotonic() > deadline:
                raise TimeoutError("the job never reached the kill point")
        rest, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
        lines.append(rest)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    (tmp_path / "killed.log").write_text("".join(lines))
    return _result(proc.returncode, "".join(lines), metrics), victim_pid, signalled_at


class Drivers:
    """Starts the drivers of tests/drivers (each a rank of a small torch.distributed job of its
    own) as forks of one fork server (agent/forkserver.py) for the whole session, forked from
    the session's zygote where there is one: a driver started as `python driver.py` imported
    torch and megatron-core itself, 4-8 CPU-seconds each here, most of a short test's time. A
    forked driver runs as that command would (its argv, environment, folder first on its path;
    the fork server's own tests show it), with the workers' defaults (one intra-op thread)."""

    def __init__(self):
        zygote = os.environ.get(ENV_FORK_ZYGOTE, "")
        self._forks = ForkServer(server_env(os.environ), zygote=zygote, output=lambda line: None)

    def run(self, driver: Path, argvs: list[list[str]], timeout_s: float) -> list[dict]:
        """Run one driver per argv at once and return, in order, the last JSON object each
        printed; a driver that fails or outlives `timeout_s` fails the test with its output."""
        env = worker_defaults(dict(os.environ))
        procs = [self._forks.spawn([str(driver), *argv], env, str(ROOT)) for argv in argvs]
        outputs: list[list[bytes]] = [[] for _ in procs]
        readers = [threading.Thread(target=lambda p=p, o=o: o.append(p.stdout.read()), daemon=True)
                   for p, o in zip(procs, outputs, strict=True)]  # fmt: skip
        for reader in readers:
            reader.start()
        deadline, late = time.monotonic() + timeout_s, set()
        try:
            for proc in procs:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    late.add(proc.pid)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)  # a session of its own
                    proc.wait(10)
            for reader in readers:
                reader.join(10)
        outs = []
        for proc, output in zip(procs, outputs, strict=True):
            text = b"".join(output).decode(errors="replace")
            why = f"still running after {timeout_s} s" if proc.pid in late else "failed"
            assert proc.returncode == 0, f"{driver.name} {why} ({proc.returncode}):\n{text[-3000:]}"
            outs.append(_last_json(text))
        return outs

    def close(self) -> None:
        self._forks.close()


def run_script(name: str, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`python scripts/NAME ARGV...` as a user runs it, stdout and stderr captured apart."""
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *argv],
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def _last_json(text: str) -> dict:
    """A driver's stdout and stderr share one pipe: its result is the last line that is a JSON
    object (stderr may have written after it)."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                return json.loads(line)
    raise AssertionError(f"no JSON object in the driver's output:\n{text[-3000:]}")


def _result(returncode: int, output: str, metrics: Path) -> JobResult:
    if not metrics.exists():
        return JobResult(returncode, output, {}, None)
    losses, final = read_metrics(str(metrics))
    return JobResult(returncode, output, losses, final, read_executions(str(metrics)))
