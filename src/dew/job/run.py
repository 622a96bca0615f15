"""Run a checked :class:`~dew.job.config.JobConfig`: ``dew train`` after parsing.

Order matters for "nothing half-made": the config, the reward functions, the model,
the tokenizer and every dataset row are loaded and checked, and the rewards tried on
the starting model's own completions of a few rows, before the run folder is created,
so a config that cannot run leaves nothing behind. Then the run folder gets
``config.toml`` (the resolved config), ``skipped_rows.json`` (when rows were skipped),
``records.jsonl``, ``checkpoints/`` (exact resume, as :func:`dew.train.fit` does) and
``export/`` (``save_pretrained`` of the model and its tokenizer at the end, and
``exports/step-N`` every ``output.export_every`` steps; :mod:`dew.job.export`), loadable
by ``transformers`` as they are, each whole or absent.

Threads: none of its own; the engine, the source and the scheduler own theirs, and
each is closed by one ExitStack in the reverse order of its making. Reward functions
run in the worker processes of a :class:`~dew.job._reward_pool.RewardPool` (each call
bounded by its ``timeout``), for training and evaluation alike.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import shutil
import sys
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dew import _runlock
from dew._devices import default_device
from dew.job import _report
from dew.job._engines import check_devices, make_engine
from dew.job._reward_pool import RewardPool
from dew.job.config import ConfigError, JobConfig
from dew.job.data import Rows, load_rows
from dew.job.export import export, exporter
from dew.job.rewards import Reward, RewardError, combine, load_reward

__all__ = ["Prepared", "prepare", "train"]


@dataclass
class Prepared:
    """Everything checked and loaded, before anything is written."""

    config: JobConfig
    model: Any
    tokenizer: Any
    rows: Rows
    rewards: list[Reward]
    eval_rows: Rows | None = None


def prepare(config: JobConfig, *, resume: bool = False) -> Prepared:
    """Load and check what the run needs; ConfigError naming the first problem (the
    run folder's first: it costs nothing to check, the reward probe does)."""
    _check_run_folder(Path(config.output.run_dir), resume)
    check_devices(config.training.device, config.engine)
    import datasets
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # One progress bar (ours) on the terminal, not one per load and per save.
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()

    rewards = []
    for i, section in enumerate(config.rewards):
        try:
            rewards.append(load_reward(section.function, section.weight, section.timeout))
        except RewardError as exc:
            raise ConfigError(f"rewards.{i}.function: {exc}") from None
    path = Path(config.model.path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path: {path} is not a model folder (no config.json)")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.model.dtype]
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path: {path} cannot be loaded: {exc}") from None
    if config.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if config.data.chat and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"data.messages_column: the tokenizer at {path} has no chat template")
    max_len = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if max_len < 2:
        raise ConfigError(f"model.path: {path}'s config has no max_position_embeddings")
    max_tokens = config.sampling.max_tokens  # type: ignore[attr-defined]

    def rows_of(path: str, field: str) -> Rows:
        data = config.data
        return load_rows(
            path,
            column=data.column,
            chat=data.chat,
            tokenizer=tokenizer,
            max_len=max_len,
            max_tokens=max_tokens,
            field=field,
        )

    rows = rows_of(config.data.path, "data.path")
    if len(rows.usable) < config.training.tasks:
        raise ConfigError(
            f"training.tasks: {config.training.tasks} tasks a step, but data.path has "
            f"{len(rows.usable)} usable rows ({len(rows.skipped)} skipped)"
        )
    eval_path = config.data.eval_path
    eval_rows = None if eval_path is None else rows_of(eval_path, "data.eval_path")
    _probe(config, model, tokenizer, rows, rewards)
    return Prepared(config, model, tokenizer, rows, rewards, eval_rows)


def _probe(
    config: JobConfig, model: Any, tokenizer: Any, rows: Rows, rewards: list[Reward]
) -> None:
    """The rewards tried before anything is written (:func:`dew.job.evaluate.probe`):
    ConfigError when they fail on every probe completion, a word when on some."""
    from dew.job.evaluate import probe

    with RewardPool(rewards) as pool:
        chat = config.data.chat
        verifier = combine(rewards, rows, prompt_column=rows.column, chat=chat, pool=pool)
        sampling = config.sampling_params()
        failed, tried, first = probe(
            model, tokenizer, rows, verifier, sampling, chat=chat, seed=config.training.seed
        )
    if failed == tried:
        raise ConfigError(
            f"rewards: tried on the starting model's own completions of the first {tried} "
            f"data rows, they failed on every one, so the run would train nothing: {first}"
        )
    if failed and os.environ.get("RANK", "0") == "0":
        _report.say(
            f"the rewards failed on {failed} of {tried} probe completions (the starting "
            f"model's, of the first data rows): {first}; such attempts are retried"
        )


def train(
    prepared: Prepared,
    *,
    resume: bool = False,
    progress: bool = True,
    choose: Callable[..., Any] | None = None,
) -> Any:
    """Train as ``prepared.config`` says; returns :class:`dew.train.FitResult`.

    Under ``torchrun`` every process runs this: the model is sharded on the pool's
    mesh (``[parallel]``), each process of the data axis reads its share of every
    step's ``training.tasks``, checkpoints are the pool's sharded ones, and rank 0
    alone writes the run folder's shared files, the progress bar and the exports.

    ``choose`` is the planner's choice of a policy for ``scheduler.policy = "auto"``
    (:func:`dew.plan.auto.choose_policy`, which ``dew train`` hands over: the planner
    stands a floor above this package).
    """
    config = prepared.config
    run = Path(config.output.run_dir)
    _check_run_folder(run, resume)
    fresh = not run.exists()
    try:
        with ExitStack() as stack:
            pool = _join_pool(config, stack)
            rank = 0 if pool is None else pool.rank
            if rank == 0:
                try:  # before the first file: a second trainer never writes here
                    stack.enter_context(_runlock.hold(run))
                except _runlock.RunInUse as exc:
                    raise ConfigError(f"output.run_dir: {exc}") from None
                except OSError as exc:  # a file by that name, no permission, ...
                    raise ConfigError(f"output.run_dir: {run}: {exc.strerror}") from None
            if _holds_a_run(run) and not resume:
                raise ConfigError(f"output.run_dir: {run} already holds a run; add --resume")
            if rank == 0:
                kept = _resumed_config(run, config) if resume else run / "config.toml"
                try:
                    kept.write_text(config.to_toml())
                    if prepared.rows.skipped:
                        skipped = {str(i): why for i, why in prepared.rows.skipped.items()}
                        (run / "skipped_rows.json").write_text(json.dumps(skipped, indent=1))
                except OSError as exc:
                    raise ConfigError(f"output.run_dir: {run} cannot be written: {exc}") from None
            if config.scheduler.policy == "fixed":
                steps = config.training.steps
                return _train(
                    prepared, run, pool, stack, resume=resume, progress=progress, steps=steps
                )
            choose = _auto_choice(pool, choose)
            return _auto(prepared, run, stack, choose, resume=resume, progress=progress)
    except ConfigError:
        if fresh:  # refused before it trained: a folder this call made leaves with it
            shutil.rmtree(run, ignore_errors=True)
        raise


def _check_run_folder(run: Path, resume: bool) -> None:
    if run.exists() and not run.is_dir():
        raise ConfigError(f"output.run_dir: {run} is a file, not a run folder")
    if resume and not _holds_a_run(run):
        raise ConfigError(
            f"output.run_dir: {run} holds no run to resume (no records, no checkpoint); "
            "leave out --resume to start one there"
        )


def _resumed_config(run: Path, config: JobConfig) -> Path:
    """Where a resume keeps its config (``config-resume-N.toml``; ``config.toml`` stays
    the first start's), after saying what changed since the last one; ConfigError for
    a change a resumed run cannot honour (:data:`~dew.job.config.FIXED_ON_RESUME`)."""
    from dew.job.config import FIXED_ON_RESUME, changes, load_config

    kept = sorted(run.glob("config-resume-*.toml"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    last = kept[-1] if kept else run / "config.toml"
    if last.is_file():
        diff = changes(load_config(last), config)
        fixed = [f"{k} ({a!r} -> {b!r})" for k, a, b in diff if k in FIXED_ON_RESUME]
        if fixed:
            raise ConfigError(
                f"--resume: {', '.join(fixed)} cannot change in a resumed run (its checkpoint "
                f"and records depend on it; {last} has the run's value): start a new run"
            )
        if diff:
            said = ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in diff)
            _report.say(f"resuming with changed settings: {said}")
    return run / f"config-resume-{len(kept) + 1}.toml"


def _resume_from(run: Path, resume: bool, rank: int) -> Path | bool:
    """What ``fit`` resumes from: the run folder (whose checkpoints it must verify), or
    nothing when the run was killed before any checkpoint was whole (from step 0)."""
    from dew import _checkpoint

    if not resume:
        return False
    if _checkpoint.checkpoints(run / "checkpoints"):
        return run
    if rank == 0:
        print(
            f"dew train: {run} holds no complete checkpoint yet: starting from step 0",
            file=sys.stderr,
            flush=True,
        )
    return False


def _holds_a_run(run: Path) -> bool:
    """Whether ``run`` has trained: a checkpoint, or a record (a run killed before its
    first checkpoint was whole, which ``--resume`` starts again from step 0)."""
    records = run / "records.jsonl"
    saved = run / "checkpoints"
    return (records.is_file() and records.stat().st_size > 0) or (
        saved.is_dir() and any(saved.iterdir())
    )


def _join_pool(config: JobConfig, stack: ExitStack) -> Any:
    """Under torchrun (``WORLD_SIZE`` > 1): the job's pool, laid out as ``[parallel]`` says."""
    from dew.recipe import RecipeError, join_pool

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if config.model.lora_rank > 0:
            raise ConfigError("model.lora_rank: LoRA is not supported under torchrun yet")
        if config.training.device is not None:
            raise ConfigError(
                "training.device: under torchrun each process trains on its own device; "
                "leave it out"
            )
    try:
        return join_pool(config.parallel.model_dump(), stack)  # type: ignore[attr-defined]
    except RecipeError as exc:
        raise _config_error(exc) from None


def _config_error(exc: Any) -> ConfigError:
    """A recipe's refusal, naming the config's field (``training.tasks``, ``parallel``)."""
    fields = {"tasks": "training.tasks", "parallel": "parallel"}
    return ConfigError(f"{fields.get(exc.field, exc.field)}: {exc.message}")


def _recipe(prepared: Prepared, run: Path, rewards: RewardPool) -> Any:
    """The run as a :class:`dew.recipe.Recipe`: the loaded model, the ``[engine]``
    section's engine, a PromptSource over the data rows scored by the reward functions
    (in ``rewards``' processes), the config's sampling, scheduling and objective."""
    from dew.objectives.rl.sources import PromptSource
    from dew.recipe import Recipe, SourceParts

    config, rows, tokenizer = prepared.config, prepared.rows, prepared.tokenizer
    verifier = combine(
        prepared.rewards, rows, prompt_column=rows.column, chat=config.data.chat, pool=rewards
    )

    def engine(needs: Any, stack: ExitStack) -> Any:  # it copies the model
        return make_engine(
            config.engine,
            model=needs.model,
            model_path=config.model.path,
            seed=needs.seed,
            max_batch=needs.in_flight,
            stack=stack,
            run=run,
        )

    def source(engine: Any, needs: Any) -> Any:
        prompts = PromptSource(
            engine,
            rows.prompts(),
            verifier,
            sampling=needs.sampling,
            tokenizer=tokenizer,
            chat_template=config.data.chat,
            group_size=config.scheduler.groups,  # a TRL reward gets a group in one call
        )

        def close() -> None:
            # The rewards first: reward calls in progress end at once, so the source's
            # close does not wait for them.
            rewards.close()
            prompts.close()

        return SourceParts(prompts, rows.prompt_tokens + needs.sampling.max_tokens, close)

    reference = None
    if config.objective.kl_coef > 0:  # type: ignore[attr-defined]
        # The starting weights, frozen (on resume too: the checkpoint loads into the model).
        reference = lambda model: copy.deepcopy(model).eval().requires_grad_(False)  # noqa: E731
    t = config.training
    return Recipe(
        model=lambda: prepared.model,
        engine=engine,
        source=source,
        sampling=config.sampling_params(),
        scheduler=config.scheduler_config(),
        rows=len(rows),
        tasks=t.tasks,
        lr=t.lr,
        objective=config.objective.model_dump(),  # type: ignore[attr-defined]
        reference=reference,
        weight_decay=t.weight_decay,
        seed=t.seed,
        device=t.device or default_device(),
        parallel=config.parallel.model_dump(),  # type: ignore[attr-defined]
        wrap=_lora(config) if config.model.lora_rank > 0 else None,
    )


def _lora(config: JobConfig) -> Any:
    """``[model] lora_*``: the model wrapped in adapters, its engines served the merged
    weights."""
    from dew.job import lora

    m = config.model

    def wrap(model: Any, engine: Any) -> tuple[Any, Any]:
        adapted = lora.wrap(
            model,
            rank=m.lora_rank,
            alpha=m.lora_alpha,
            dropout=m.lora_dropout,
            targets=m.lora_targets,
        )
        return adapted, lora.MergedPublisher(engine)

    return wrap


def _auto_choice(pool: Any, choose: Callable[..., Any] | None) -> Callable[..., Any]:
    """``choose``, once ``"auto"`` can run here (ConfigError saying why it cannot)."""
    if choose is None:
        raise ConfigError(
            'scheduler.policy: "auto" needs the planner, which `dew train` hands over (from '
            "Python: train(..., choose=dew.plan.auto.choose_policy))"
        )
    if pool is not None:
        raise ConfigError(
            'scheduler.policy: "auto" runs on one process only: under torchrun each process '
            "would fit its own share of the records"
        )
    return choose


def _auto(
    prepared: Prepared,
    run: Path,
    stack: ExitStack,
    choose: Callable[..., Any],
    *,
    resume: bool,
    progress: bool,
) -> Any:
    """``scheduler.policy = "auto"``: the probe steps with the config's knobs, the
    planner's choice from their records (kept in ``plan.json``), then the rest of the
    steps with it, resumed from the probe's last checkpoint. Only the knobs
    (``ahead``, ``max_lag``, ``oversample``, ``admit``) change, so the resume is exact.
    A probe the planner cannot fit leaves the config's knobs, saying why."""
    config = prepared.config
    probe = config.scheduler.probe_steps
    chosen = run / "plan.json"
    if not chosen.is_file():
        if not resume or _steps_done(run, None) < probe:
            with ExitStack() as probing:  # its engines stop before the chosen run starts
                _train(prepared, run, None, probing, resume=resume, progress=progress, steps=probe)
        try:
            adoption = choose(run, skip=probe // 4).to_json()
        except ValueError as exc:  # the records could not be fitted
            adoption = {"policy": None, "knobs": {}, "reason": [f"not fitted: {exc}"]}
        adoption["probe_steps"] = probe
        chosen.write_text(json.dumps(adoption, indent=1))
        for line in adoption["reason"]:
            _report.say(f"plan: {line}")
        if adoption["policy"] is None:
            _report.say("the planner could not choose a policy: the config's knobs go on")
        resume = True
    adoption = json.loads(chosen.read_text())
    scheduler = config.scheduler.model_copy(update=adoption["knobs"])
    adopted = dataclasses.replace(
        prepared, config=config.model_copy(update={"scheduler": scheduler})
    )
    steps = config.training.steps
    return _train(adopted, run, None, stack, resume=resume, progress=progress, steps=steps)


def _train(
    prepared: Prepared,
    run: Path,
    pool: Any,
    stack: ExitStack,
    *,
    resume: bool,
    progress: bool,
    steps: int,
) -> Any:
    from dew.recipe import RecipeError, assemble

    config, tokenizer, rows = prepared.config, prepared.tokenizer, prepared.rows
    rewards = RewardPool(prepared.rewards)  # no process until the first call
    try:
        job = assemble(_recipe(prepared, run, rewards), stack, pool)
    except RecipeError as exc:
        raise _config_error(exc) from None
    model, scheduler, sampling, rank = job.model, job.scheduler, job.needs.sampling, job.rank
    done = _steps_done(run, pool) if resume else 0
    log = [
        _lr_schedule(job.optimizer, config, done),
        exporter(model, tokenizer, run, config.output.export_every, config, pool),
    ]
    if rank == 0:
        log += [_report.reward_failures(), _report.masked_warning()]
    if prepared.eval_rows is not None:
        # Every process decodes alike (a sharded forward is a collective); rank 0 writes.
        own = run if rank == 0 else run / f"rank{rank}"
        log.append(_evaluator(prepared, model, own, sampling, rewards))
    table = None  # where the sample log also goes: W&B's table, when W&B is on
    if config.output.wandb and rank == 0:
        from dew.job._wandb import WandbSink

        out = config.output
        sink = WandbSink(
            run,
            project=out.wandb_project,
            mode=out.wandb_mode,
            config=config.model_dump(mode="json"),
        )
        stack.callback(sink.close)
        log.append(sink)
        table = sink.table
    if config.output.samples_every is not None and rank == 0:
        out = config.output
        log.append(
            _report.samples(
                run / "samples.jsonl",
                out.samples_every,
                out.samples,
                scheduler,
                lambda ids: tokenizer.decode(list(ids)),
                table,
                resumed_at=done,
            )
        )
    if rank == 0:  # said once the run stands (its engines up), so it is not taken back
        total = len(rows.usable) + len(rows.skipped)
        _report.skipped(len(rows.skipped), total, run / "skipped_rows.json")
    if progress and rank == 0:
        from dew._progress import progress_bar

        # A resumed run's bar starts where its checkpoint is.
        update, bar = progress_bar(steps, done, "dew train")
        stack.callback(bar.close)
        log.append(update)
    result = job.fit(
        steps=steps,
        run_dir=run,
        checkpoint_every=config.output.checkpoint_every,
        keep=config.output.keep,
        resume=_resume_from(run, resume, rank),
        log=log,
        max_grad_norm=config.training.max_grad_norm,
        micro_batches=config.training.micro_batches,
        tensorboard=config.output.tensorboard,
        config=config.model_dump(mode="json"),
        freeze_gc=True,
    )
    if steps == config.training.steps:  # not after an "auto" policy's probe
        export(model, tokenizer, run / "export", config, pool)
    return result


def lr_factor(step: int, *, steps: int, warmup: int, schedule: str) -> float:
    """The share of ``training.lr`` for update ``step`` (0-based): a linear warmup over
    ``warmup`` updates, then constant, or a linear or cosine decay to 0 at ``steps``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


def _lr_schedule(optimizer: Any, config: JobConfig, done: int) -> Any:
    t = config.training

    def apply(step: int) -> None:  # set the lr of update `step` (0-based)
        factor = lr_factor(step, steps=t.steps, warmup=t.warmup_steps, schedule=t.schedule)
        for group in optimizer.param_groups:
            group["lr"] = t.lr * factor

    apply(done)
    return lambda record: apply(int(record["step"]))  # record["step"] updates are done


def _steps_done(run: Path, pool: Any) -> int:
    from dew._checkpoint import step_of
    from dew.train import latest_checkpoint

    if pool is None:
        saved = latest_checkpoint(run)
    else:
        from dew.pool import latest_checkpoint as latest_sharded

        saved = latest_sharded(run / "checkpoints", pool)
    return 0 if saved is None else step_of(saved) or 0


def _evaluator(
    prepared: Prepared, model: Any, run: Path, sampling: Any, rewards: RewardPool
) -> Any:
    from dew.job.evaluate import evaluate, recorder

    config, rows = prepared.config, prepared.eval_rows
    assert rows is not None
    t = config.training
    verifier = combine(
        prepared.rewards, rows, prompt_column=rows.column, chat=config.data.chat, pool=rewards
    )

    def now() -> dict[str, Any]:
        return evaluate(
            model,
            prepared.tokenizer,
            rows,
            verifier,
            sampling,
            samples=t.eval_samples,
            temperature=t.eval_temperature,
            threshold=t.eval_pass,
            chat=config.data.chat,
            seed=t.seed,
        )

    return recorder(run, now, t.eval_every or t.steps, t.steps)
