"""Launch pool workers as real processes, with a hard timeout, and kill all they left.

Two launchers:

* ``torchrun``: ``python -m torch.distributed.run --standalone`` with N workers, the
  way users start a pool;
* ``direct``: N plain worker processes with the environment torchrun would give
  them, around a rendezvous store this test process hosts. Failure tests use it
  because torchrun's agent terminates the surviving workers as soon as one exits
  with an error, and the point there is what each survivor raises on its own.

Every worker writes its pid to ``pid<rank>`` first thing; after the run (finished,
failed or timed out) the launcher kills each process group it started and every
recorded pid still alive, then reports which pids had still been running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("pool_worker.py")


@dataclass
class Run:
    returncodes: list[int | None]
    output: str
    ranks: dict[int, dict[str, Any]]
    leftover: list[int]  # pids still running when the run ended (then killed)
    started: float
    ended: float
    failed_at: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers signal 0; it is not running.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _spawn(cmd: list[str], out: Path, log: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """Start ``cmd`` in a session of its own, its output to ``out/log`` (a file, not a
    pipe: a chatty worker must never block on a full pipe buffer)."""
    with (out / log).open("w") as f:
        return subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )


def _collect(
    procs: list[subprocess.Popen[str]],
    out: Path,
    n: int,
    timeout: float,
    wait: list[int] | None = None,
) -> Run:
    """Wait for the processes (those at ``wait``'s indices only, if given) until
    ``timeout``, then kill whatever is left."""
    started = time.monotonic()
    wall0 = time.time()
    deadline = started + timeout
    try:
        for p in procs if wait is None else [procs[i] for i in wait]:
            left = max(deadline - time.monotonic(), 0.0)
            try:
                p.wait(timeout=left)
            except subprocess.TimeoutExpired:
                break
    finally:
        leftover = []
        for r in range(n):
            pid_file = out / f"pid{r}"
            if pid_file.exists():
                pid = int(pid_file.read_text())
                if _alive(pid):
                    leftover.append(pid)
                    os.kill(pid, signal.SIGKILL)
        for p in procs:
            if p.poll() is None:
                leftover.append(p.pid)
                os.killpg(p.pid, signal.SIGKILL)  # each was started in its own session
            p.wait(timeout=30)
    output = "".join(f.read_text() for f in sorted(out.glob("log*.txt")))
    ranks = {}
    for r in range(n):
        f = out / f"rank{r}.json"
        if f.exists():
            ranks[r] = json.loads(f.read_text())
    failed = out / "failed_at"
    failed_at = float(failed.read_text()) if failed.exists() else None
    return Run(
        returncodes=[p.returncode for p in procs],
        output=output,
        ranks=ranks,
        leftover=leftover,
        started=wall0,
        ended=time.time(),
        failed_at=failed_at,
    )


def _config(out: Path, config: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.json"
    path.write_text(json.dumps({"out": str(out), **config}))
    return path


def torchrun(n: int, config: dict[str, Any], out: Path, *, timeout: float = 120.0) -> Run:
    """``torchrun --standalone --nproc-per-node n pool_worker.py``; killed at ``timeout``."""
    path = _config(out, config)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={n}", str(WORKER), str(path)]
    return _collect([_spawn(cmd, out, "log.txt", _env({}))], out, n, timeout)


def direct(
    n: int,
    config: dict[str, Any],
    out: Path,
    *,
    timeout: float = 120.0,
    wait: list[int] | None = None,
) -> Run:
    """n workers with torchrun's environment around a store hosted here; waits for the
    ranks in ``wait`` (default: all) to end, then kills the others."""
    import torch.distributed as dist

    path = _config(out, config)
    store = dist.TCPStore(
        "127.0.0.1", 0, n, True, timeout=timedelta(seconds=60), wait_for_workers=False
    )
    procs = []
    try:
        for r in range(n):
            env = _env(
                {
                    "RANK": str(r),
                    "LOCAL_RANK": str(r),
                    "WORLD_SIZE": str(n),
                    "LOCAL_WORLD_SIZE": str(n),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(store.port),
                    "TORCHELASTIC_USE_AGENT_STORE": "True",
                }
            )
            procs.append(_spawn([sys.executable, str(WORKER), str(path)], out, f"log{r}.txt", env))
        return _collect(procs, out, n, timeout, wait)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
        del store


def single(config: dict[str, Any], out: Path, *, timeout: float = 120.0) -> dict[str, Any]:
    """The worker as one plain process without a pool (``single``); its report."""
    path = _config(out, {**config, "single": True})
    proc = _spawn([sys.executable, str(WORKER), str(path)], out, "log-single.txt", _env({}))
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    report = out / "single.json"
    if not report.exists():
        log = (out / "log-single.txt").read_text()
        raise AssertionError(f"the single process wrote no report:\n{log}")
    return json.loads(report.read_text())
