"""The demo job: GRPO on an example task, end to end, on a laptop CPU.

One function, :func:`run_demo`, wires every part of dew together the way a user
would: a tiny randomly initialized model built from a config, the in-process
:class:`~dew.serving.RolloutServer` serving a copy of it, a source for the chosen task
(single-turn prompts with a verifier, or a multi-turn environment), the
:class:`~dew.objectives.rl.scheduler.RolloutScheduler` keeping one batch of rollouts
in flight ahead of the trainer, and :func:`dew.train.fit` taking one AdamW update
per batch. A progress bar shows step, reward, lag and wait; the run folder gets
``config.json``, ``records.jsonl``, the checkpoints and ``plot.png``.

The job is assembled by :mod:`dew.recipe` from :func:`demo_recipe`, as ``dew train``'s
is; this module keeps the demo's own settings (:class:`DemoConfig`, the tuned
``TASK_DEFAULTS``), its model and engine choice, and the run folder. Tasks come from a
registry (:data:`dew.demo.sources.TASKS`: name -> builder), so adding one is one entry.
``--resume RUN_DIR`` reads the run's ``config.json`` back and continues it.

Threads: the server's engine thread, the scheduler's driver thread and the source's
worker threads are all owned here and closed (joined) on the way out, in the reverse
order of construction, whether training ends or raises.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dew._checkpoint import checkpoints, step_of
from dew._progress import progress_bar
from dew.core import as_int
from dew.demo.sources import TASKS, TaskBuilder, TaskParts
from dew.demo.tail import Workload
from dew.objectives.rl.config import SchedulerConfig
from dew.recipe import Job, Needs, Recipe, RecipeError, assemble, join_pool
from dew.train import FitResult, read_records

__all__ = [
    "TASKS",
    "TASK_DEFAULTS",
    "DemoConfig",
    "DemoError",
    "DemoResult",
    "TaskParts",
    "build_job",
    "demo_recipe",
    "run_demo",
]


class DemoError(ValueError):
    """A demo asked for something it cannot do (a missing run folder, a taken one)."""


_SCHEDULER = SchedulerConfig()
_TAIL = Workload()


@dataclass(frozen=True)
class DemoConfig:
    """Everything a demo run is built from; stored as the run's ``config.json``."""

    task: str = "single"
    steps: int = 60
    seed: int = 0
    size: str = "tiny"
    arch: str = "qwen2"
    lr: float = 3e-3
    group_size: int = 8
    batch_size: int = 8  # tasks per step (under torchrun: split over the data axis)
    max_tokens: int = 8
    temperature: float = 1.0
    # The scheduler's own defaults unless a task says otherwise (written once, there).
    ahead: int = _SCHEDULER.ahead
    max_lag: int = _SCHEDULER.max_lag
    oversample: int = _SCHEDULER.oversample
    admit: int | None = _SCHEDULER.admit
    truncation: str = _SCHEDULER.truncation  # type: ignore[assignment]
    estimator: str = _SCHEDULER.estimator  # type: ignore[assignment]
    clip_high: float | None = None  # DAPO's clip-higher: keeps exploration alive
    # The behavior weight's rule and bound (None: GRPOObjective's defaults).
    importance: str | None = None
    importance_cap: float | None = None
    # GRPOObjective's: also clip against the behavior policy (True, or a rule's name)
    clip_behavior: bool | str = False
    # fit takes one update per batch, so the loss's own forward gives the proximal
    # log-probs exactly and the rescoring forward is skipped (GRPOObjective's docstring).
    proximal: str = "forward"
    # What a weight push does to the in-process engine's running requests: "keep" their
    # keys/values (and the finished turns' kept ones) rather than recompute them under the
    # new weights; their behavior log-probs stay exact (RolloutServer's docstring). It is
    # the faster of the two on the multi-turn tail task (bench/RESULTS.md, "Figures moved
    # out of code comments").
    on_load: str = "keep"
    # Iterations a busy in-process engine may put off admitting a few arrivals so that
    # they share a prefill (None: RolloutServer's default; 0 admits at every iteration).
    admit_wait: int | None = None
    digits: tuple[int, int] = (2, 4)  # single task: shortest and longest digit string
    stop_weight: float = 1.0  # single task: credit for stopping, in digit positions
    checkpoint_every: int = 20
    tasks: int = 4096  # rows of the task dataset
    engines: int = 0  # 0: the in-process engine; N: a fleet of N local `dew serve` processes
    # agent task: 0 runs the agent on the source's threads, N in N harness processes
    harness_processes: int = 0
    tensor: int = 1  # under torchrun: processes per tensor-parallel group (the rest is data)
    # Seconds a rollout attempt may run before it is cancelled and retried (the library's
    # default, None, would let a hung source block the trainer forever). Tighter than
    # dew train's (dew.job.config.JOB_ROLLOUT_TIMEOUT): every demo rollout takes well
    # under a second, so a hang shows sooner; a user's model and verifier may need minutes.
    timeout: float | None = 120.0

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task={self.task!r} is not one of {sorted(TASKS)}")
        whole = ("steps", "group_size", "batch_size", "max_tokens", "checkpoint_every", "tensor")
        for name, least in [(n, 1) for n in whole] + [("engines", 0), ("harness_processes", 0)]:
            value = getattr(self, name)
            as_int(value, f"{name}={value!r}", minimum=least)
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r} must be > 0")
        if self.tasks < self.batch_size:
            raise ValueError(f"tasks={self.tasks} must be >= batch_size={self.batch_size}")
        from dew.demo.model import ARCHS, SIZES

        if self.size not in SIZES:
            raise ValueError(f"size={self.size!r} is not one of {sorted(SIZES)}")
        if self.arch not in ARCHS:
            raise ValueError(f"arch={self.arch!r} is not one of {sorted(ARCHS)}")
        self.scheduler_config()  # the scheduler's own checks, before anything is built

    def scheduler_config(self) -> SchedulerConfig:
        """The scheduling knobs of this demo (checked by SchedulerConfig itself)."""
        return SchedulerConfig(
            groups=self.group_size,
            oversample=self.oversample,
            admit=self.admit,
            ahead=self.ahead,
            max_lag=self.max_lag,
            truncation=self.truncation,
            estimator=self.estimator,
            timeout=self.timeout,
        )

    @property
    def positions(self) -> int:
        """Positions the task's model is built with (its longest chain fits)."""
        return _TASK_POSITIONS.get(self.task, _POSITIONS)

    @classmethod
    def for_task(cls, task: str, **overrides: Any) -> DemoConfig:
        """The tuned settings of ``task`` (see ``TASK_DEFAULTS``) with ``overrides``."""
        if task not in TASKS:
            raise ValueError(f"task={task!r} is not one of {sorted(TASKS)}")
        return cls(task=task, **{**TASK_DEFAULTS.get(task, {}), **overrides})


@dataclass(frozen=True)
class DemoResult:
    """Where the run went and what it reached."""

    run_dir: Path
    fit: FitResult
    seconds: float
    plot: Path | None
    describe: str = ""  # the task's parameters, when it has any worth printing

    def rewards(self) -> list[float]:
        """Mean reward per step of the whole run (resumed parts included)."""
        out = []
        for r in read_records(self.run_dir):
            reward = r.get("scheduler", {}).get("metrics", {}).get("reward/mean")
            if reward is not None:
                out.append(float(reward))
        return out

    def summary(self) -> str:
        rewards = self.rewards()
        tenth = max(1, len(rewards) // 10)
        first = sum(rewards[:tenth]) / tenth if rewards else float("nan")
        last = sum(rewards[-tenth:]) / tenth if rewards else float("nan")
        return (
            f"run folder: {self.run_dir}\n"
            f"steps: {self.fit.updates}  time: {self.seconds:.1f}s\n"
            f"mean reward, first 10% of steps: {first:.3f}  last 10%: {last:.3f}\n"
            f"checkpoint: {self.fit.checkpoint}\nplot: {self.plot}"
            + (f"\n{self.describe}" if self.describe else "")
        )


# Positions the demo model is built with; the heavy-tailed tasks' chains are longer.
_POSITIONS = 256
_TASK_POSITIONS = {"tail": 512, "tail-turns": 512}


# Settings per task, tuned so each demo learns within minutes on 2 CPU cores.
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    # Copy three digits, credit per right digit (the stop token earns nothing: with
    # max_tokens equal to the answer length every completion ends on the third token).
    # Each output copies the token a fixed three positions back, so every rollout
    # carries three signals of the same skill. An untrained model scores ~0.01 and
    # random digits 0.1. The failure to avoid is one position collapsing onto a fixed
    # digit while the others are learned (the run then plateaus near 0.6): 32 samples
    # per prompt average out the noise that position's token picks up from the others'
    # rewards and keep the right digit sampled often enough to be found (with 16
    # samples and 8 prompts per step, 2 of 7 measured runs plateaued that way).
    "single": {
        "steps": 800,
        "lr": 1e-3,
        "temperature": 1.0,
        "group_size": 32,
        "batch_size": 4,
        "max_tokens": 3,
        "digits": (3, 3),
        "stop_weight": 0.0,
        "estimator": "group_std",
        "clip_high": 0.28,
        "truncation": "score",
        "checkpoint_every": 100,
    },
    "guess": {},
    # The agent runs in a harness process of its own: its openai client's CPU then
    # leaves this process's interpreter lock to the engine, the gateway and the trainer,
    # and steps are faster for it (bench/RESULTS.md, "Figures moved out of code comments").
    "agent": {"steps": 60, "max_tokens": 4, "harness_processes": 1},
    # The heavy-tailed workload (dew.demo.tail): completions may run to the workload's
    # length cap (per turn on the multi-turn variant).
    # Truncated answers are scored (diluted by their run-on tokens), not masked: a
    # masked one escapes every penalty, and lengths then run away to the cap.
    # The behavior weight is truncated at 10, not the objective's 2: rollouts a few
    # updates old under-sample exactly the tokens the policy is learning fastest, and a
    # low cap takes most of their correction away. The behavior clip keeps stale batches
    # from pushing the stop token's probability past where the policy already took it,
    # which otherwise swings the answer lengths from batch to batch (bench/RESULTS.md,
    # "async steps"); on both sides of the band: the negative side alone did no better on
    # seeds no one tuned on (bench/RESULTS.md, profile item 42).
    "tail": {
        "steps": 200,
        "lr": 1e-3,
        "max_tokens": _TAIL.length_cap,
        "estimator": "group_std",
        "clip_high": 0.28,
        "importance_cap": 10.0,
        "clip_behavior": True,
        "truncation": "score",
    },
    "tail-turns": {
        "steps": 200,
        "lr": 1e-3,
        "max_tokens": _TAIL.turn_cap,
        "estimator": "group_std",
        "clip_high": 0.28,
        "importance_cap": 10.0,
        "clip_behavior": True,
        "truncation": "score",
    },
}


def _share_cores(torch: Any) -> None:
    """Give torch half the cores: the engine thread and the trainer compute at once.

    With two threads each asking for every core, they slow each other down (time the
    demo with ``OMP_NUM_THREADS`` set either way to see it on a given machine).
    A thread count set from outside (``OMP_NUM_THREADS``, which torchrun sets for its
    workers) is left alone.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 2) // 2))


def _default_run_dir() -> Path:
    return Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")


def _write_config(run: Path, config: DemoConfig) -> None:
    if run.exists() and not run.is_dir():
        raise DemoError(f"{run} is a file, not a run folder")
    try:
        run.mkdir(parents=True, exist_ok=True)
        (run / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2))
    except OSError as exc:
        raise DemoError(f"{run} cannot be written: {exc}") from None


def _load_config(run_dir: Path) -> DemoConfig:
    path = run_dir / "config.json"
    if not path.is_file():
        raise DemoError(f"{path}: missing; {run_dir} is not a dew demo run folder")
    try:
        stored = json.loads(path.read_text())
        stored["digits"] = tuple(stored.get("digits", DemoConfig.digits))
        return DemoConfig(**stored)
    except (ValueError, TypeError, AttributeError) as exc:  # garbled, or not a demo's
        raise DemoError(f"{path}: not a readable demo config ({exc})") from None


def demo_recipe(
    config: DemoConfig, *, task: TaskBuilder | None = None, engine: Any = None
) -> Recipe:
    """The demo job of ``config`` as a :class:`~dew.recipe.Recipe`: a model built from
    the config, the in-process engine (or ``config.engines`` local ``dew serve``
    processes), the task's source. ``task`` replaces the registry's builder for
    ``config.task`` (bench/vs_trl.py builds its two-turn task this way). ``engine``: an
    Engine and Publisher to run on instead of the one ``config`` describes (an
    HTTPEngine, a fleet made elsewhere); the caller closes it."""
    from dew.core import SamplingParams
    from dew.demo.model import make_model, make_tokenizer

    tokenizer = make_tokenizer()
    build = task or TASKS[config.task]
    chosen = {"importance": config.importance, "importance_cap": config.importance_cap}
    return Recipe(
        model=lambda: make_model(
            config.arch, config.size, seed=config.seed, max_positions=config.positions
        ),
        engine=lambda needs, stack: engine if engine is not None else _engine(config, needs, stack),
        source=lambda server, needs: build(config, server, tokenizer, needs),
        sampling=SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature),
        scheduler=config.scheduler_config(),
        rows=config.tasks,
        tasks=config.batch_size,
        lr=config.lr,
        objective={
            "clip_high": config.clip_high,
            "proximal": config.proximal,
            "clip_behavior": config.clip_behavior,
            **{name: value for name, value in chosen.items() if value is not None},
        },
        seed=config.seed,
        data_seed=1,  # one task order whatever the seed: seeds vary the model and sampling
        parallel={"tensor": config.tensor},
    )


def _engine(config: DemoConfig, needs: Needs, stack: ExitStack) -> Any:
    """The demo's own engine: in process, or a fleet of local ``dew serve`` processes."""
    server: Any
    if config.engines:
        from dew.serving.fleet import EngineFleet

        if config.arch != "qwen2":
            raise ValueError(
                f"engines={config.engines} serves qwen2 demo models, not {config.arch}"
            )
        # Same size and seed as the trainer's model: the engines start from its weights
        # (the scheduler's first push makes sure of it either way).
        server = EngineFleet.launch(
            config.engines,
            demo=config.size,
            seed=needs.seed,
            args=["--max-batch", str(needs.in_flight)],
        )
    else:
        from dew.serving import RolloutServer

        waits = {} if config.admit_wait is None else {"admit_wait": config.admit_wait}
        server = RolloutServer(
            needs.model,
            max_batch=needs.in_flight,
            seed=needs.seed,
            on_load=config.on_load,
            **waits,
        )
    stack.callback(server.close)
    return server


def build_job(
    config: DemoConfig,
    stack: ExitStack,
    *,
    pool: Any = None,
    task: TaskBuilder | None = None,
    engine: Any = None,
) -> Job:
    """:func:`dew.recipe.assemble` of :func:`demo_recipe` (``pool``: a torchrun job's,
    from :func:`dew.recipe.join_pool`); ``stack`` closes what it starts. Torch's thread
    count is the caller's to set."""
    return assemble(demo_recipe(config, task=task, engine=engine), stack, pool)


def run_demo(
    config: DemoConfig | None = None,
    *,
    run_dir: str | Path | None = None,
    resume: str | Path | None = None,
    progress: bool = True,
    plot: bool = True,
) -> DemoResult:
    """Train the demo task; with ``resume`` (a run folder) continue that run instead.

    On resume the run's stored config is used; ``config.steps`` (when given) may raise
    the step target.
    """
    import torch

    t0 = time.monotonic()
    with ExitStack() as stack:
        # Under torchrun every process runs this function; each trains on its own share
        # of every task batch with its own engine and scheduler (see dew.pool).
        if resume is not None:
            run = Path(resume)
            stored = _load_config(run)
            if config is not None and config.steps > stored.steps:
                stored = dataclasses.replace(stored, steps=config.steps)
            config = stored
        else:
            config = config or DemoConfig.for_task("single")
            run = Path(run_dir) if run_dir is not None else _default_run_dir()
        recipe = demo_recipe(config)
        try:
            pool = join_pool(recipe.parallel, stack)
        except RecipeError as exc:
            raise DemoError(exc.message) from None
        lead = pool is None or pool.rank == 0
        if resume is None:
            if pool is not None:  # one folder for the job: rank 0's name
                run = Path(pool.exchange("run_dir", str(run))[0])
            if (run / "checkpoints").exists():
                raise DemoError(f"{run} already holds a run; continue it with --resume {run}")
        _share_cores(torch)
        job = assemble(recipe, stack, pool)
        if lead:  # only once the job is built: a config that cannot run leaves nothing
            _write_config(run, config)
        log = []
        # Where the bar starts (fit checks the checkpoint itself).
        saved = checkpoints(run / "checkpoints") if resume is not None else []
        done = step_of(saved[-1]) or 0 if saved else 0
        if progress and lead:
            update, bar = progress_bar(config.steps, done, "dew demo")
            stack.callback(bar.close)
            log.append(update)
        result = job.fit(
            steps=config.steps,
            run_dir=run,
            checkpoint_every=config.checkpoint_every,
            resume=False if resume is None else run,  # a resume must find a checkpoint
            log=log,
            config=dataclasses.asdict(config),
            freeze_gc=True,  # a long-lived process with a large set-up heap: see fit's doc
        )
    drawn = None
    if plot and lead:
        from dew.plot import plot_run

        drawn = plot_run(run)
    return DemoResult(
        run_dir=run, fit=result, seconds=time.monotonic() - t0, plot=drawn, describe=job.describe
    )
