"""Reward functions named in a config, in TRL's signature or dew's, and two built-ins.

A function is named ``package.module:function`` or ``path/to/file.py:function`` and may
have either signature:

* TRL's, batched: ``fn(prompts, completions, completion_ids, **columns)`` returning one
  ``float | None`` per completion (``None``: this function does not score it). A TRL
  user's reward file works unchanged, ``async def`` included. It is called once per
  group, with the group's completions (the prompt and each column repeated per
  completion, as TRL repeats them), so a reward model or a batched API keeps its
  batching. For chat data, prompts are message lists and each completion is
  ``[{"role": "assistant", "content": text}]``, as TRL passes them. Of what TRL passes
  besides the columns, dew passes nothing: there is no ``trainer_state``,
  ``log_extra``, ``log_metric`` or ``environments`` (dew records each function's
  values itself).
* dew's verifier: ``fn(task, completion, call)`` returning a float or a mapping of
  named parts (:class:`~dew.objectives.rl.sources.PromptSource`'s convention), called
  once per completion; here ``task.data`` is the dataset row, every column.

:func:`combine` makes one :class:`~dew.objectives.rl.sources.GroupVerifier` of several
weighted functions: a completion's reward is the sum of ``weight x value`` over the
functions that scored it, and each function's share is kept as a component named by
the function (:func:`labels`). A function that raises, returns the wrong number of
values, or returns something not finite ends the rollout as an error naming the
function (the source records it with the error text), never as a reward of 0; so does
a rollout that no function scored. When a batched call raises, the group's completions
are scored again one at a time, so the error lands on the rollouts that cause it and
the others keep their scores.

Given a :class:`~dew.job._reward_pool.RewardPool` (as ``dew train`` gives it), each
call runs in a worker process of the pool, bounded by the function's ``timeout``: a
reward that hangs, exits its process, raises ``SystemExit`` or ``KeyboardInterrupt``,
or is killed is an error of every rollout in that call, naming the function and what
happened, and it cannot hold the run.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from dew.core import Call, Task, error_text, is_real
from dew.objectives.rl.sources import GroupVerifier

__all__ = [
    "REWARD_TIMEOUT",
    "Reward",
    "RewardError",
    "boxed_format",
    "combine",
    "exact_answer",
    "load_reward",
    "score_many",
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
    def score_many(self, index: int, *args: Any) -> list[float | RewardError | None]: ...


# A completion's result: its reward's named parts, or the error that fails it.
_Result = dict[str, float] | RewardError


class _Combined(GroupVerifier):
    """Several weighted reward functions as one verifier (see :func:`combine`)."""

    def __init__(
        self,
        rewards: Sequence[Reward],
        rows: Sequence[Mapping[str, Any]],
        prompt_column: str,
        chat: bool,
        pool: _Runs | None,
    ) -> None:
        self.rewards, self.rows, self.prompt_column = tuple(rewards), rows, prompt_column
        self.chat, self.pool = chat, pool
        self.labels = labels(rewards)

    def score_group(
        self, task: Task, completions: Sequence[Any], calls: Sequence[Call]
    ) -> list[_Result]:
        row = dict(self.rows[int(task.id)])
        prompt = row[self.prompt_column]
        columns = {k: v for k, v in row.items() if k != self.prompt_column}
        task = Task(task.id, data=row)
        results: list[_Result] = [{} for _ in completions]
        for index, reward in enumerate(self.rewards):
            todo = [i for i, r in enumerate(results) if not isinstance(r, RewardError)]
            if not todo:
                break
            args = (
                task,
                prompt,
                [completions[i] for i in todo],
                [calls[i] for i in todo],
                columns,
                self.chat,
            )
            try:
                if self.pool is None:
                    values = score_many(reward, *args)
                else:
                    values = self.pool.score_many(index, *args)
            except RewardError as exc:  # the call itself failed: late, killed, stopped
                values = [exc] * len(todo)
            for i, value in zip(todo, values, strict=True):
                parts = results[i]
                if isinstance(value, RewardError):
                    results[i] = value
                elif value is not None and isinstance(parts, dict):
                    parts[self.labels[index]] = reward.weight * value
        names = ", ".join(r.name for r in self.rewards)
        unscored = RewardError(f"no reward function scored this rollout ({names} all gave None)")
        return [unscored if r == {} else r for r in results]


def combine(
    rewards: Sequence[Reward],
    rows: Sequence[Mapping[str, Any]],
    *,
    prompt_column: str,
    chat: bool,
    pool: _Runs | None = None,
) -> GroupVerifier:
    """One verifier for :class:`~dew.objectives.rl.sources.PromptSource` over ``rows``
    (the dataset; a task id is a row index): see the module docstring. ``chat``: the
    prompts are message lists. ``pool``: the :class:`~dew.job._reward_pool.RewardPool`
    (of the same ``rewards``) whose processes run the calls; None runs them on the
    caller's thread, unbounded."""
    if not rewards:
        raise RewardError("no reward functions")
    return _Combined(rewards, rows, prompt_column, chat, pool)


def labels(rewards: Sequence[Reward]) -> list[str]:
    """Each reward's name in metrics and records: its function's name (``reward/NAME``),
    or the whole spec where two rewards share a function name."""
    short = [r.name.rpartition(":")[2] for r in rewards]
    return [s if short.count(s) == 1 else r.name for s, r in zip(short, rewards, strict=True)]


def score_many(
    reward: Reward,
    task: Task,
    prompt: Any,
    completions: Sequence[Any],
    calls: Sequence[Call],
    row: Mapping[str, Any],
    chat: bool,
) -> list[float | RewardError | None]:
    """``reward``'s value for each completion of one task (None: not scored), or the
    :class:`RewardError` naming it that fails that completion: it raised an
    ``Exception`` or gave something that is not a finite number. A batched function is
    called once for all; when that call raises, once per completion (see the module
    docstring)."""
    pairs = list(zip(completions, calls, strict=True))
    if not reward.batched:
        return [_verify(reward, task, completion, call) for completion, call in pairs]
    try:
        return _batch(reward, prompt, completions, calls, row, chat)
    except RewardError as exc:
        if len(pairs) == 1 or exc.__cause__ is None:  # a bad reply is the call's, not a row's
            return [exc] * len(pairs)
    return [_alone(reward, prompt, completion, call, row, chat) for completion, call in pairs]


def _batch(
    reward: Reward,
    prompt: Any,
    completions: Sequence[Any],
    calls: Sequence[Call],
    row: Mapping[str, Any],
    chat: bool,
) -> list[float | RewardError | None]:
    """One call of a TRL-signature function on ``completions``; RewardError (with the
    exception as its cause) when it raises, without a cause when its reply is not one
    value per completion."""
    n = len(completions)
    texts = [[{"role": "assistant", "content": c}] if chat else c for c in completions]
    try:
        got = reward.fn(
            prompts=[prompt] * n,
            completions=texts,
            completion_ids=[list(call.completion) for call in calls],
            **{k: [v] * n for k, v in row.items()},
        )
        if inspect.iscoroutine(got):  # an async def, as TRL allows
            got = asyncio.run(got)
    except Exception as exc:
        raise RewardError(f"reward {reward.name} raised {error_text(exc)}") from exc
    if not isinstance(got, Sequence) or isinstance(got, (str, bytes)) or len(got) != n:
        raise RewardError(
            f"reward {reward.name} returned {got!r:.80}, not a list of one value per "
            f"completion ({n})"
        )
    return [_checked(reward, value) for value in got]


def _alone(
    reward: Reward, prompt: Any, completion: Any, call: Call, row: Mapping[str, Any], chat: bool
) -> float | RewardError | None:
    try:
        return _batch(reward, prompt, [completion], [call], row, chat)[0]
    except RewardError as exc:
        return exc


def _verify(reward: Reward, task: Task, completion: Any, call: Call) -> float | RewardError | None:
    """A dew-signature function on one completion; a mapping of parts counts as its sum."""
    try:
        value = reward.fn(task, completion, call)
    except Exception as exc:
        return RewardError(f"reward {reward.name} raised {error_text(exc)}")
    if not isinstance(value, Mapping):
        return _checked(reward, value)
    try:
        return sum(_finite(reward, v) for v in value.values())
    except RewardError as exc:
        return exc


def _checked(reward: Reward, value: Any) -> float | RewardError | None:
    if value is None:
        return None
    try:
        return _finite(reward, value)
    except RewardError as exc:
        return exc


def _finite(reward: Reward, value: Any) -> float:
    """``value`` as a float, when it is a finite real number (numpy's scalars count, as
    in TRL; a bool does not); else an error naming the reward."""
    if not is_real(value):
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
