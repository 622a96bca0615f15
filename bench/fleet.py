"""Engines in their own processes: weight-push latency per path, and the demo on a fleet.

Push latency: a ~10M and a ~100M parameter Qwen2 model, built from a config with random
weights (``AutoConfig.for_model("qwen2", ...)``, fp32, untied embeddings), saved with
``save_pretrained`` to a temp folder and served by one ``dew serve --model`` process
per size. The trainer (this process) pushes the same weights under a new version each
time, through each path in turn (the order rotates every round), ``--pushes`` times:

* file, end to end: ``HTTPEngine.load(model, v)`` (write a safetensors file into
  ``/dev/shm``, HTTPEngine's default, then ``/update_weights_from_disk``);
* file, in parts: ``write_weights`` into ``/dev/shm`` (atomic write + checksum), then
  ``HTTPEngine.load_file`` (the server reads, checks and loads it);
* broadcast: the trainer's ``BroadcastGroup`` (gloo, one TCP store on 127.0.0.1, joined
  once through ``/init_weights_update_group`` before the timed pushes) sends every
  tensor while ``/update_weights_from_distributed`` receives them: from the request to
  its answer.

Reported: median and min milliseconds, and GB/s of the model's tensor bytes at the
median (the file's size on ``/dev/shm`` is given beside the model).

Demo workload: the demo's single-turn task at its tuned settings
(``DemoConfig.for_task("single")``: tiny qwen2, 4 prompts x 32 samples, 3 new tokens,
ahead 1) for ``--steps`` steps, trained by ``dew.train.fit`` (no TensorBoard, frozen
GC as the demo runs) with four engines: the in-process ``RolloutServer`` (the demo's
own ``build_job``), an ``EngineFleet`` of 1 and of 2 local ``dew serve --demo tiny``
processes (same seed, ``--max-batch`` the demo's in-process batch; the scheduler's
first push at version 0 gives every engine the trainer's weights), and the fleet of 2
behind an sglang-router (``cache_aware``; left out when sglang-router is not
installed). Runs alternate (in-process, fleet of 1, fleet of 2, fleet of 2 behind the
router, then again) ``--repeats`` times; a fleet (and its router) is started
fresh for every run and its start-up is not timed. Measured per run: steps/s and
completion tokens trained per second (the sum of the records' ``trained_tokens``) over
``fit``'s wall time; figures are medians, and each ratio puts a fleet's median over the
in-process median. This process gives torch half the cores, as ``dew demo`` does; the
engine processes keep torch's default.

Every process started here is stopped by its own pid in a ``finally``. ``--write``
replaces the ``## fleet`` section of bench/RESULTS.md and its summary row; ``--tiny`` is
a seconds-long smoke run (a ~0.1M model, 2 pushes per path, a few steps, one repeat)
that writes nothing.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import queue
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_results.py
import _results
from _results import command_line, machine, write_section, write_summary_row
from dew.serving._folders import shared_memory
from dew.serving.http_engine import HTTPEngine
from dew.serving.weights import BroadcastGroup, tensor_specs, write_weights

RESULTS = _results.RESULTS
_PREFIX = "dew serve: listening on "
_SHM = shared_memory()

# Qwen2 shapes landing near the parameter counts asked for (exact counts are printed).
# name -> (hidden, layers, intermediate, heads (= key/value heads), vocabulary)
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "~10M": (256, 8, 1024, 4, 3072),
    "~100M": (768, 12, 2048, 12, 8192),
    "~0.1M": (32, 2, 64, 2, 512),
}
PATHS = ("file: HTTPEngine.load", "file: write", "file: server load", "broadcast (gloo)")


# ------------------------------------------------------------------ processes


class Served:
    """One ``dew serve`` process started here; ``stop()`` ends that pid only."""

    def __init__(self, *args: str, deadline: float = 300.0) -> None:
        self._stderr: IO[str] = tempfile.TemporaryFile("w+")
        argv = [sys.executable, "-m", "dew.serve", *args, "--host", "127.0.0.1", "--port", "0"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        try:
            self.url = self._listening(deadline)
        except BaseException:
            self.stop()
            raise

    def _listening(self, deadline: float) -> str:
        lines: queue.Queue[str] = queue.Queue()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                lines.put(line)

        threading.Thread(target=pump, daemon=True).start()
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if line.startswith(_PREFIX):
                return line[len(_PREFIX) :].strip()
        self._stderr.seek(0)
        raise RuntimeError(f"dew serve did not start: {self._stderr.read()[-3000:]}")

    def stop(self, grace: float = 20.0) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()


@contextmanager
def serving(*args: str) -> Iterator[Served]:
    served = Served(*args)
    try:
        yield served
    finally:
        served.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ------------------------------------------------------------------ push latency


def build_checkpoint(size: str, folder: Path) -> tuple[torch.nn.Module, int, int]:
    """(model, parameters, tensor bytes) of ``size``, saved to ``folder``."""
    hidden, layers, intermediate, heads, vocab = SIZES[size]
    config = transformers.AutoConfig.for_model(
        "qwen2",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=vocab,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return model, params, nbytes


@dataclass
class PushResult:
    size: str
    params: int
    nbytes: int
    file_bytes: int
    init_ms: float  # joining the broadcast group, once
    ms: dict[str, list[float]]


def _ms(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


def push_latency(size: str, pushes: int) -> PushResult:
    """Alternate the three push paths ``pushes`` times on one ``dew serve`` of ``size``."""
    tmp = Path(tempfile.mkdtemp(prefix="dew-bench-fleet-"))
    shm = Path(tempfile.mkdtemp(prefix="dew-bench-fleet-", dir=_SHM))
    try:
        model, params, nbytes = build_checkpoint(size, tmp / "model")
        print(f"  {size}: {params:,} parameters, {nbytes / 1e6:,.1f} MB", file=sys.stderr)
        ms: dict[str, list[float]] = {p: [] for p in PATHS}
        with (
            serving("--model", str(tmp / "model"), "--weights-dir", str(shm)) as served,
            HTTPEngine(served.url, weights_dir=shm, timeout=600.0, startup_timeout=60.0) as engine,
            httpx.Client(base_url=served.url, timeout=600.0) as client,
            ThreadPoolExecutor(max_workers=1) as side,
        ):
            port = _free_port()
            init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                    "world_size": 2, "group_name": "bench", "backend": "gloo"}  # fmt: skip
            t0 = time.perf_counter()
            joining = side.submit(
                BroadcastGroup, "127.0.0.1", port, 2, group_name="bench", timeout=300
            )
            r = client.post("/init_weights_update_group", json=init)
            r.raise_for_status()
            group = joining.result()
            init_ms = (time.perf_counter() - t0) * 1e3
            names, dtypes, shapes = tensor_specs(model)
            spec = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": "bench"}
            version = engine.version
            file_bytes = 0

            def file_e2e() -> None:
                nonlocal version
                version += 1
                t, _ = _ms(lambda: engine.load(model, version))
                ms[PATHS[0]].append(t)

            def file_parts() -> None:
                nonlocal version, file_bytes
                version += 1
                t_write, path = _ms(lambda: write_weights(model, shm, version))
                file_bytes = path.stat().st_size
                t_load, _ = _ms(lambda: engine.load_file(path, version))
                path.unlink()
                ms[PATHS[1]].append(t_write)
                ms[PATHS[2]].append(t_load)

            def broadcast() -> None:
                nonlocal version
                version += 1
                body = {**spec, "dew_version": version, "dew_run": engine.run}  # its run

                def push() -> httpx.Response:
                    answer = side.submit(client.post, "/update_weights_from_distributed", json=body)
                    group.broadcast(model)
                    return answer.result()

                t, answer = _ms(push)
                answer.raise_for_status()
                assert answer.json()["dew_version"] == version, answer.text
                ms[PATHS[3]].append(t)

            order = [file_e2e, file_parts, broadcast]
            for i in range(pushes):
                for step in order[i % 3 :] + order[: i % 3]:  # rotate: no path always first
                    step()
            group.close()
        return PushResult(size, params, nbytes, file_bytes, init_ms, ms)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def push_table(results: list[PushResult]) -> str:
    rows = [
        "| model | path | median ms | min ms | GB/s (median) |",
        "|---|---|---:|---:|---:|",
    ]
    for r in results:
        label = f"{r.size} ({r.params:,} params, file {r.file_bytes / 1e6:,.1f} MB)"
        for path in PATHS:
            times = r.ms[path]
            med = statistics.median(times)
            rows.append(
                f"| {label} | {path} | {med:,.0f} | {min(times):,.0f} "
                f"| {r.nbytes / (med / 1e3) / 1e9:.2f} |"
            )
    return "\n".join(rows)


# ------------------------------------------------------------------ demo workload


def _fleet_class() -> Any:
    """``EngineFleet``, or None when it cannot be imported (the fleet rows are missing)."""
    try:
        from dew.serving.fleet import EngineFleet
    except ImportError as exc:
        print(f"  EngineFleet not importable ({exc}): measuring one HTTPEngine", file=sys.stderr)
        return None
    return EngineFleet


@dataclass
class DemoRun:
    label: str
    seconds: float
    steps: int
    tokens: int
    reward: float  # mean reward of the last 10 steps
    pushes: list[float]  # seconds of each fleet.load (a fleet's runs only)

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def demo_run(
    label: str,
    engines: int,
    steps: int,
    seed: int,
    router: str | None = None,
    batch: bool = False,
    ray: bool = False,
    one_thread: bool = False,
) -> DemoRun:
    """Train the single-turn demo task for ``steps`` with ``engines`` (0: in-process;
    -1: one ``dew serve`` behind a plain HTTPEngine; n: an EngineFleet of n, behind an
    sglang-router with policy ``router`` if given; ``batch``: its engines send one
    request per group, ``HTTPEngine(batch_groups=True)``; ``ray``: placed by Ray on a
    local instance of its own, ``EngineFleet.on_ray``; ``one_thread``: its engine
    processes run torch on one thread, as Ray's actors of one CPU do)."""
    from dew.demo.run import DemoConfig, build_job
    from dew.train import read_records

    config = DemoConfig.for_task("single", steps=steps, seed=seed, checkpoint_every=steps)
    in_flight = config.batch_size * config.scheduler_config().in_flight_per_task
    serve_args = ["--max-batch", str(in_flight)]
    with tempfile.TemporaryDirectory() as run_dir, ExitStack() as stack:
        engine: Any = None  # in-process: the demo's own RolloutServer
        pushes: list[float] = []
        if engines > 0 and ray:
            fleet = _fleet_class().on_ray(
                engines, demo=config.size, seed=seed, args=serve_args, address="local",
                startup_timeout=300.0,
            )  # fmt: skip
            engine = stack.enter_context(fleet)  # close() ends its actors and Ray
        elif engines < 0:
            served = stack.enter_context(
                serving("--demo", config.size, "--seed", str(seed), *serve_args)
            )
            engine = stack.enter_context(HTTPEngine(served.url, startup_timeout=60.0))
        elif engines > 0:
            fleet = _fleet_class().launch(
                engines,
                demo=config.size,
                seed=seed,
                args=serve_args,
                startup_timeout=300.0,
                router=router,
                engine_options={"batch_groups": True} if batch else None,
                env={"OMP_NUM_THREADS": "1"} if one_thread else None,
            )
            engine = stack.enter_context(fleet)  # close() stops its processes
        if engines > 0:
            engine.load = _timed(engine.load, pushes)
        job = build_job(config, stack, engine=engine)
        t0 = time.perf_counter()
        result = job.fit(
            steps=steps, run_dir=run_dir, checkpoint_every=steps, tensorboard=False,
            freeze_gc=True,
        )  # fmt: skip
        seconds = time.perf_counter() - t0
        records = read_records(run_dir)
    assert result.updates == steps, result
    rewards = [
        float(r["scheduler"]["metrics"]["reward/mean"])
        for r in records
        if "reward/mean" in r.get("scheduler", {}).get("metrics", {})
    ]
    tokens = sum(int(r.get("trained_tokens", 0)) for r in records)
    last = rewards[-10:] or [float("nan")]
    run = DemoRun(label, seconds, steps, tokens, sum(last) / len(last), pushes)
    print(
        f"  {label}: {steps} steps in {seconds:.1f} s, {run.steps_per_s:.2f} steps/s, "
        f"{run.tokens_per_s:,.0f} tokens/s, reward (last 10) {run.reward:.3f}",
        file=sys.stderr,
        flush=True,
    )
    return run


def _timed(load: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    """``load`` that also appends each call's seconds to ``into``."""

    def timed(*args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = load(*args, **kw)
        into.append(time.perf_counter() - t0)
        return out

    return timed


def push_ms(runs: list[DemoRun]) -> float | None:
    """The median of every push of ``runs`` (the first of each run, before any engine
    served, left out), in ms; None without pushes."""
    every = [p for r in runs for p in r.pushes[1:]]
    return statistics.median(every) * 1e3 if every else None


def demo_table(variants: list[str], runs: dict[str, list[DemoRun]]) -> tuple[str, dict[str, float]]:
    base = variants[0]
    med = {
        v: (
            statistics.median(r.steps_per_s for r in runs[v]),
            statistics.median(r.tokens_per_s for r in runs[v]),
        )
        for v in variants
    }
    rows = [
        "| engine | steps/s (median, min-max) | trained tokens/s (median) "
        "| steps/s vs in-process | tokens/s vs in-process | reward, last 10 steps (median) "
        "| push ms (median) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    ratios = {}
    for v in variants:
        rates = [r.steps_per_s for r in runs[v]]
        ratio = med[v][0] / med[base][0]
        ratios[v] = ratio
        reward = statistics.median(r.reward for r in runs[v])
        pushed = push_ms(runs[v])
        rows.append(
            f"| {v} | {med[v][0]:.2f} ({min(rates):.2f}-{max(rates):.2f}) | {med[v][1]:,.0f} "
            f"| {ratio:.2f}x | {med[v][1] / med[base][1]:.2f}x | {reward:.3f} "
            f"| {'-' if pushed is None else f'{pushed:.1f}'} |"
        )
    return "\n".join(rows), ratios


# ------------------------------------------------------------------ main

LOCAL_2 = "EngineFleet of 2, one torch thread per engine"
RAY_2 = "EngineFleet of 2 placed by Ray"


def ray_line(runs: dict[str, list[DemoRun]], ratios: dict[str, float]) -> str:
    """The Ray-placed fleet against the launched one of the same size: steps/s and push
    latency as ratios (empty when either is missing)."""
    if not (runs.get(LOCAL_2) and runs.get(RAY_2)):
        return ""
    local, placed = push_ms(runs[LOCAL_2]), push_ms(runs[RAY_2])
    pushes = "" if not (local and placed) else f", push latency {placed / local:.2f}x"
    return (
        f"\n\nPlaced by Ray against launched here (fleets of 2, one torch thread per engine "
        f"both, same run): steps/s "
        f"{ratios[RAY_2] / ratios[LOCAL_2]:.2f}x{pushes}."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="~10M,~100M", help=f"push models: {', '.join(SIZES)}")
    ap.add_argument("--pushes", type=int, default=7, help="pushes per path and size")
    ap.add_argument("--steps", type=int, default=40, help="demo steps per run")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per engine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="seconds-long smoke run, no write")
    ap.add_argument("--only", default="", help="demo rows to run, by label, ';'-separated")
    ap.add_argument("--no-push", action="store_true", help="skip the push-latency part")
    ap.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args()
    if args.write and (args.only or args.no_push):
        ap.error("--write replaces the whole section: leave out --only and --no-push")
    if args.tiny:
        args.sizes, args.pushes, args.steps, args.repeats, args.write = "~0.1M", 2, 3, 1, False
    # A local Ray instance's own token, never one written to ~/.ray for later runs.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if "OMP_NUM_THREADS" not in os.environ:  # as dew demo does: half the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    load_before = os.getloadavg()[0]
    t_start = time.perf_counter()

    print("push latency", file=sys.stderr)
    sizes = [] if args.no_push else [s for s in args.sizes.split(",") if s]
    pushes = [push_latency(s, args.pushes) for s in sizes]
    pushed = push_table(pushes)
    print(pushed, flush=True)

    print("demo workload", file=sys.stderr)
    fleet = _fleet_class()
    plan: list[tuple[str, int, str | None, bool, bool]] = [
        ("in-process RolloutServer", 0, None, False, False)
    ]
    if fleet:
        plan += [
            ("EngineFleet of 1", 1, None, False, False),
            ("EngineFleet of 1, one request per group", 1, None, True, False),
            ("EngineFleet of 2", 2, None, False, False),
        ]
        if importlib.util.find_spec("sglang_router") is not None:
            plan.append(("EngineFleet of 2 behind sglang-router", 2, "cache_aware", False, False))
        if importlib.util.find_spec("ray") is not None:
            plan += [(LOCAL_2, 2, None, False, False), (RAY_2, 2, None, False, True)]
    else:
        plan.append(("HTTPEngine", -1, None, False, False))
    if args.only:
        plan = [p for p in plan if p[0] in args.only.split(";")]
    runs: dict[str, list[DemoRun]] = {label: [] for label, *_ in plan}
    failed: dict[str, list[str]] = {label: [] for label, *_ in plan}
    for _ in range(args.repeats):
        for label, engines, router, batch, ray in plan:
            try:
                one = label == LOCAL_2  # Ray runs an actor of one CPU on one torch thread
                run = demo_run(label, engines, args.steps, args.seed, router, batch, ray, one)
                runs[label].append(run)
            except Exception as exc:  # a failed run is reported, not hidden
                if engines == 0 or args.tiny:
                    raise
                first = str(exc).splitlines()[0][:300]
                failed[label].append(f"{type(exc).__name__}: {first}")
                print(f"  {label}: FAILED: {failed[label][-1]}", file=sys.stderr, flush=True)
    variants = [label for label, *_ in plan if runs[label]]
    failures = "".join(
        f"\n\n{label}: {len(msgs)} of {args.repeats} runs failed: " + "; ".join(msgs)
        for label, msgs in failed.items()
        if msgs
    )
    demo, ratios = demo_table(variants, runs)
    demo += ray_line(runs, ratios)
    print()
    print(demo + failures)
    wall = time.perf_counter() - t_start
    print(f"\nwall time {wall:.0f} s", file=sys.stderr)
    if not args.write:
        return
    command = command_line("fleet.py")
    host = machine(
        f"torch {torch.__version__} ({torch.get_num_threads()} threads here)",
        f"transformers {transformers.__version__}",
    )
    missing = (
        ""
        if fleet
        else "\n\nEngineFleet was not importable for this run: the fleet rows are missing; "
        "the second row is one `dew serve` process behind an `HTTPEngine`."
    )
    init = ", ".join(f"{r.size} {r.init_ms:,.0f} ms" for r in pushes)
    write_section(
        "## fleet\n\n"
        f"Command: `{command}` ({wall / 60:.0f} min)  \n"
        f"Machine: {host}  \n"
        f"Date: {datetime.date.today().isoformat()} (1-minute load average "
        f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after: a shared machine)\n\n"
        f"Weight push, trainer (this process) to one `dew serve --model` process on "
        f"127.0.0.1: random-weight Qwen2 models in fp32, {args.pushes} pushes per path, "
        f"paths alternating (rotated order each round). `file: HTTPEngine.load` is the "
        f"whole file path (write into /dev/shm + `/update_weights_from_disk`); its two "
        f"parts were timed on their own in separate pushes. Broadcast: from the "
        f"`/update_weights_from_distributed` request to its answer, the trainer's "
        f"`BroadcastGroup.broadcast` running meanwhile; joining the group "
        f"(`/init_weights_update_group`, once) took {init}. GB/s: the model's tensor "
        f"bytes over the median time.\n\n"
        f"{pushed}\n\n"
        f"Demo workload: the single-turn demo task at its tuned settings, {args.steps} "
        f"steps per run, {args.repeats} runs per engine alternating, fleets started fresh "
        f"per run (start-up not timed), `--max-batch` as the in-process engine, same seed. "
        f"Rates over `fit`'s wall time; tokens: completion tokens trained. Ratios: "
        f"medians over the in-process median. Push ms: the fleet's `load` (every push "
        f"after each run's first). Placed by Ray: `EngineFleet.on_ray` on a local Ray "
        f"instance started for the run (not timed), one actor per engine; Ray gives an "
        f"actor of one CPU one thread (`OMP_NUM_THREADS=1`), which its server inherits, so "
        f"it is compared with the launched fleet run the same way.{missing}\n\n"
        f"{demo}{failures}\n"
    )
    biggest = pushes[-1]
    file_ms = statistics.median(biggest.ms[PATHS[0]])
    bcast_ms = statistics.median(biggest.ms[PATHS[3]])
    write_summary_row(
        "fleet",
        f"push {biggest.size} ({biggest.params / 1e6:.0f}M params): file {file_ms:,.0f} ms, "
        f"broadcast {bcast_ms:,.0f} ms (medians); demo steps/s vs in-process: "
        + ", ".join(f"{v} {r:.2f}x" for v, r in list(ratios.items())[1:])
        + "".join(f"; {v}: {len(m)} of {args.repeats} runs failed" for v, m in failed.items() if m),
        "reported (issue 17: no target)",
        "measured",
    )
    print(f"wrote the fleet section of {RESULTS}")


if __name__ == "__main__":
    main()
