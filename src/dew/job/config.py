"""The config of ``dew train``: one TOML file, checked whole before anything runs.

A config has these sections (each a table; ``[[rewards]]`` an array of tables)::

    [model]      path, dtype, gradient_checkpointing, lora_rank, lora_alpha, ...
    [data]       path, prompt_column | messages_column, eval_path
    [[rewards]]  function ("pkg.mod:fn" or "path/to/file.py:fn"), weight, timeout
    [sampling]   the fields of dew.core.SamplingParams
    [scheduler]  the knobs of dew.objectives.rl.SchedulerConfig
    [objective]  clip, clip_high, importance_cap, importance, kl_coef, proximal,
                 clip_behavior of GRPOObjective
    [training]   steps, tasks, lr, warmup_steps, schedule, max_grad_norm,
                 micro_batches, seed, ...
    [engine]     kind ("in-process", "fleet", "urls", "vllm", "ray"), engines, urls,
                 weights_dir, for vLLM: python, args, on_load, for Ray: address,
                 resources
    [output]     run_dir, checkpoint_every, keep, export_every, tensorboard, wandb, ...

The sampling, scheduler and objective sections are built from the library's own
types (fields, annotations and defaults), so each default is written once, there, and
the library's own checks run on the values. Every field can be
overridden on the command line as ``--section.field VALUE`` (VALUE read as a TOML
value, so ``2``, ``0.5``, ``true``, ``[1, 2]`` and ``"text"`` keep their types; a bare
word is a string; ``none`` clears an optional field; a list field also takes a plain
value, one item or items split at commas: ``--engine.urls http://a:1,http://b:2``).

Every problem is a :class:`ConfigError` whose message names the field
(``scheduler.ahead: ...``), and an unknown key names the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import math
import tomllib
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from dew._devices import DEVICE_PATTERN
from dew.core import MIN_TEMPERATURE, SamplingParams
from dew.job._base import ConfigError, Section
from dew.job._engines import EngineSection
from dew.job._toml import toml_text
from dew.job.rewards import REWARD_TIMEOUT
from dew.objectives.rl.config import SchedulerConfig
from dew.objectives.rl.grpo import GRPOObjective
from dew.pool import init_pool
from dew.train import fit

__all__ = [
    "FIXED_ON_RESUME",
    "ConfigError",
    "JobConfig",
    "changes",
    "load_config",
    "parse_overrides",
]


# fit's own defaults, written once there.
_FIT = {
    name: p.default
    for name, p in inspect.signature(fit).parameters.items()
    if p.default is not inspect.Parameter.empty
}


class ModelSection(Section):
    path: str  # a Hugging Face model folder (config.json, weights, tokenizer)
    dtype: Literal["float32", "bfloat16"] = "float32"  # of the trainer's weights
    gradient_checkpointing: bool = False  # less memory, one more forward per step
    # LoRA (the `lora` extra, peft): 0 trains the whole model.
    lora_rank: int = 0
    lora_alpha: float = 16.0  # LoRA's scale is lora_alpha / lora_rank
    lora_dropout: float = 0.0  # dropout on the adapter's input
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")  # or "all-linear"

    @field_validator("lora_rank")
    @classmethod
    def _rank(cls, value: int) -> int:
        if value < 0:
            raise ValueError("must be >= 0 (0: no LoRA)")
        return value

    @field_validator("lora_dropout")
    @classmethod
    def _dropout(cls, value: float) -> float:
        if not 0 <= value < 1:
            raise ValueError("must be in [0, 1)")
        return value


class DataSection(Section):
    path: str  # .jsonl/.json/.parquet/.csv, or a save_to_disk folder
    prompt_column: str | None = None  # default "prompt" unless messages_column is set
    messages_column: str | None = None  # chat messages, rendered with the chat template
    eval_path: str | None = None  # held-out rows for training.eval_every

    @property
    def column(self) -> str:
        return self.messages_column or self.prompt_column or "prompt"

    @property
    def chat(self) -> bool:
        return self.messages_column is not None


class RewardSection(Section):
    function: str  # "pkg.mod:fn" or "path/to/file.py:fn" (TRL's signature or dew's)
    weight: float = 1.0  # the reward is the sum of weight x value over the functions
    timeout: float = REWARD_TIMEOUT  # seconds per call; then its process is killed

    @field_validator("function")
    @classmethod
    def _named(cls, value: str) -> str:
        if ":" not in value or not all(value.rsplit(":", 1)):
            raise ValueError("must be 'package.module:function' or 'path/to/file.py:function'")
        return value

    @field_validator("weight")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @field_validator("timeout")
    @classmethod
    def _bounded(cls, value: float) -> float:
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"must be > 0 seconds, got {value}")
        return value


class TrainingSection(Section):
    steps: int
    tasks: int = 8  # prompts per step; each makes scheduler.groups rollouts
    lr: float = 1e-5  # AdamW's learning rate
    weight_decay: float = 0.0  # AdamW's
    warmup_steps: int = 0  # lr rises linearly to `lr` over these first steps
    schedule: Literal["constant", "linear", "cosine"] = "constant"  # after warmup, to 0
    max_grad_norm: float | None = _FIT["max_grad_norm"]  # none: no clipping
    micro_batches: int = _FIT["micro_batches"]  # parts of a step's rows, one backward each
    seed: int = 0  # the data order, the engine's sampling and torch's
    # The trainer's torch device (none: cuda if this machine has one, else cpu); under
    # torchrun each process trains on its own (LOCAL_RANK's).
    device: str | None = None
    # Evaluation on data.eval_path (dew.job.evaluate): every eval_every steps and at the end.
    eval_every: int | None = None
    eval_samples: int = 1  # k of pass@k
    eval_temperature: float = 0.0  # 0: greedy
    eval_pass: float = 1.0  # a sample passes with a reward at least this

    @field_validator("device")
    @classmethod
    def _device(cls, value: str | None) -> str | None:
        if value is not None and not DEVICE_PATTERN.fullmatch(value):
            raise ValueError(f"{value!r} is not a device name (cpu, cuda, cuda:N)")
        return value

    @field_validator("steps", "tasks", "micro_batches", "eval_samples")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be >= 1")
        return value

    @field_validator("warmup_steps")
    @classmethod
    def _not_negative(cls, value: int) -> int:
        if value < 0:
            raise ValueError("must be >= 0")
        return value

    @field_validator("lr", "max_grad_norm")
    @classmethod
    def _positive_real(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError("must be a finite number > 0")
        return value


class OutputSection(Section):
    run_dir: str  # the run folder: records, checkpoints, exports, plot
    checkpoint_every: int | None = _FIT["checkpoint_every"]  # steps; and one at the end
    keep: int = _FIT["keep"]  # checkpoints kept (a run needs room for keep + 1)
    export_every: int | None = None  # save_pretrained folders; one at the end always
    tensorboard: bool = _FIT["tensorboard"]  # event files, when tensorboard is installed
    wandb: bool = False  # the wandb extra; a W&B run per run folder
    wandb_project: str = "dew"  # the W&B project
    wandb_mode: Literal["offline", "online"] = "offline"  # offline: wandb sync later
    # Trained samples (prompt, completion, reward, advantage) to samples.jsonl (and W&B):
    # `samples` of them every `samples_every` steps (none: no sample log).
    samples_every: int | None = 10
    samples: int = 4  # trained samples logged each samples_every steps

    @field_validator("samples_every", "samples")
    @classmethod
    def _some(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError("must be >= 1")
        return value


def _from_dataclass(cls: type, name: str, skip: Sequence[str] = ()) -> type[Section]:
    """A section whose fields, types and defaults are the dataclass's own (the
    dataclass's checks run when the section is turned into it)."""
    hints = typing.get_type_hints(cls)  # the annotations are strings (PEP 563)
    fields = {
        f.name: (hints[f.name], ... if f.default is dataclasses.MISSING else f.default)
        for f in dataclasses.fields(cls)
        if f.name not in skip
    }
    return create_model(name, __base__=Section, **fields)


# In a config, a registered estimator or truncation policy is named; a function is a
# thing of the Python API.
SamplingSection = _from_dataclass(SamplingParams, "SamplingSection")


def _from_signature(fn: Any, name: str, skip: Sequence[str] = ()) -> type[Section]:
    """A section of ``fn``'s keyword arguments, with its annotations and defaults."""
    hints = typing.get_type_hints(fn)
    fields = {
        p.name: (hints[p.name], p.default)
        for p in inspect.signature(fn).parameters.values()
        if p.kind is p.KEYWORD_ONLY and p.name not in skip
    }
    return create_model(name, __base__=Section, **fields)


# The objective's temperature is the sampling temperature (the log-probs' own).
ObjectiveSection = _from_signature(
    GRPOObjective.__init__, "ObjectiveSection", skip=("temperature", "reference")
)
# A job bounds every rollout attempt, where the library leaves it to the caller (None): a
# source that hangs, even one that honours its stop event, then costs an attempt, not the
# run. Seconds from submission (TOML has no null: a very long one lifts the bound).
JOB_ROLLOUT_TIMEOUT = 600.0
# A job's source is single-turn RLVR: a completion cut at sampling.max_tokens still has
# its verifier's reward, and training on it ("score") is what that reward is for. The
# library's default ("mask") is for agentic limits, where a cut episode has no verdict.
JOB_TRUNCATION = "score"
_SchedulerKnobs = create_model(
    "_SchedulerKnobs",
    __base__=_from_dataclass(SchedulerConfig, "_Knobs", skip=("estimator", "truncation")),
    estimator=(str, SchedulerConfig.estimator),
    truncation=(str, JOB_TRUNCATION),
    timeout=(float | None, JOB_ROLLOUT_TIMEOUT),
)
# The fewest probe steps "auto" takes: a quarter are left out while the pipeline fills,
# and the planner's fit needs five more.
MIN_PROBE_STEPS = 8


class SchedulerSection(_SchedulerKnobs):  # type: ignore[valid-type, misc]
    # "auto": the first probe_steps steps run with the knobs above, then the run goes on
    # with the planner's choice (dew plan --from-run on its own records; see plan.json)
    policy: Literal["fixed", "auto"] = "fixed"
    probe_steps: int = 20  # policy "auto": steps run before the planner chooses

    @field_validator("probe_steps")
    @classmethod
    def _enough(cls, value: int) -> int:
        if value < MIN_PROBE_STEPS:
            raise ValueError(
                f"must be >= {MIN_PROBE_STEPS} (the planner fits the steps after a quarter of them)"
            )
        return value

    def knobs(self) -> dict[str, Any]:
        """The fields that are SchedulerConfig's."""
        return self.model_dump(exclude={"policy", "probe_steps"})


# Under torchrun: the pool's mesh and bounds, as dew.pool.init_pool takes them.
ParallelSection = _from_signature(init_pool, "ParallelSection")


class JobConfig(Section):
    """A whole ``dew train`` config; :func:`load_config` builds and checks one."""

    model: ModelSection
    data: DataSection
    rewards: tuple[RewardSection, ...]
    sampling: SamplingSection  # type: ignore[valid-type]
    scheduler: SchedulerSection = SchedulerSection()
    objective: ObjectiveSection = ObjectiveSection()  # type: ignore[valid-type]
    training: TrainingSection
    engine: EngineSection = EngineSection()
    parallel: ParallelSection = ParallelSection()  # type: ignore[valid-type]
    output: OutputSection

    @field_validator("rewards")
    @classmethod
    def _some(cls, value: tuple[RewardSection, ...]) -> tuple[RewardSection, ...]:
        if not value:
            raise ValueError("needs at least one [[rewards]] table")
        return value

    @model_validator(mode="after")
    def _eval_needs_data(self) -> JobConfig:
        every = self.training.eval_every
        if every is not None and every < 1:
            raise ValueError("training.eval_every: must be None or >= 1")
        if every is not None and self.data.eval_path is None:
            raise ValueError("training.eval_every: set data.eval_path to evaluate on")
        temperature = self.training.eval_temperature
        greedy_or_bounded = temperature == 0 or temperature >= MIN_TEMPERATURE
        if not (math.isfinite(temperature) and greedy_or_bounded):
            raise ValueError(
                f"training.eval_temperature: must be 0 (greedy) or >= {MIN_TEMPERATURE}, "
                f"got {temperature}"
            )
        return self

    @model_validator(mode="after")
    def _probe_fits(self) -> JobConfig:
        probe = self.scheduler.probe_steps
        if self.scheduler.policy == "auto" and probe >= self.training.steps:
            raise ValueError(
                f"scheduler.probe_steps: {probe} probe steps leave none of training.steps "
                f"= {self.training.steps} to run the planner's choice"
            )
        return self

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.sampling.model_dump())  # type: ignore[attr-defined]

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(**self.scheduler.knobs())

    def grpo_objective(self, reference: Any = None) -> GRPOObjective:
        """The objective; ``reference``: the frozen model of ``objective.kl_coef``."""
        from dew.core import scored_temperature

        temperature = scored_temperature(self.sampling.temperature)  # type: ignore[attr-defined]
        knobs = self.objective.model_dump()  # type: ignore[attr-defined]
        return GRPOObjective(temperature=temperature, reference=reference, **knobs)

    def to_toml(self) -> str:
        """The resolved config as TOML (what ``--print-config`` prints and the run
        folder keeps), every field, an unset one as a ``# field = none`` comment;
        loading it gives this config back."""
        return toml_text(self.model_dump()).lstrip("\n")


# What a resumed run cannot take another value of: its checkpoint holds these weights
# (model, LoRA), its data position counts batches of these rows (data, tasks, seed), and
# its records count groups of this size.
FIXED_ON_RESUME = (
    "model.path",
    "model.lora_rank",
    "model.lora_targets",
    "data.path",
    "data.prompt_column",
    "data.messages_column",
    "scheduler.groups",
    "training.tasks",
    "training.seed",
)


def changes(old: JobConfig, new: JobConfig) -> list[tuple[str, Any, Any]]:
    """The fields whose value differs, as ``(section.field, old, new)``, in config order."""
    a, b = _flat(old.model_dump()), _flat(new.model_dump())
    return [(k, a.get(k), b.get(k)) for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, Mapping):
        return {
            k: v for key, value in data.items() for k, v in _flat(value, f"{prefix}{key}.").items()
        }
    if isinstance(data, (list, tuple)) and data and all(isinstance(v, Mapping) for v in data):
        return {
            k: v for i, item in enumerate(data) for k, v in _flat(item, f"{prefix}{i}.").items()
        }
    return {prefix[:-1]: list(data) if isinstance(data, tuple) else data}


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> JobConfig:
    """Read ``path`` (TOML), apply ``--section.field VALUE`` overrides, check it all.

    Relative paths in the config are kept as written (relative to the working
    directory, as a command line's are)."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    for key, value in parse_overrides(overrides):
        if _is_list(key) and value is not None and not isinstance(value, list):
            # A list field takes a plain value too: one item, or items split at commas.
            value = value.split(",") if isinstance(value, str) else [value]
        _set(raw, key, value)
    return check(raw, where=str(path))


def _is_list(key: str) -> bool:
    """Whether ``section.field`` is a list (tuple) field of the config."""
    parts = key.split(".")
    section = JobConfig.model_fields.get(parts[0])
    if len(parts) != 2 or section is None or not isinstance(section.annotation, type):
        return False
    field = getattr(section.annotation, "model_fields", {}).get(parts[1])
    if field is None:
        return False
    kinds = [field.annotation, *typing.get_args(field.annotation)]
    return any(typing.get_origin(k) in (tuple, list) for k in kinds)


def check(raw: Mapping[str, Any], where: str = "config") -> JobConfig:
    """The :class:`JobConfig` of ``raw`` (a parsed TOML document), or ConfigError."""
    _unknown_keys(raw, JobConfig, prefix="")
    try:
        # As JSON: strict types, with TOML arrays taken for tuples.
        config = JobConfig.model_validate_json(json.dumps(raw, default=str))
    except ValidationError as exc:
        errors = exc.errors()
        loc = _field_loc(errors[0]["loc"])
        field = ".".join(str(p) for p in loc)  # empty: a check across sections
        named = f"{field}: " if field else ""
        # a union reports once per member it tried: one line for the field
        alike = [e for e in errors if _field_loc(e["loc"]) == loc]
        raise ConfigError(f"{where}: {named}{_message(*alike)}") from None
    for section, build in (
        ("sampling", config.sampling_params),
        ("scheduler", config.scheduler_config),
        # Its values only: the run's reference model is loaded later.
        ("objective", lambda: config.grpo_objective(reference=_NO_MODEL_YET)),
    ):
        try:
            build()  # the dataclass's own checks
        except ValueError as exc:  # its message starts with the field's name
            name = str(exc).split("=", 1)[0].split(" ", 1)[0]
            raise ConfigError(f"{where}: {section}.{name}: {exc}") from None
    return config


_NO_MODEL_YET = object()


def parse_overrides(args: Sequence[str]) -> list[tuple[str, Any]]:
    """``["--scheduler.ahead", "2", ...]`` (or ``--scheduler.ahead=2``) as (key, value)."""
    out: list[tuple[str, Any]] = []
    items = list(args)
    while items:
        flag = items.pop(0)
        if not flag.startswith("--") or "." not in flag:
            raise ConfigError(f"{flag!r}: overrides are --section.field VALUE")
        key, eq, text = flag[2:].partition("=")
        if not eq:
            if not items:
                raise ConfigError(f"{flag}: missing its value")
            text = items.pop(0)
        out.append((key, _value(text)))
    return out


# --------------------------------------------------------------------------- helpers


def _value(text: str) -> Any:
    if text.lower() in ("none", "null"):
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word: a string


def _set(raw: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    node: Any = raw
    for i, part in enumerate(parents):
        if isinstance(node, list):  # rewards.0.weight
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"--{key}: {'.'.join(parents[: i + 1])} is not an entry")
            node = node[int(part)]
        else:
            node = node.setdefault(part, {})
        if not isinstance(node, (dict, list)):
            raise ConfigError(f"--{key}: {'.'.join(parents[: i + 1])} is not a section")
    if value is None:
        node.pop(last, None)
    else:
        node[last] = value


def _unknown_keys(raw: Mapping[str, Any], model: type[BaseModel], prefix: str) -> None:
    """Unknown keys, named with the closest valid key, before pydantic's messages."""
    fields = model.model_fields
    for key, value in raw.items():
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            valid = ", ".join(fields)
            raise ConfigError(f"{prefix}{key}: unknown key{hint}; valid keys: {valid}")
        inner = _section_model(fields[key].annotation)
        if inner is None:
            continue
        if isinstance(value, Mapping):
            _unknown_keys(value, inner, f"{prefix}{key}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, Mapping):
                    _unknown_keys(item, inner, f"{prefix}{key}.{i}.")


def _section_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _message(error: Mapping[str, Any], *alternatives: Mapping[str, Any]) -> str:
    """One error's line; with ``alternatives`` (the other members of a union), theirs
    joined by "or"."""
    if error["type"] == "missing":
        return "required, but missing"
    errors = (error, *alternatives)
    texts = dict.fromkeys(str(e["msg"]).removeprefix("Value error, ") for e in errors)
    first, *others = texts
    text = "".join([first, *(f", or {t[:1].lower()}{t[1:]}" for t in others)])
    if "input" in error:
        text += f" (got {error['input']!r})"
    return text


def _field_loc(loc: Sequence[int | str]) -> tuple[int | str, ...]:
    """``loc`` of a validation error without the tags pydantic adds for the member of a
    union it tried (``bool``, ``literal[...]``): the parts that name a field or an item."""
    at: Any = JobConfig  # the model the next part is a field of, else the field's type
    kept: list[int | str] = []
    for part in loc:
        fields = getattr(at, "model_fields", None)
        if isinstance(part, int) or (fields is None and _is_mapping(at)):
            kept.append(part)  # an item of a list, or a key of a table
        elif fields is not None and part in fields:
            kept.append(part)
            annotation = fields[part].annotation
            at = _section_model(annotation) or annotation
    return tuple(kept)


def _is_mapping(annotation: Any) -> bool:
    return any(
        typing.get_origin(a) in (dict, Mapping) or a in (dict, Mapping)
        for a in (annotation, *typing.get_args(annotation))
    )
