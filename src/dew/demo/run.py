"""The demo job: GRPO on an example task, end to end, on a laptop CPU.

One function, :func:`run_demo`, wires every part of dew together the way a user
would: a tiny randomly initialized model built from a config, the in-process
:class:`~dew.serving.RolloutServer` serving a copy of it, a source for the chosen task
(single-turn prompts with a verifier, or a multi-turn environment), the
:class:`~dew.objectives.rl.scheduler.RolloutScheduler` keeping one batch of rollouts
in flight ahead of the trainer, and :func:`dew.train.fit` taking one AdamW update
per batch. A progress bar shows step, reward, lag and wait; the run folder gets
``config.json``, ``records.jsonl``, the checkpoints and ``plot.png``.

Tasks come from a registry (name -> builder), so adding one is one entry.
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
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dew._checkpoint import checkpoints, step_of
from dew._progress import progress_bar
from dew.demo.tail import Workload
from dew.objectives.rl.config import SchedulerConfig
from dew.train import FitResult, read_records

if TYPE_CHECKING:
    import torch

    from dew.data import Dataset
    from dew.objectives.rl.grpo import GRPOObjective
    from dew.objectives.rl.scheduler import RolloutScheduler
    from dew.serving import RolloutServer

__all__ = [
    "TASKS",
    "TASK_DEFAULTS",
    "DemoConfig",
    "DemoError",
    "DemoJob",
    "DemoResult",
    "build_job",
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
    batch_size: int = 8
    max_tokens: int = 8
    temperature: float = 1.0
    # The scheduler's own defaults unless a task says otherwise (written once, there).
    ahead: int = _SCHEDULER.ahead
    max_lag: int = _SCHEDULER.max_lag
    oversample: int = _SCHEDULER.oversample
    truncation: str = _SCHEDULER.truncation  # type: ignore[assignment]
    estimator: str = _SCHEDULER.estimator  # type: ignore[assignment]
    clip_high: float | None = None  # DAPO's clip-higher: keeps exploration alive
    # The behavior weight's rule and bound (None: GRPOObjective's defaults).
    importance: str | None = None
    importance_cap: float | None = None
    # fit takes one update per batch, so the loss's own forward gives the proximal
    # log-probs exactly and the rescoring forward is skipped (GRPOObjective's docstring).
    proximal: str = "forward"
    # What a weight push does to the in-process engine's running requests: "keep" their
    # keys/values (and the finished turns' kept ones) rather than recompute them under the
    # new weights; their behavior log-probs stay exact (RolloutServer's docstring). On the
    # multi-turn tail task, 60 steps: 41.8-50.4 s against 52.7-54.5 s recomputing.
    on_load: str = "keep"
    digits: tuple[int, int] = (2, 4)  # single task: shortest and longest digit string
    stop_weight: float = 1.0  # single task: credit for stopping, in digit positions
    checkpoint_every: int = 20
    tasks: int = 4096  # rows of the task dataset
    engines: int = 0  # 0: the in-process engine; N: a fleet of N local `dew serve` processes
    # agent task: 0 runs the agent on the source's threads, N in N harness processes
    harness_processes: int = 0
    tensor: int = 1  # under torchrun: processes per tensor-parallel group (the rest is data)
    # Seconds a rollout attempt may run before it is cancelled and retried (the library's
    # default, None, would let a hung source block the trainer forever).
    timeout: float | None = 120.0

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task={self.task!r} is not one of {sorted(TASKS)}")
        for name in ("steps", "group_size", "batch_size", "max_tokens", "checkpoint_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r} must be > 0")
        if self.tasks < self.batch_size:
            raise ValueError(f"tasks={self.tasks} must be >= batch_size={self.batch_size}")
        if isinstance(self.engines, bool) or not isinstance(self.engines, int) or self.engines < 0:
            raise ValueError(f"engines={self.engines!r} must be an int >= 0")
        if (
            isinstance(self.harness_processes, bool)
            or not isinstance(self.harness_processes, int)
            or self.harness_processes < 0
        ):
            raise ValueError(f"harness_processes={self.harness_processes!r} must be an int >= 0")
        if isinstance(self.tensor, bool) or not isinstance(self.tensor, int) or self.tensor < 1:
            raise ValueError(f"tensor={self.tensor!r} must be an int >= 1")
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


@dataclass
class TaskParts:
    """What a task builder hands back: the source and how wide its chains get."""

    source: Any
    max_chain: int  # longest prompt + completion tokens of one chain
    close: Callable[[], None] = lambda: None
    describe: str = ""  # the task's parameters, printed beside its results


def _workers(config: DemoConfig) -> int:
    """Enough source threads for every rollout of the batches in flight to run at once."""
    return config.batch_size * config.group_size * (config.ahead + 1)


# PromptSource submits without a thread per rollout; its pool only runs verifiers. Two
# threads keep up with the demo's verifier, and a large pool costs time, as each burst
# of finished calls wakes many threads (compare with bench/vs_trl.py).
_VERIFIERS = 2


def _single(config: DemoConfig, server: Any, tokenizer: Any) -> TaskParts:
    from dew.core import SamplingParams
    from dew.demo import tasks
    from dew.objectives.rl.sources import PromptSource

    low, high = config.digits
    task = tasks.make_task(
        config.tasks,
        seed=config.seed,
        tokenizer=tokenizer,
        min_digits=low,
        max_digits=high,
        stop_weight=config.stop_weight,
    )
    source = PromptSource(
        server,
        task.prompts,
        task.verifier,
        workers=_VERIFIERS,
        sampling=SamplingParams(
            max_tokens=config.max_tokens, temperature=config.temperature, stop_ids=[task.eos]
        ),
    )
    return TaskParts(source, task.max_prompt + config.max_tokens, source.close)


def _guess(config: DemoConfig, server: Any, tokenizer: Any) -> TaskParts:
    from dew.core import SamplingParams
    from dew.demo.guess import make_env
    from dew.objectives.rl.sources import EnvironmentSource

    turns, context = 4, 160
    source = EnvironmentSource(
        server,
        make_env(low=0, high=9, seed=config.seed),
        tokenizer=tokenizer,
        max_turns=turns,
        max_context=context,
        workers=_workers(config),
        sampling=SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature),
    )
    return TaskParts(source, context, source.close)


def _agent(config: DemoConfig, server: Any, tokenizer: Any) -> TaskParts:
    from dew.demo.agent import build_agent_source

    demo = build_agent_source(
        server,
        tokenizer,
        tasks=config.tasks,
        seed=config.seed,
        max_tokens=config.max_tokens,
        temperature=config.temperature,
        workers=_workers(config),
        processes=config.harness_processes,
    )
    return TaskParts(demo.source, demo.max_chain, demo.close)


def _tail(config: DemoConfig, server: Any, tokenizer: Any) -> TaskParts:
    from dew.core import SamplingParams
    from dew.demo.tail import make_tail_task
    from dew.objectives.rl.sources import PromptSource

    task = make_tail_task(config.tasks, seed=config.seed, tokenizer=tokenizer)
    # The verifier sleeps its latency in a worker: one per rollout in flight, so no
    # rollout waits for another's verification.
    source = PromptSource(
        server,
        task.prompts,
        task.verifier,
        workers=_workers(config),
        sampling=SamplingParams(
            max_tokens=config.max_tokens, temperature=config.temperature, stop_ids=[task.eos]
        ),
    )
    return TaskParts(
        source, task.max_prompt + config.max_tokens, source.close, task.workload.describe()
    )


def _tail_turns(config: DemoConfig, server: Any, tokenizer: Any) -> TaskParts:
    from dew.core import SamplingParams
    from dew.demo.tail import make_tail_task, turns_max_chain
    from dew.objectives.rl.sources import EnvironmentSource

    task = make_tail_task(config.tasks, seed=config.seed, tokenizer=tokenizer)
    width = turns_max_chain(task, tokenizer, config.max_tokens)
    source = EnvironmentSource(
        server,
        task.env,
        tokenizer=tokenizer,
        max_turns=task.workload.max_turns,
        max_context=width,
        workers=_workers(config),
        sampling=SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature),
    )
    return TaskParts(source, width, source.close, task.workload.describe())


# task name -> builder(config, server, tokenizer) -> TaskParts
TASKS: dict[str, Callable[[DemoConfig, Any, Any], TaskParts]] = {
    "single": _single,
    "guess": _guess,
    "agent": _agent,
    "tail": _tail,
    "tail-turns": _tail_turns,
}

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
    # leaves this process's interpreter lock to the engine, the gateway and the trainer
    # (0.29-0.30 s/step against 0.38-0.39 on the source's threads, 8 x 8, 2 cores).
    "agent": {"steps": 60, "max_tokens": 4, "harness_processes": 1},
    # The heavy-tailed workload (dew.demo.tail): completions may run to the workload's
    # length cap (per turn on the multi-turn variant).
    # Truncated answers are scored (diluted by their run-on tokens), not masked: a
    # masked one escapes every penalty, and lengths then run away to the cap.
    # The behavior weight is truncated at 10, not the objective's 2: rollouts a few
    # updates old under-sample exactly the tokens the policy is learning fastest, and a
    # low cap takes most of their correction away (bench/RESULTS.md, "async steps").
    "tail": {
        "steps": 200,
        "lr": 1e-3,
        "max_tokens": _TAIL.length_cap,
        "estimator": "group_std",
        "clip_high": 0.28,
        "importance_cap": 10.0,
        "truncation": "score",
    },
    "tail-turns": {
        "steps": 200,
        "lr": 1e-3,
        "max_tokens": _TAIL.turn_cap,
        "estimator": "group_std",
        "clip_high": 0.28,
        "importance_cap": 10.0,
        "truncation": "score",
    },
}


def _join_pool(stack: ExitStack, tensor: int) -> Any:
    """The torchrun job's pool (``tensor`` processes per tensor group) when this process
    is one of several, else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        if tensor > 1:
            raise DemoError(f"tensor={tensor} needs that many processes: start it with torchrun")
        return None
    from dew.pool import init_pool

    pool = init_pool("gloo", tensor=tensor)
    stack.callback(pool.close)
    return pool


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


@dataclass(frozen=True)
class DemoJob:
    """What the demo trains: the parts ``fit`` takes, and the engine behind them."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    objective: GRPOObjective
    dataset: Dataset
    server: RolloutServer
    scheduler: RolloutScheduler
    describe: str = ""  # the task's parameters (TaskParts.describe)


def build_job(
    config: DemoConfig,
    stack: ExitStack,
    *,
    pool: Any = None,
    task: Callable[[DemoConfig, Any, Any], TaskParts] | None = None,
    engine: Any = None,
) -> DemoJob:
    """Build the model, optimizer, objective, task stream, engine, source and scheduler
    of ``config``; ``stack`` closes the server, the source and the scheduler in reverse
    order. ``pool`` (a torchrun job's) gives this process its share of every batch and
    lays the model out on its mesh (:func:`dew.pool.shard_model`).
    ``task`` replaces the registry's builder for ``config.task`` (bench/vs_trl.py builds
    its two-turn task this way). ``engine``: an Engine and Publisher to run on instead of
    the one ``config`` describes (an HTTPEngine, a fleet made elsewhere); the caller
    closes it. Torch's thread count is the caller's to set.
    """
    import numpy as np
    import torch

    from dew.data import Dataset
    from dew.demo.model import make_model, make_tokenizer
    from dew.objectives.rl.grpo import GRPOObjective
    from dew.objectives.rl.scheduler import RolloutScheduler
    from dew.serving import RolloutServer

    torch.manual_seed(config.seed)
    tokenizer = make_tokenizer()
    model = make_model(config.arch, config.size, seed=config.seed, max_positions=config.positions)
    chosen = {"importance": config.importance, "importance_cap": config.importance_cap}
    objective = GRPOObjective(
        temperature=config.temperature,
        clip_high=config.clip_high,
        proximal=config.proximal,  # type: ignore[arg-type]
        **{name: value for name, value in chosen.items() if value is not None},
    )
    rows = config.batch_size * config.group_size
    world = 1 if pool is None else pool.world
    dataset = Dataset(
        {"task_id": np.arange(config.tasks)}, batch_size=config.batch_size * world, seed=1
    )
    if pool is not None:
        dataset = pool.dataset(dataset)
    rank = 0 if pool is None else pool.rank
    server: Any
    if engine is not None:
        server = engine
    elif config.engines:
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
            seed=config.seed,
            args=["--max-batch", str(rows * (config.ahead + 1))],
        )
    else:
        server = RolloutServer(
            model,
            max_batch=rows * (config.ahead + 1),
            seed=config.seed + rank,
            on_load=config.on_load,
        )
    if engine is None:
        stack.callback(server.close)
    if pool is not None:  # after the engine copied the whole model, before the optimizer
        from dew.pool import shard_model

        shard_model(model, pool)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    parts = (task or TASKS[config.task])(config, server, tokenizer)
    stack.callback(parts.close)
    scheduler = RolloutScheduler.from_config(
        objective, parts.source, server, config.scheduler_config(), width=parts.max_chain, rows=rows
    )
    stack.callback(scheduler.close)
    return DemoJob(model, optimizer, objective, dataset, server, scheduler, parts.describe)


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

    from dew.train import fit

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
        pool = _join_pool(stack, config.tensor)
        lead = pool is None or pool.rank == 0
        if resume is None:
            if pool is not None:  # one folder for the job: rank 0's name
                run = Path(pool.exchange("run_dir", str(run))[0])
            if (run / "checkpoints").exists():
                raise DemoError(f"{run} already holds a run; continue it with --resume {run}")
        _share_cores(torch)
        job = build_job(config, stack, pool=pool)
        model, scheduler = job.model, job.scheduler
        if lead:  # only once the job is built: a config that cannot run leaves nothing
            if run.exists() and not run.is_dir():
                raise DemoError(f"{run} is a file, not a run folder")
            try:
                run.mkdir(parents=True, exist_ok=True)
                text = json.dumps(dataclasses.asdict(config), indent=2)
                (run / "config.json").write_text(text)
            except OSError as exc:
                raise DemoError(f"{run} cannot be written: {exc}") from None
        if pool is not None:
            from dew.pool import attach

            attach(scheduler, pool)
        log = []
        # Where the bar starts (fit checks the checkpoint itself).
        saved = checkpoints(run / "checkpoints") if resume is not None else []
        done = step_of(saved[-1]) or 0 if saved else 0
        if progress and lead:
            update, bar = progress_bar(config.steps, done, "dew demo")
            stack.callback(bar.close)
            log.append(update)
        result = fit(
            model,
            job.optimizer,
            job.dataset,
            scheduler,
            job.objective,
            steps=config.steps,
            run_dir=run,
            checkpoint_every=config.checkpoint_every,
            resume=False if resume is None else run,  # a resume must find a checkpoint
            log=log,
            config=dataclasses.asdict(config),
            freeze_gc=True,  # a long-lived process with a large set-up heap: see fit's doc
            pool=pool,
        )
    drawn = None
    if plot and lead:
        from dew.plot import plot_run

        drawn = plot_run(run)
    return DemoResult(
        run_dir=run, fit=result, seconds=time.monotonic() - t0, plot=drawn, describe=job.describe
    )
