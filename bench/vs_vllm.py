"""dew on vLLM against dew on its own engine: the demo's copy task, the same model.

(Not ``vllm.py``: scripts here run with bench/ first on their path, where that name
would stand in for the vllm package.)

The task and settings are the demo's tuned single-turn ones (``DemoConfig.for_task
("single")``: copy three digits, 4 prompts x 32 samples, 3 new tokens, temperature 1,
one AdamW update per batch, scheduler ahead 1), on the ``tiny64`` Qwen2 (heads of 64
dimensions: the smallest vLLM's CPU attention serves). Three engines, each a run of
its own process, interleaved per seed so the machine's drift hits all alike:

* ``own, in process``: dew's ``RolloutServer`` in the trainer's process (the demo);
* ``own, 1 dew serve``: the same engine in one ``dew serve`` process behind an
  ``EngineFleet``: the process and HTTP shape of the vLLM row, with dew's engine;
* ``vLLM, 1 server``: one vLLM server (vLLM's CPU build, ``make vllm-env``) behind an
  ``EngineFleet(engine="vllm")``, weights pushed every step through dew's extension.

Each run starts its engine, then its clock: seconds to the reward threshold (the first
10-step window whose mean reaches it), steps to it, seconds per step and completions
per second; the engine's start-up is reported apart. After training, with the
scheduler closed, what a step asks of the engine is timed alone: one weight push, and
one step's rollouts submitted at once (where the per-step time goes). Figures are
medians over the seeds with their range. TRL's ``GRPOTrainer`` in its vLLM server mode
is not run: see ``TRL_VLLM`` (printed with the results).

``--write`` replaces the ``## vllm`` section of bench/RESULTS.md and its summary row;
``--tiny`` runs every engine for a few steps on one seed and writes nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_results.py, _vs_trl_*.py
from _results import provenance, provenance_lines, write_section, write_summary_row
from _vs_trl_common import RunResult, RunSpec, StepClock, demo_config

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
SIZE = "tiny64"
ENGINES = {  # label: (engine kind, engine processes)
    "own, in process": ("dew", 0),
    "own, 1 dew serve": ("dew", 1),
    "vLLM, 1 server": ("vllm", 1),
}
VLLM_ARGS = ["--dtype", "float32", "--enforce-eager"]
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
TRL_VLLM = (
    "TRL's GRPOTrainer in vLLM server mode is not run: its client "
    "(trl/generation/vllm_client.py, VLLMClient.init_communicator, TRL 1.16) syncs weights "
    "only through vLLM's NCCL weight-transfer engine and raises NotImplementedError for a "
    "device that is not CUDA, so no step can follow the first on this CPU. (It also needs "
    "vllm importable in the trainer's own environment, whose torch and transformers vLLM "
    "pins.)"
)


def run_one(spec: RunSpec, kind: str, engines: int, vllm_python: str) -> dict[str, Any]:
    """One timed run (in this process): start the engine, train until the threshold."""
    import torch

    from dew.demo.model import make_model, make_tokenizer
    from dew.demo.run import build_job
    from dew.serving.fleet import EngineFleet
    from dew.train import fit

    torch.set_num_threads(spec.threads)
    config = demo_config(spec)
    config = dataclasses.replace(config, size=SIZE)
    rows = config.batch_size * config.group_size
    result = RunResult(spec=spec, rows=rows)
    clock = StepClock(spec, result)

    class Enough(Exception):
        pass

    def on_record(record: dict[str, Any]) -> None:
        sched = record["scheduler"]
        if clock.step(sched["metrics"]["reward/mean"], sched["waited"]):
            raise Enough

    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        engine = None
        if engines:
            folder = Path(tmp) / "model"
            make_model(
                config.arch, SIZE, seed=spec.seed, max_positions=config.positions
            ).save_pretrained(folder)
            make_tokenizer().save_pretrained(folder)
            threads = {"OMP_NUM_THREADS": str(spec.threads)}
            if kind == "vllm":
                engine = EngineFleet.launch(
                    engines, model=folder, engine="vllm", python=vllm_python,
                    args=VLLM_ARGS, env=VLLM_ENV, startup_timeout=300, seed=spec.seed,
                )  # fmt: skip
            else:
                engine = EngineFleet.launch(engines, model=folder, env=threads, seed=spec.seed)
            stack.callback(engine.close)
        startup = time.monotonic() - started
        job = build_job(config, stack, engine=engine)
        result.objective = repr(job.objective)
        clock.start()
        try:
            fit(
                job.model, job.optimizer, job.dataset, job.scheduler, job.objective,
                steps=spec.max_steps, checkpoint_every=None, log=[on_record],
                tensorboard=False, freeze_gc=True,
            )  # fmt: skip
        except Enough:
            pass
        job.scheduler.close()  # its rollouts in flight are cancelled: the engine is idle
        costs = step_costs(job.engine, job.model, rows, config.max_tokens)
    return {"result": json.loads(result.to_json()), "startup": startup, **costs}


def step_costs(engine: Any, model: Any, rows: int, max_tokens: int) -> dict[str, float]:
    """What a training step asks of the engine, each timed alone (medians of 5): one
    weight push, and one step's rollouts (``rows`` completions of ``max_tokens``
    tokens of a 20-token prompt, submitted at once)."""
    from dew.core import SamplingParams

    pushes, batches = [], []
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, stop_ids=())
    prompt = [6 + (i * 7) % 90 for i in range(20)]
    for _ in range(5):
        started = time.monotonic()
        engine.load(model, engine.version + 1)
        pushes.append(time.monotonic() - started)
        started = time.monotonic()
        for future in [engine.submit(prompt, params) for _ in range(rows)]:
            future.result(timeout=120)
        batches.append(time.monotonic() - started)
    return {"push": statistics.median(pushes), "batch": statistics.median(batches)}


def run_worker(spec: RunSpec, kind: str, engines: int, vllm_python: str) -> dict[str, Any]:
    """``run_one`` in a fresh process, one at a time, so runs never share the cores."""
    env = {**os.environ, "OMP_NUM_THREADS": str(spec.threads), "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        argv = [sys.executable, __file__, "--worker", spec.to_json(), kind, str(engines)]
        argv += [vllm_python, str(out)]
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"{kind} x{engines} seed {spec.seed} failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def _spread(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return format(med, fmt)
    return f"{format(med, fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def report(runs: dict[str, list[dict[str, Any]]], threshold: float) -> tuple[str, dict]:
    """The results table and the medians the ratios use."""
    lines = [
        f"| engine | seconds to reward {threshold} | steps to it | s/step | completions/s "
        "| reached | engine start-up s | push ms | one step's rollouts ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    medians: dict[str, dict[str, float]] = {}
    for label, outs in runs.items():
        results = [RunResult.from_json(json.dumps(o["result"])) for o in outs]
        reached = [r.reached() for r in results]
        secs = [x[1] for x in reached if x is not None]
        steps = [float(x[0]) for x in reached if x is not None]
        per_step = [r.seconds_per_step for r in results]
        cps = [r.completions_per_second for r in results]
        lines.append(
            f"| {label} | {_spread(secs, '.1f')} | {_spread(steps, '.0f')} | "
            f"{_spread(per_step, '.3f')} | {_spread(cps, ',.0f')} | "
            f"{len(secs)}/{len(results)} | {_spread([o['startup'] for o in outs], '.1f')} | "
            f"{_spread([1000 * o['push'] for o in outs], '.1f')} | "
            f"{_spread([1000 * o['batch'] for o in outs], '.1f')} |"
        )
        medians[label] = {
            "seconds": statistics.median(secs) if len(secs) == len(results) else float("nan"),
            "per_step": statistics.median(per_step),
            "cps": statistics.median(cps),
        }
    return "\n".join(lines) + "\n", medians


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        spec, kind, engines, python, out = sys.argv[2:7]
        done = run_one(RunSpec.from_json(spec), kind, int(engines), python)
        Path(out).write_text(json.dumps(done))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=400, help="a run's step cap")
    # The tiny64 model, under the demo's settings (tuned on the smaller tiny), climbs to
    # about 0.5 in 600 steps; 0.3 falls in its steep part.
    p.add_argument("--threshold", type=float, default=0.3)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the trainer")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--tiny", action="store_true", help="a few steps on one seed; no write")
    p.add_argument("--write", action="store_true", help="write bench/RESULTS.md")
    args = p.parse_args()
    seeds = [0] if args.tiny else [int(s) for s in args.seeds.split(",")]
    steps = 3 if args.tiny else args.steps
    started = time.monotonic()
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in ENGINES}
    for seed in seeds:
        for label, (kind, engines) in ENGINES.items():
            spec = RunSpec(
                system="dew", task="single", seed=seed, threads=args.threads,
                max_seconds=3600, max_steps=steps, stop_at_reward=not args.tiny,
                threshold=args.threshold, small=args.tiny,
            )  # fmt: skip
            out = run_worker(spec, kind, engines, args.vllm_python)
            runs[label].append(out)
            r = RunResult.from_json(json.dumps(out["result"]))
            print(f"seed {seed} {label}: {r.steps} steps, {r.seconds:.1f} s, reached {r.reached()}")
    table, med = report(runs, args.threshold)
    own, serve, vllm = (med[label] for label in ENGINES)
    ratios = (
        f"vLLM / own engine in process: {vllm['per_step'] / own['per_step']:.2f}x the seconds "
        f"per step, {vllm['seconds'] / own['seconds']:.2f}x the seconds to reward; "
        f"vLLM / own engine in 1 dew serve: {vllm['per_step'] / serve['per_step']:.2f}x the "
        f"seconds per step, {vllm['seconds'] / serve['seconds']:.2f}x the seconds to reward"
    )
    print(table + "\n" + ratios + "\n\n" + TRL_VLLM)
    if not args.write or args.tiny:
        return
    from importlib.metadata import version

    vllm_version = subprocess.run(
        [args.vllm_python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    run = provenance(
        "vs_vllm.py",
        time.monotonic() - started,
        f"torch {version('torch')}",
        f"vllm-cpu {vllm_version}",
    )
    section = (
        "## vllm\n\n"
        "dew on vLLM against dew on its own engine (`bench/vs_vllm.py`): the demo's copy task, "
        f"tiny64 Qwen2, seeds {args.seeds} interleaved, medians (range), trainer on "
        f"{args.threads} torch thread(s).\n\n"
        + provenance_lines(run)
        + "\n"
        + table
        + "\n"
        + ratios
        + ".\n\n"
        + TRL_VLLM
        + "\n"
    )
    write_section(section)
    write_summary_row(
        "dew on vLLM vs its own engine",
        ratios,
        "reported (issue 34: no target)",
        "measured",
    )


if __name__ == "__main__":
    main()
