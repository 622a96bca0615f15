"""Reward functions named in a config, in TRL's signature or dew's, and two built-ins.

A function is named ``package.module:function`` or ``path/to/file.py:function`` and may
have either signature:

* TRL's, batched: ``fn(prompts, completions, completion_ids, **columns)`` returning one
  ``float | None`` per completion (``None``: this function does not score it). A TRL
  user's reward file works unchanged. For chat data, prompts are message lists and
  each completion is ``[{"role": "assistant", "content": text}]``, as TRL passes them.
* dew's verifier: ``fn(task, completion, call)`` returning a float or a mapping of
  named parts (:class:`~dew.objectives.rl.sources.PromptSource`'s convention); here
  ``task.data`` is the dataset row, every column.

:func:`combine` makes one verifier of several weighted functions: the reward is the sum
of ``weight x value`` over the functions that scored the rollout, and each function's
share is kept as a component named by the function (:func:`labels`). A function
that raises, returns the wrong number of values, or returns something not finite ends
the rollout as an error naming the function (the source records it with the error
text), never as a reward of 0; so does a rollout that no function scored.

Given a :class:`~dew.job._reward_pool.RewardPool` (as ``dew train`` gives it), each
call runs in a worker process of the pool, bounded by the function's ``timeout``: a
reward that hangs, exits its process, raises ``SystemExit`` or ``KeyboardInterrupt``,
or is killed is that rollout's error, naming the function and what happened, and it
cannot hold the run.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from dew.core import Call, Task, error_text

__all__ = [
    "REWARD_TIMEOUT",
    "Reward",
    "RewardError",
    "boxed_format",
    "combine",
    "exact_answer",
    "load_reward",
    "score",
]

# Seconds one reward call may take before its process is killed and the rollout fails.
REWARD_TIMEOUT = 60.0


class RewardError(ValueError):
    """A reward function cannot be loaded, or failed on a rollout (its name first)."""


@dataclass(frozen=True)
class Reward:
    name: str  # as written in the config
    fn: Callable[..., Any]
    weight: float
    batched: bool  # TRL's signature (lists in, a list out)
    timeout: float = REWARD_TIMEOUT  # seconds per call, when run in a RewardPool


def load_reward(spec: str, weight: float = 1.0, timeout: float = REWARD_TIMEOUT) -> Reward:
    """The function ``spec`` names, with its signature told apart; RewardError if the
    module or file cannot be imported, has no such name, or the name is not a function
    of either signature."""
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise RewardError(f"{spec}: name a function as 'pkg.mod:fn' or 'file.py:fn'")
    try:
        module = _import(where)
    except RewardError:
        raise
    except Exception as exc:  # the user's module failed while importing
        why = f"{type(exc).__name__}: {exc}"
        raise RewardError(f"{spec}: importing {where} failed: {why}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise RewardError(f"{spec}: {where} has no {attr!r}")
    if not callable(fn):
        raise RewardError(f"{spec}: {attr!r} is not callable")
    return Reward(spec, fn, float(weight), _batched(spec, fn), float(timeout))


class _Runs(Protocol):
    def score(self, index: int, *args: Any) -> float | None: ...


def combine(
    rewards: Sequence[Reward],
    rows: Sequence[Mapping[str, Any]],
    *,
    prompt_column: str,
    chat: bool,
    pool: _Runs | None = None,
) -> Callable[[Task, Any, Call], dict[str, float]]:
    """One verifier for :class:`~dew.objectives.rl.sources.PromptSource` over ``rows``
    (the dataset; a task id is a row index): see the module docstring. ``chat``: the
    prompts are message lists. ``pool``: the :class:`~dew.job._reward_pool.RewardPool`
    (of the same ``rewards``) whose processes run the calls; None runs them on the
    caller's thread, unbounded."""
    if not rewards:
        raise RewardError("no reward functions")
    label = labels(rewards)

    def verifier(task: Task, completion: Any, call: Call) -> dict[str, float]:
        row = dict(rows[int(task.id)])
        prompt = row[prompt_column]
        columns = {k: v for k, v in row.items() if k != prompt_column}
        task = Task(task.id, data=row)
        parts: dict[str, float] = {}
        for index, reward in enumerate(rewards):
            args = (task, prompt, completion, call, columns, chat)
            value = score(reward, *args) if pool is None else pool.score(index, *args)
            if value is not None:
                parts[label[index]] = reward.weight * value
        if not parts:
            names = ", ".join(r.name for r in rewards)
            raise RewardError(f"no reward function scored this rollout ({names} all gave None)")
        return parts

    return verifier


def labels(rewards: Sequence[Reward]) -> list[str]:
    """Each reward's name in metrics and records: its function's name (``reward/NAME``),
    or the whole spec where two rewards share a function name."""
    short = [r.name.rpartition(":")[2] for r in rewards]
    return [s if short.count(s) == 1 else r.name for s, r in zip(short, rewards, strict=True)]


def score(
    reward: Reward,
    task: Task,
    prompt: Any,
    completion: Any,
    call: Call,
    row: Mapping[str, Any],
    chat: bool,
) -> float | None:
    """``reward``'s value for one completion (None: not scored); RewardError naming it
    when it raises an ``Exception`` or returns something that is not a finite number."""
    try:
        if reward.batched:
            text = [{"role": "assistant", "content": completion}] if chat else completion
            got = reward.fn(
                prompts=[prompt],
                completions=[text],
                completion_ids=[list(call.completion)],
                **{k: [v] for k, v in row.items()},
            )
            if not isinstance(got, Sequence) or isinstance(got, (str, bytes)) or len(got) != 1:
                raise RewardError(f"returned {got!r}, not a list of one value per completion")
            value = got[0]
        else:
            value = reward.fn(task, completion, call)
            if isinstance(value, Mapping):
                value = sum(_finite(reward, v) for v in value.values())
    except RewardError as exc:
        raise RewardError(f"reward {reward.name}: {exc}") from None
    except Exception as exc:
        raise RewardError(f"reward {reward.name} raised {error_text(exc)}") from exc
    if value is None:
        return None
    return _finite(reward, value)


def _finite(reward: Reward, value: Any) -> float:
    """``value`` as a float, when it is a finite real number (numpy's scalars count, as
    in TRL; a bool does not); else an error naming the reward."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardError(f"reward {reward.name} returned {value!r}, not a finite number")
    try:
        number = float(value)
    except (OverflowError, ValueError):  # an int too large for a float
        number = math.inf
    if not math.isfinite(number):
        raise RewardError(f"reward {reward.name} returned {value!r:.60}, not a finite number")
    return number


# --------------------------------------------------------------------------- built-ins

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _text(completion: Any) -> str:
    if isinstance(completion, list) and completion and isinstance(completion[-1], Mapping):
        return str(completion[-1].get("content", ""))
    return str(completion)


def final_answer(text: str) -> str | None:
    """The last ``\\boxed{...}`` of ``text``, else its last number, else None."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _same(got: str | None, want: Any) -> bool:
    if got is None:
        return False
    want = str(want).strip()
    try:
        return math.isclose(float(got), float(want), rel_tol=0, abs_tol=1e-9)
    except ValueError:
        return got == want


def exact_answer(
    prompts: Sequence[Any], completions: Sequence[Any], *, answer: Sequence[Any], **_: Any
) -> list[float]:
    """1.0 when a completion's final answer (its last ``\\boxed{}``, else its last
    number) equals the row's ``answer`` column (numerically when both are numbers)."""
    return [
        1.0 if _same(final_answer(_text(c)), a) else 0.0
        for c, a in zip(completions, answer, strict=True)
    ]


def boxed_format(prompts: Sequence[Any], completions: Sequence[Any], **_: Any) -> list[float]:
    """1.0 when a completion puts exactly one answer in ``\\boxed{}``."""
    return [1.0 if len(_BOXED.findall(_text(c))) == 1 else 0.0 for c in completions]


# --------------------------------------------------------------------------- loading


def _import(where: str) -> Any:
    if where.endswith(".py") or "/" in where:
        path = Path(where)
        if not path.is_file():
            raise RewardError(f"{where}: no such file")
        name = f"dew_reward_{abs(hash(str(path.resolve())))}"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise RewardError(f"{where}: cannot be imported as a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as exc:
        if exc.name is not None and where.startswith(exc.name):
            raise RewardError(f"{where}: no such module") from None
        raise


def _batched(spec: str, fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        raise RewardError(f"{spec}: its signature cannot be read") from None
    names = list(params)
    if "completions" in params or (names and names[0] == "prompts"):
        return True
    positional = [
        p
        for p in params.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    if len(positional) == 3:
        return False
    raise RewardError(
        f"{spec}: expected TRL's signature fn(prompts, completions, completion_ids, "
        f"**columns) or dew's fn(task, completion, call); got ({', '.join(names)})"
    )
