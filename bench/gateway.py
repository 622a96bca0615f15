"""Gateway benchmark: agent episodes through the recording gateway beside the same episodes
in process, on one engine.

The episode (the agent demo's, generalised to ``--turns`` k): the user asks for a digit;
after each reply a tool message names the next digit; k model calls in all, each capped at
``--max-tokens`` tokens, sampled at temperature 1.

* in process: an :class:`EnvironmentSource` whose environment plays the user and the tool;
* through the gateway: a :class:`HarnessSource` whose harness is an ordinary ``openai``
  client program (one client per episode from ``endpoint.client()``, as the agent demo
  does) talking HTTP to a :class:`RecordingGateway` on 127.0.0.1.

Both run on one :class:`RolloutServer` (the demo's tiny model) behind a thin proxy that
times every call inside the engine. For each N in ``--sessions``, N episodes start at once
(N worker threads each side, an engine whose batch holds N) and the run ends when all have
finished. Runs alternate (in process, gateway) ``--repeats`` times after one warm-up pair,
so both see the same background load; figures are medians over the repeats. Each
gateway run first plays one untimed round of the same episodes on its fresh source (its
connections, and in harness processes the client's first-call costs).

Reported per side and N: rollout latency p50/p99 (start to result), sessions per second,
call latency p50/p99 as the caller sees it (the harness times each ``create``; in process
it is the engine's own time) and the engine's time per call; for the gateway also the
overhead per call (client-seen call latency minus the engine's, p50), the CPU that the
gateway's threads (its HTTP loop and its render/detokenize pool) spent per call, the CPU
of the harness per call (the ``openai`` client: the agent's cost, not dew's; its thread's
``time.thread_time`` over the episode, wherever it ran), and the rollouts that did not
complete (errors).

``--processes K`` adds a third side: the same gateway episodes with the harness in ``K``
harness processes (``HarnessSource(processes=K)``), so that the client's CPU leaves the
interpreter lock of the process that runs the engine and the gateway.

``--write`` replaces the ``## gateway`` section of bench/RESULTS.md and the summary rows;
``--tiny`` is a seconds-long smoke run that writes nothing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_results.py
import _results
from _results import machine, write_section, write_summary_row
from dew.core import Call, RolloutKey, SamplingParams, Status, Task
from dew.demo.model import make_model, make_tokenizer
from dew.gateway import HarnessEndpoint, HarnessOutcome, HarnessSource, RecordingGateway
from dew.objectives.rl.sources import EnvironmentSource
from dew.serving import RolloutServer

RESULTS = _results.RESULTS
WAIT = 600.0  # seconds; a run that takes longer has hung


class TimedEngine:
    """The engine, timing each call from submission to its future's resolution."""

    def __init__(self, server: RolloutServer) -> None:
        self._server = server
        self._lock = threading.Lock()
        self.seconds: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)

    def submit(
        self,
        prompt: Any,
        params: SamplingParams,
        *,
        stop: threading.Event | None = None,
        affinity: Hashable | None = None,
    ) -> Future[Call]:
        began = time.monotonic()
        future = self._server.submit(prompt, params, stop=stop, affinity=affinity)

        def done(_: Future[Call]) -> None:
            with self._lock:
                self.seconds.append(time.monotonic() - began)

        future.add_done_callback(done)
        return future

    def generate(
        self,
        prompt: Any,
        params: SamplingParams,
        *,
        stop: threading.Event | None = None,
        affinity: Hashable | None = None,
    ) -> Call:
        return self.submit(prompt, params, stop=stop, affinity=affinity).result()

    def take(self) -> list[float]:
        with self._lock:
            out, self.seconds = self.seconds, []
        return out


def next_digit(reply: str, fallback: int) -> int:
    first = reply[:1]
    return ((int(first) if first.isdigit() and first.isascii() else fallback) + 1) % 10


class Episode:
    """The in-process side: plays the user and the tool for ``turns`` model calls."""

    def __init__(self, turns: int) -> None:
        self.turns = turns
        self.replies: list[str] = []
        self.digit = 0

    def reset(self, task: Task) -> str:
        self.digit = int(task.data["digit"])
        return f"digit {self.digit}"

    def step(self, reply: str) -> list[dict[str, str]] | None:
        self.replies.append(reply)
        if len(self.replies) == self.turns:
            return None
        self.digit = next_digit(reply, self.digit)
        return [{"role": "tool", "tool_call_id": "next_digit", "content": f"digit {self.digit}"}]

    def score(self) -> float:
        return 0.0


@dataclass(frozen=True)
class Harness:
    """The gateway side: the same episode as an ``openai`` client program. It returns
    what it measured (each call's seconds, its own thread's CPU seconds), so that it
    can run in a harness process as well as on the source's threads."""

    turns: int
    max_tokens: int

    def __call__(self, task: Task, endpoint: HarnessEndpoint) -> dict[str, Any]:
        cpu = time.thread_time()
        digit = int(task.data["digit"])
        messages: list[dict[str, str]] = [{"role": "user", "content": f"digit {digit}"}]
        timings = []
        with endpoint.client(max_retries=0) as client:
            for turn in range(self.turns):
                began = time.monotonic()
                out = client.chat.completions.create(
                    model=endpoint.model, messages=messages, max_tokens=self.max_tokens
                )
                timings.append(time.monotonic() - began)
                reply = out.choices[0].message.content or ""
                if turn + 1 < self.turns:
                    digit = next_digit(reply, digit)
                    messages += [
                        {"role": "assistant", "content": reply},
                        {"role": "tool", "tool_call_id": "next_digit", "content": f"digit {digit}"},
                    ]
        return {"calls": timings, "cpu": time.thread_time() - cpu}


class Measured:
    """The verifier: scores 0 and keeps what each harness run measured."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: list[dict[str, Any]] = []

    def __call__(self, task: Task, outcome: HarnessOutcome) -> float:
        if isinstance(outcome.value, dict):
            with self.lock:
                self.values.append(outcome.value)
        return 0.0


def thread_cpu(prefixes: tuple[str, ...]) -> dict[int, float]:
    """CPU seconds of each live thread whose name starts with a prefix.

    Read from ``/proc/self/task/<tid>/schedstat`` (the scheduler's exact run time, in ns),
    not ``stat``'s utime/stime, which are sampled at the clock tick and miss threads
    that each run for less than a tick.
    """
    out = {}
    for t in threading.enumerate():
        if t.native_id is None or not t.name.startswith(prefixes):
            continue
        try:
            stat = Path(f"/proc/self/task/{t.native_id}/schedstat").read_text()
        except FileNotFoundError:
            continue  # it ended between the listing and the read
        out[t.native_id] = int(stat.split()[0]) / 1e9
    return out


def spent(before: dict[int, float], after: dict[int, float]) -> float:
    return sum(v - before.get(tid, 0.0) for tid, v in after.items())


def pct(values: Iterable[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Run:
    latency: list[float]  # per rollout, seconds
    seconds: float  # first start to last result
    calls: list[float]  # per call as the caller saw it, seconds
    engine: list[float]  # per call inside the engine, seconds
    errors: int
    gateway_cpu: float = 0.0  # seconds, gateway threads
    harness_cpu: float = 0.0  # seconds, the harness's own thread CPU

    def figures(self) -> dict[str, float]:
        n_calls = max(1, len(self.engine))
        sessions = len(self.latency)
        return {
            "latency_p50": statistics.median(self.latency),
            "latency_p99": pct(self.latency, 0.99),
            "sessions_per_s": sessions / self.seconds,
            "call_p50": statistics.median(self.calls),
            "call_p99": pct(self.calls, 0.99),
            "engine_p50": statistics.median(self.engine),
            "overhead_ms": 1e3 * (statistics.median(self.calls) - statistics.median(self.engine)),
            "gateway_cpu_ms": 1e3 * self.gateway_cpu / n_calls,
            "harness_cpu_ms": 1e3 * self.harness_cpu / n_calls,
            "errors": float(self.errors),
        }


def run_sessions(
    start: Callable[[Task, RolloutKey], Any], tasks: list[Task]
) -> tuple[list[float], float, int]:
    """Start every task at once; each rollout's latency, the wall time, the failures."""
    began = time.monotonic()
    done_at: dict[int, float] = {}
    lock = threading.Lock()
    sessions = []
    for i, task in enumerate(tasks):
        session = start(task, RolloutKey(0, i, 0))

        def finished(_: Any, i: int = i) -> None:
            with lock:
                done_at[i] = time.monotonic()

        session.add_done_callback(finished)
        sessions.append(session)
    rollouts = [s.result(WAIT) for s in sessions]
    wall = time.monotonic() - began
    errors = sum(r.status is not Status.COMPLETED for r in rollouts)
    return [done_at[i] - began for i in range(len(tasks))], wall, errors


def in_process(engine: TimedEngine, tasks: list[Task], turns: int, max_tokens: int) -> Run:
    tok = make_tokenizer()
    sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0)
    with EnvironmentSource(
        engine,
        lambda: Episode(turns),
        tokenizer=tok,
        sampling=sampling,
        max_turns=turns,
        max_context=engine.max_len,
        workers=len(tasks),
    ) as source:
        engine.take()
        latency, wall, errors = run_sessions(source.start, tasks)
    seconds = engine.take()
    return Run(latency, wall, seconds, seconds, errors)


def through_gateway(
    engine: TimedEngine, tasks: list[Task], turns: int, max_tokens: int, processes: int = 0
) -> Run:
    tok = make_tokenizer()
    measured = Measured()
    with (
        RecordingGateway(
            engine,
            tok,
            max_turns=turns,
            max_tokens_per_session=turns * max_tokens,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0),
            workers=max(4, 2 * len(tasks)),
        ) as gateway,
        HarnessSource(
            gateway, Harness(turns, max_tokens), measured, workers=len(tasks), processes=processes
        ) as source,
    ):
        # One untimed round first: each worker thread's connection (and, with processes,
        # each process's first-call costs: openai builds its request types lazily).
        run_sessions(source.start, tasks)
        engine.take()
        with measured.lock:
            measured.values.clear()
        gw0 = thread_cpu(("dew-gateway",))
        latency, wall, errors = run_sessions(source.start, tasks)
        gw1 = thread_cpu(("dew-gateway",))
    return Run(
        latency,
        wall,
        [c for v in measured.values for c in v["calls"]],
        engine.take(),
        errors,
        gateway_cpu=spent(gw0, gw1),
        harness_cpu=sum(v["cpu"] for v in measured.values),
    )


def built_off_main(build: Callable[[], Any]) -> Any:
    """``build()`` run on a short-lived thread, so the main thread never runs torch.

    With GNU OpenMP a thread that runs a parallel torch op keeps its worker team for
    life, and two live teams on two cores throttle each other: a model built on the
    main thread made the engine's decode steps up to 40x slower in some runs.
    """
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(build()), name="bench-build")
    thread.start()
    thread.join()
    if not out:
        raise RuntimeError("building the model failed (its error is printed above)")
    return out[0]


def make_tasks(n: int, offset: int) -> list[Task]:
    return [Task(str(i), {"digit": (offset + i) % 10}) for i in range(n)]


def measure(
    engine: TimedEngine,
    sessions: int,
    turns: int,
    max_tokens: int,
    repeats: int,
    processes: int = 0,
) -> dict[str, dict[str, float]]:
    tasks = make_tasks(sessions, 0)
    # Warm-up: first-call costs (imports, connections, the engine's first shapes).
    in_process(engine, tasks, turns, max_tokens)
    through_gateway(engine, tasks, turns, max_tokens)
    runs: dict[str, list[dict[str, float]]] = {"in process": [], "gateway": []}
    with_processes = f"gateway, {processes} harness process" + ("es" if processes > 1 else "")
    if processes:
        runs[with_processes] = []
    for r in range(repeats):
        tasks = make_tasks(sessions, r + 1)
        runs["in process"].append(in_process(engine, tasks, turns, max_tokens).figures())
        runs["gateway"].append(through_gateway(engine, tasks, turns, max_tokens).figures())
        if processes:
            run = through_gateway(engine, tasks, turns, max_tokens, processes)
            runs[with_processes].append(run.figures())
    return {
        side: {k: statistics.median(f[k] for f in figs) for k in figs[0]}
        for side, figs in runs.items()
    }


def table(results: dict[int, dict[str, dict[str, float]]]) -> str:
    rows = [
        "| N | side | rollout p50 (ms) | rollout p99 (ms) | sessions/s | call p50 (ms) "
        "| call p99 (ms) | engine p50 (ms) | overhead/call (ms) | gateway CPU/call (ms) "
        "| harness CPU/call (ms) | errors |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, sides in results.items():
        for side, f in sides.items():
            gw = side.startswith("gateway")
            rows.append(
                f"| {n} | {side} | {1e3 * f['latency_p50']:.0f} | {1e3 * f['latency_p99']:.0f} "
                f"| {f['sessions_per_s']:.1f} | {1e3 * f['call_p50']:.1f} "
                f"| {1e3 * f['call_p99']:.1f} | {1e3 * f['engine_p50']:.1f} "
                f"| {f['overhead_ms']:.1f} | {f['gateway_cpu_ms']:.2f} "
                f"| {f['harness_cpu_ms']:.2f} | {f['errors']:.0f} |"
                if gw
                else f"| {n} | {side} | {1e3 * f['latency_p50']:.0f} "
                f"| {1e3 * f['latency_p99']:.0f} | {f['sessions_per_s']:.1f} "
                f"| {1e3 * f['call_p50']:.1f} | {1e3 * f['call_p99']:.1f} "
                f"| {1e3 * f['engine_p50']:.1f} | - | - | - | {f['errors']:.0f} |"
            )
    return "\n".join(rows)


def ratios(results: dict[int, dict[str, dict[str, float]]]) -> str:
    lines = []
    for n, sides in results.items():
        p = sides["in process"]
        for side, g in sides.items():
            if side == "in process":
                continue
            how = "" if side == "gateway" else f" ({side.split(', ', 1)[1]})"
            lines.append(
                f"- N={n}: rollout p50 through the gateway{how} "
                f"{g['latency_p50'] / p['latency_p50']:.2f}x in process; sessions/s "
                f"{g['sessions_per_s'] / p['sessions_per_s']:.2f}x"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", default="8,64,256", help="concurrent sessions, comma-separated")
    ap.add_argument("--turns", type=int, default=2, help="model calls per episode")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--processes",
        type=int,
        default=0,
        help="also run the gateway side with the harness in this many processes",
    )
    ap.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    ap.add_argument("--tiny", action="store_true", help="a smoke run: 4 sessions, 1 repeat")
    args = ap.parse_args(argv)
    sessions = [4] if args.tiny else [int(s) for s in args.sessions.split(",")]
    repeats = 1 if args.tiny else args.repeats
    if "OMP_NUM_THREADS" not in os.environ:
        # As dew demo does: half the cores for torch. Two cores each given to OpenMP
        # teams that spin between parallel regions made the engine's decode steps 10-40x
        # slower in some runs here, by whichever side ran first; one thread has no team.
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    results: dict[int, dict[str, dict[str, float]]] = {}
    for n in sessions:
        # An engine sized for N: a batch of N in flight, as the demo sizes its own.
        with RolloutServer(built_off_main(make_model), max_batch=n, seed=0) as server:
            results[n] = measure(
                TimedEngine(server), n, args.turns, args.max_tokens, repeats, args.processes
            )
        print(table({n: results[n]}), flush=True)
    print(ratios(results))
    if args.write and not args.tiny:
        command = (
            f"python bench/gateway.py --sessions {args.sessions} --turns {args.turns} "
            f"--max-tokens {args.max_tokens} --repeats {repeats}"
            + (f" --processes {args.processes}" if args.processes else "")
            + " --write"
        )
        text = "\n".join(
            [
                "## gateway",
                "",
                f"`{command}` on {datetime.date.today()}, {machine()}.",
                "",
                f"{args.turns}-call agent episodes ({args.max_tokens} tokens a call), N at once, "
                "through the recording gateway (the `openai` client, HTTP on 127.0.0.1) beside "
                "the same episodes from an `EnvironmentSource`, on one `RolloutServer` (tiny "
                f"demo model); medians of {repeats} alternating repeats.",
                "",
                table(results),
                "",
                ratios(results),
            ]
        )
        write_section(text)
        for n, sides in results.items():
            p = sides["in process"]
            cells = []
            for side, g in sides.items():
                if side != "in process":
                    cells.append((side, g["latency_p50"] / p["latency_p50"]))
            best = min(ratio for _, ratio in cells)
            write_summary_row(
                f"gateway rollout p50 vs in process, N={n}",
                "; ".join(f"{side} {ratio:.2f}x" for side, ratio in cells),
                "<= 2x",
                "met" if best <= 2 else "missed",
            )
        top = max(results)
        cpus = {
            side: g["gateway_cpu_ms"] for side, g in results[top].items() if side != "in process"
        }
        write_summary_row(
            f"gateway CPU per call, N={top}",
            "; ".join(f"{side} {cpu:.2f} ms" for side, cpu in cpus.items()),
            "< 1 ms",
            "met" if min(cpus.values()) < 1 else "missed",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
