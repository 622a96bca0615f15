"""CPU cost of the RolloutScheduler's own work per trainer call, with instant sources.

Every session is already done when ``start`` returns it: a COMPLETED rollout of one
call whose completion has 50-300 random tokens (numpy arrays) and a random reward.
The objective stand-in's ``packed_log_probs`` returns zeros of the batch's shape, and
the publisher does nothing, so what is left is the scheduler itself: registering the
batch, starting ``tasks x groups`` sessions, taking their finish events on the driver
thread, admission, consumption, ``pack`` and ``session_metrics``. The model is not
part of the figure.

``ahead=0, max_lag=0`` (synchronous) so each call holds exactly one batch's work;
``rows x width`` is sized so every group fits. Per call the figure is the process's
CPU seconds (``time.process_time``: every thread, the driver's included) around the
call and the batch read, median over ``--calls`` calls after ``--warmup``. ``pack`` is
timed again alone on the same groups to split the figure into pack and the rest; the
CPU the source spends building rollouts inside ``start`` is measured too (thread CPU
time) and reported, as it is not the scheduler's.

    .venv/bin/python bench/scheduler_overhead.py --write

``--write`` replaces the ``## scheduler overhead`` section of bench/RESULTS.md (other
sections are kept). ``--tiny`` runs 64 tasks x 4 samples for 2 calls and writes nothing.
``--profile N`` prints the N hottest functions of every thread (by thread CPU time).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import os
import pstats
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_results.py
import _results
from _results import machine, write_section, write_summary_row
from dew.core import Call, Rollout, RolloutKey, Session, Status, Task
from dew.data import Dataset, Prefetch
from dew.objectives.rl.pack import pack
from dew.objectives.rl.scheduler import RolloutScheduler

RESULTS = _results.RESULTS
SECTION = "## scheduler overhead"
TARGET = 0.3  # CPU s per call of the scheduler's own work (DESIGN.md, performance targets)
VOCAB = 150_000
PROMPT = 64  # prompt tokens per rollout


class _DoneSession:
    """A session that resolved before anyone asked: callbacks run at once."""

    def __init__(self, rollout: Rollout) -> None:
        self._rollout = rollout

    def cancel(self) -> None:
        pass

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Rollout:
        return self._rollout

    def add_done_callback(self, fn: Callable[[Session], None]) -> None:
        fn(self)


class InstantSource:
    """Builds each rollout in ``start`` from a pre-drawn pool of token arrays.

    ``cpu`` accumulates the thread CPU seconds spent inside ``start``, so the
    source's own share can be told apart from the scheduler's.
    """

    def __init__(self, seed: int, pool: int) -> None:
        rng = np.random.default_rng(seed)
        self._prompt = rng.integers(0, VOCAB, PROMPT, dtype=np.int64)
        lengths = rng.integers(50, 301, pool)
        self._completions = [rng.integers(0, VOCAB, n, dtype=np.int64) for n in lengths]
        self._log_probs = [-rng.exponential(0.5, n) for n in lengths]
        self._rewards = rng.random(pool)
        self._i = 0
        self.version = 0
        self.cpu = 0.0
        self.started = 0

    def tokens(self) -> int:
        """Tokens of one pass through the pool (prompt + completion per rollout)."""
        return sum(PROMPT + len(c) for c in self._completions)

    def start(self, task: Task, key: RolloutKey) -> Session:
        t0 = time.thread_time()
        i = self._i % len(self._completions)
        self._i += 1
        call = Call(
            prompt=self._prompt,
            completion=self._completions[i],
            log_probs=self._log_probs[i],
            version=self.version,
            finish_reason="stop",
        )
        rollout = Rollout(
            key=key, task=task, status=Status.COMPLETED, calls=(call,), reward=self._rewards[i]
        )
        session = _DoneSession(rollout)
        self.started += 1
        self.cpu += time.thread_time() - t0
        return session


class ZeroObjective:
    """Stands in for GRPOObjective: proximal log-probs of zero, no model run."""

    def packed_log_probs(self, variables: Any, batch: dict[str, np.ndarray]) -> torch.Tensor:
        return torch.zeros(batch["tokens"].shape)  # [rows, width]


class Publisher:
    def __init__(self, source: InstantSource) -> None:
        self.source = source

    def load(self, variables: Any, version: int) -> None:
        self.source.version = version


def rows_for(source: InstantSource, width: int) -> int:
    """Rows for one call's rollouts (the whole pool) with 2% room over a perfect fill."""
    total = source.tokens()
    return -(-int(total * 1.02) // width) + 1


def run(tasks: int, groups: int, width: int, calls: int, warmup: int, seed: int) -> dict[str, Any]:
    n = tasks * groups
    source = InstantSource(seed, pool=n)  # each call takes the whole pool once, in order
    rows = rows_for(source, width)
    scheduler = RolloutScheduler(
        ZeroObjective(),  # type: ignore[arg-type]
        source,
        Publisher(source),
        width=width,
        rows=rows,
        groups=groups,
        ahead=0,
        sync_every=1,
        max_lag=0,
    )
    cpu, wall, starts, packed_groups, cut, padding = [], [], [], [], [], []
    driver_cpu, trainer_cpu, system = [], [], []
    (driver,) = [t for t in threading.enumerate() if t.name == "dew-scheduler"]
    driver_clock = time.pthread_getcpuclockid(driver.ident)  # type: ignore[arg-type]
    try:
        data = Dataset(
            {"task_id": np.arange(tasks * (warmup + calls))}, batch_size=tasks, shuffle=False
        )
        stream = Prefetch(scheduler.tasks(data).stream(), depth=0)
        for updates in range(warmup + calls):
            s0, d0, t0 = source.cpu, time.clock_gettime(driver_clock), time.thread_time()
            sys0 = resource.getrusage(resource.RUSAGE_SELF).ru_stime
            c0, w0 = time.process_time(), time.perf_counter()
            batch = next(stream)
            out = scheduler(None, batch, updates=updates)
            c1, w1 = time.process_time(), time.perf_counter()
            d1, t1 = time.clock_gettime(driver_clock), time.thread_time()
            sys1 = resource.getrusage(resource.RUSAGE_SELF).ru_stime
            rec = scheduler.history[-1]
            assert out["loss_mask"].shape == (rows, width)
            if updates >= warmup:
                cpu.append(c1 - c0)
                wall.append(w1 - w0)
                starts.append(source.cpu - s0)
                driver_cpu.append(d1 - d0)
                trainer_cpu.append(t1 - t0)
                system.append(sys1 - sys0)
                packed_groups.append(rec.groups)
                cut.append(rec.cut)
                padding.append(rec.metrics["pack/padding_share"])
    finally:
        scheduler.close()

    # Pack alone, on the same rollouts in the same groups as every call packed.
    pool = InstantSource(seed, pool=n)
    groups_list = [
        [pool.start(Task(str(t)), RolloutKey(t, s, 0)).result() for s in range(groups)]
        for t in range(tasks)
    ]
    pack_cpu = []
    for _ in range(max(calls, 3)):
        c0 = time.process_time()
        pack(groups_list, rows=rows, width=width)
        pack_cpu.append(time.process_time() - c0)
    return {
        "tasks": tasks,
        "groups": groups,
        "rows": rows,
        "width": width,
        "calls": calls,
        "cpu": statistics.median(cpu),
        "wall": statistics.median(wall),
        "start": statistics.median(starts),
        "driver": statistics.median(driver_cpu),
        "trainer": statistics.median(trainer_cpu),
        "system": statistics.median(system),
        "load": os.getloadavg()[0],
        "pack": statistics.median(pack_cpu),
        "us_per_rollout": statistics.median(cpu) / n * 1e6,
        "packed": min(packed_groups),
        "cut": max(cut),
        "rollouts": n,
        "padding": statistics.median(padding),
    }


@contextlib.contextmanager
def profiled(top: int) -> Iterator[None]:
    """Profile every thread started meanwhile (the driver) and this one, by thread CPU time.

    Prints the ``top`` functions by own time. Profiling slows Python code about twofold,
    so these figures locate hotspots; the measured figures come from runs without it.
    """
    profiles: list[cProfile.Profile] = []
    original = threading.Thread.run

    def run_profiled(thread: threading.Thread) -> None:
        p = cProfile.Profile(time.thread_time)
        profiles.append(p)
        p.enable()
        try:
            original(thread)
        finally:
            p.disable()

    main = cProfile.Profile(time.thread_time)
    threading.Thread.run = run_profiled  # type: ignore[method-assign]
    main.enable()
    try:
        yield
    finally:
        main.disable()
        threading.Thread.run = original  # type: ignore[method-assign]
    stats = pstats.Stats(main)
    for p in profiles:
        stats.add(p)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)


def report(r: dict[str, Any]) -> list[str]:
    rest = r["cpu"] - r["pack"]
    own = r["cpu"] - r["start"]  # the test double's start() is the source's cost, not ours
    return [
        f"per call: {r['cpu']:.3f} CPU s, {r['wall']:.3f} wall s, "
        f"{r['us_per_rollout']:.1f} us per rollout "
        f"({r['tasks']:,} tasks x {r['groups']} samples = {r['rollouts']:,} rollouts into "
        f"[{r['rows']}, {r['width']}], padding {r['padding']:.1%}, {r['packed']} groups "
        f"packed, {r['cut']} cut; "
        f"median of {r['calls']} calls)",
        f"scheduler's own work (all but the instant source's start()): {own:.3f} CPU s; "
        f"target under {TARGET:g} s per call: {'met' if own < TARGET else 'NOT met'} "
        f"(1-minute load average at the end: {r['load']:.1f})",
        f"by thread: trainer thread (batch read, pack, metrics, record) {r['trainer']:.3f} CPU s, "
        f"driver thread (starts, finish events, admission) {r['driver']:.3f} CPU s; "
        f"system time {r['system']:.3f} s of the total",
        f"pack alone: {r['pack']:.3f} CPU s; the rest (driver, admission, metrics, "
        f"source start): {rest:.3f} CPU s, of which the source's start(): {r['start']:.3f} s",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=1024)
    ap.add_argument("--groups", type=int, default=16, help="samples per task")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=5, help="measured calls")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="64 tasks x 4, 2 calls, no write")
    ap.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="print N hotspots")
    args = ap.parse_args()
    if args.tiny:
        args.tasks, args.groups, args.calls, args.warmup, args.write = 64, 4, 2, 0, False
    torch.set_num_threads(1)

    with profiled(args.profile) if args.profile else contextlib.nullcontext():
        r = run(args.tasks, args.groups, args.width, args.calls, args.warmup, args.seed)
    lines = report(r)
    for line in lines:
        print(line, flush=True)
    if args.write and args.profile:
        raise SystemExit("--write takes figures from a run without --profile")
    if args.write:
        host = machine(f"numpy {np.__version__}", f"torch {torch.__version__}")
        date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
        cmd = " ".join([".venv/bin/python", "bench/scheduler_overhead.py", *sys.argv[1:]])
        body = "\n".join(f"- {line}" for line in lines)
        write_section(
            f"{SECTION}\n\n"
            "CPU seconds of the RolloutScheduler's own work per trainer call (target: under "
            f"{TARGET:g} s for 1,024 tasks x 16 samples): instant sources (sessions already "
            "done on `start`, one call of 50-300 completion tokens each), a zero "
            "`packed_log_probs` stand-in instead of the model, synchronous (`ahead=0`) so each "
            "call holds one batch's work. Measured: scheduling + pack, not the model. "
            "`time.process_time` covers every thread of the process.\n\n"
            f"- command: `{cmd}`\n"
            f"- machine: {host}\n"
            f"- date: {date}\n"
            f"{body}\n"
        )
        own = r["cpu"] - r["start"]
        write_summary_row(
            "scheduler overhead",
            f"{own:.3f} CPU s per call of scheduler work for {r['rollouts']:,} rollouts "
            f"({r['cpu']:.3f} s with the instant source's start(); pack {r['pack']:.3f} s)",
            f"under {TARGET:g} s per call (1,024 tasks x 16)",
            "met" if own < TARGET else f"NOT met (by {own - TARGET:.3f} s)",
        )
        print(f"wrote the scheduler overhead section of {RESULTS}")


if __name__ == "__main__":
    main()
