"""PromptSource: single-turn RLVR: one prompt, one completion, one verifier score.

A task's id is the decimal index of its prompt in ``prompts`` (a list, any sequence, or
a ``datasets.Dataset`` column). A prompt is token ids, a string (encoded with the
tokenizer), or, with ``chat_template=True``, a string taken as one user message or a
list of chat messages, rendered with the tokenizer's chat template.

The verifier is called as ``verifier(task, completion, call)``:

* ``completion`` is the completion without its stop token: decoded text when the source
  has a tokenizer, else the token ids;
* ``call`` is the full :class:`~dew.core.Call` (raw ids with the stop token,
  ``finish_reason``, log-probs, version);

and returns a float, or a mapping of named reward parts whose sum is the reward (the
parts are kept as the rollout's ``components``).

A :class:`GroupVerifier` instead scores a group's completions in one call
(``score_group(task, completions, calls)``, one result per completion), for a reward
model or a batched API that keeps its batching. The source holds each finished
completion until ``group_size`` completions of its group are in (the scheduler's
``groups``, which admission waits for anyway), or until none of the group is still
generating and ``group_size`` of its attempts have ended; then it scores the waiting
ones together. Without ``group_size`` it scores them once none of the group is still
generating. A rollout cancelled while it waits resolves at once, unscored; a retry
started after its group was scored is scored on its own.

Outcomes: the engine stopping on a stop token gives ``COMPLETED``; reaching
``sampling.max_tokens`` gives ``TRUNCATED`` with ``truncation="length"``, still scored (the
scheduler's truncation policy decides what that score is worth). A verifier that
raises (``SystemExit`` and ``KeyboardInterrupt`` included) or returns something that is
not a finite number gives ``INFRA_ERROR`` with the error text and no reward. A
cancelled session gives ``CANCELLED``. A request the engine lost to a fault
(:class:`~dew.core.EngineError`, say a fleet member that died) gives ``INFRA_ERROR``,
so the scheduler runs the sample again. An engine that is closed or broken raises out
of the session: that is not a property of the rollout.

Concurrency: ``start`` encodes the prompt and submits it to the engine
(:class:`dew.core.Engine`) on the caller's thread, and no thread waits on the
generation. When the future resolves (on the engine's thread), the verifier is handed
to the :class:`~dew.core.ThreadedSource` pool, so a slow verifier never holds the
engine; an abort or engine failure resolves the session right there. Cancelling a
session sets its stop event, which the engine sees at its next iteration. The
invariants of ``ThreadedSource`` hold (``close()`` waits for sessions resolved off the
pool too). The source holds no mutable state of its own besides the prompt cache,
which is filled under a lock.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

from dew.core import (
    Aborted,
    Call,
    Engine,
    EngineError,
    Rollout,
    RolloutKey,
    SamplingParams,
    Session,
    Status,
    Task,
    ThreadedSession,
    ThreadedSource,
    as_int,
    cancelled_rollout,
    error_text,
    parse_reward,
)
from dew.objectives.rl.sources._gather import Gathering
from dew.objectives.rl.sources.chat import ChatTokens, resolve_stop_ids

__all__ = ["GroupVerifier", "PromptSource", "Verifier"]

Verifier = Callable[[Task, "str | list[int]", Call], "float | Mapping[str, float]"]


class GroupVerifier(ABC):
    """A verifier that scores the completions of one group (one task) in one call."""

    @abstractmethod
    def score_group(
        self, task: Task, completions: Sequence[str | list[int]], calls: Sequence[Call]
    ) -> Sequence[float | Mapping[str, float] | Exception]:
        """One result per completion, in order: its reward (a float or named parts), or
        the exception that fails that rollout alone. Raising fails every rollout given."""

    def __call__(
        self, task: Task, completion: str | list[int], call: Call
    ) -> float | Mapping[str, float]:
        """One completion's reward, as a plain :data:`Verifier`."""
        (result,) = self.score_group(task, [completion], [call])
        if isinstance(result, Exception):
            raise result
        return result


def token_ids(value: object, name: str) -> list[int]:
    """Token ids from a list, tuple, numpy array or tensor."""
    items = value.tolist() if hasattr(value, "tolist") else value
    if not isinstance(items, Sequence) or isinstance(items, (str, bytes)):
        raise ValueError(f"{name} must be token ids, got {type(value).__name__}")
    try:
        return [int(t) for t in items]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be token ids (ints)") from None


def encode_prompt(item: Any, name: str, *, tokenizer: Any, chat: ChatTokens | None) -> list[int]:
    """A prompt's token ids, as :class:`PromptSource` sends it (see the module
    docstring); ValueError naming ``name`` for an item it cannot take."""
    if chat is not None:
        messages = [{"role": "user", "content": item}] if isinstance(item, str) else item
        if not isinstance(messages, Sequence) or not all(isinstance(m, Mapping) for m in messages):
            raise ValueError(f"{name} must be a string or a list of chat messages")
        return chat.first(messages)
    if isinstance(item, str):
        if tokenizer is None:
            raise ValueError(f"{name} is text; text prompts need a tokenizer")
        return [int(t) for t in tokenizer(item)["input_ids"]]
    return token_ids(item, name)


def task_index(task: Task, key: RolloutKey, size: int) -> int:
    """The prompt index a task id names; ValueError naming the key otherwise."""
    try:
        index = int(task.id, 10)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: task id {task.id!r} is not a decimal index") from None
    if not 0 <= index < size:
        raise ValueError(f"{key}: task id {task.id!r} is outside the {size} prompts")
    return index


class PromptSource(ThreadedSource):
    """Single-turn rollouts from ``prompts`` scored by ``verifier`` (see module docstring).

    ``prompts`` may also be a table (a ``datasets.Dataset``) with ``column`` naming the
    column of prompts; a table without ``column`` is refused at construction.
    ``group_size``: with a :class:`GroupVerifier`, the scheduler's ``groups`` (how many
    completions of a group to score together; see the module docstring).
    """

    def __init__(
        self,
        engine: Engine,
        prompts: Sequence[Any],
        verifier: Verifier | GroupVerifier,
        *,
        sampling: SamplingParams,
        tokenizer: Any = None,
        chat_template: bool = False,
        workers: int = 8,
        column: str | None = None,
        group_size: int | None = None,
    ) -> None:
        if not hasattr(prompts, "__getitem__") or not hasattr(prompts, "__len__"):
            raise ValueError(f"prompts must be a sequence, got {type(prompts).__name__}")
        names = getattr(prompts, "column_names", None)  # a table: a datasets.Dataset
        if names is not None:
            if column is None:
                raise ValueError(
                    f"prompts is a table with columns {list(names)}: pass column=NAME, the "
                    "one that holds the prompts"
                )
            if column not in names:
                raise ValueError(f"column={column!r} is not one of the columns {list(names)}")
            prompts = prompts[column]
        elif column is not None:
            raise ValueError("column= names a column of a table (a datasets.Dataset) of prompts")
        if not callable(verifier):
            raise ValueError("verifier must be callable as verifier(task, completion, call)")
        if chat_template and tokenizer is None:
            raise ValueError("chat_template=True needs a tokenizer")
        self.sampling = resolve_stop_ids(sampling, tokenizer)
        super().__init__(workers=workers)
        self.engine = engine
        self.prompts = prompts
        self.verifier = verifier
        self.tokenizer = tokenizer
        self._chat = ChatTokens(tokenizer) if chat_template else None
        self._encoded: dict[int, list[int]] = {}
        self._encoded_lock = threading.Lock()
        # Finished calls of a GroupVerifier's groups, held until the group is in.
        self._gathering: Gathering[RolloutKey, tuple[ThreadedSession, Call]] | None = None
        if isinstance(verifier, GroupVerifier):
            if group_size is not None:
                group_size = as_int(group_size, "group_size", minimum=1)
            self._gathering = Gathering(group_size)
        self._gathering_lock = threading.Lock()

    def start(self, task: Task, key: RolloutKey) -> Session:
        index = task_index(task, key, len(self.prompts))  # a bad id is the caller's bug
        session = self.begin(task, key)
        self._gather_started(session)
        try:
            pending = self.engine.submit(
                self.prompt_ids(index), self.sampling, stop=session.stop, affinity=key.group
            )
        except BaseException as exc:  # resolves the session as run() raising would
            self._gather_dropped(session)
            self.settle(session, partial(_reraise, exc))
            return session
        pending.add_done_callback(partial(self._generated, session))
        return session

    def _generated(self, session: ThreadedSession, pending: Future[Call]) -> None:
        """The engine answered (on its thread): score on the pool, or resolve now."""
        error = pending.exception()
        if error is None and self._gathering is not None:
            self._gather_generated(session, pending.result())
            return
        self._gather_dropped(session)
        if isinstance(error, Aborted):
            self.settle(session, partial(cancelled_rollout, session.task, session.key))
        elif isinstance(error, EngineError):  # lost to a fault: the sample runs again
            self.settle(session, partial(_lost, session.task, session.key, error))
        elif error is not None:  # a closed or broken engine is not the rollout's doing
            self.settle(session, partial(_reraise, error))
        else:
            call = pending.result()
            scored = partial(self._score, session.task, session.key, call, time.monotonic())
            self.settle_on_pool(session, scored)

    # A GroupVerifier's gathering (None otherwise) hears of each session's generation:
    # started, dropped (no completion) or generated; a group in is scored on the pool.

    def _gather_started(self, session: ThreadedSession) -> None:
        if self._gathering is not None:
            key = session.key
            with self._gathering_lock:
                self._gathering.started(key.group, key, retry=key.attempt > 0)

    def _gather_dropped(self, session: ThreadedSession) -> None:
        if self._gathering is not None:
            with self._gathering_lock:
                ready = self._gathering.dropped(session.key.group, session.key)
            self._score_when_in(ready)

    def _gather_generated(self, session: ThreadedSession, call: Call) -> None:
        assert self._gathering is not None
        session.generated = time.monotonic()
        with self._gathering_lock:
            ready = self._gathering.generated(session.key.group, session.key, (session, call))
        session.on_cancel(partial(self._withdraw, session))
        self._score_when_in(ready)

    def _score_when_in(self, ready: list[tuple[ThreadedSession, Call]]) -> None:
        if not ready:
            return
        try:
            self._pool.submit(self._score_group, ready)
        except RuntimeError:  # closed meanwhile: each was cancelled, none scored
            for waiting, _ in ready:
                self.settle(waiting, partial(cancelled_rollout, waiting.task, waiting.key))

    def _withdraw(self, session: ThreadedSession) -> None:
        """A session cancelled while its call waits for its group: resolved now."""
        with self._gathering_lock:
            assert self._gathering is not None
            held = self._gathering.withdraw(session.key.group, session.key)
        if held is not None:
            self.settle(session, partial(cancelled_rollout, session.task, session.key))

    def _score_group(self, ready: list[tuple[ThreadedSession, Call]]) -> None:
        """Score a group's finished calls in one GroupVerifier call (on the pool) and
        resolve each session with its own result; a session cancelled meanwhile is
        resolved as cancelled, unscored."""
        verifier = self.verifier
        assert isinstance(verifier, GroupVerifier)
        live = [(s, call) for s, call in ready if not s.stop.is_set()]
        results: list[Any] = []
        if live:
            task, calls = live[0][0].task, [call for _, call in live]
            try:
                views = [self.completion_view(call) for call in calls]
                results = list(verifier.score_group(task, views, calls))
                if len(results) != len(calls):
                    raise ValueError(
                        f"score_group returned {len(results)} results for {len(calls)} completions"
                    )
            except BaseException as exc:  # every rollout's failure; re-raised below if fatal
                results = [exc] * len(calls)
            now = time.monotonic()
            for s, _ in live:  # each waited for its group, then for the verifier
                self.outside.add(max(now - (s.generated or now), 0.0))
        verdicts = dict(zip((s for s, _ in live), results, strict=True))
        fatal: BaseException | None = None
        for session, call in ready:
            produce = partial(self._rollout, session.task, session.key, call)
            try:
                self.settle(session, partial(produce, verdicts.get(session)))
            except BaseException as exc:  # the rest are still resolved first
                fatal = fatal or exc
        if fatal is not None:
            raise fatal

    def prompt_ids(self, index: int) -> list[int]:
        """Token ids of prompt ``index`` (encoded once, then cached)."""
        with self._encoded_lock:
            cached = self._encoded.get(index)
        if cached is not None:
            return cached
        ids = self._encode(self.prompts[index], index)
        with self._encoded_lock:
            self._encoded[index] = ids
        return ids

    def _encode(self, item: Any, index: int) -> list[int]:
        return encode_prompt(item, f"prompts[{index}]", tokenizer=self.tokenizer, chat=self._chat)

    def completion_view(self, call: Call) -> str | list[int]:
        """What the verifier sees: the completion without its stop token, as text when
        the source has a tokenizer."""
        ids = [int(t) for t in call.completion]
        if call.finish_reason == "stop" and ids:
            ids = ids[:-1]
        if self.tokenizer is None:
            return ids
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _score(self, task: Task, key: RolloutKey, call: Call, generated: float) -> Rollout:
        """The verifier's verdict on one finished call, as a rollout; ``generated``:
        when the engine finished it (monotonic), which starts its time outside."""
        try:
            result = self.verifier(task, self.completion_view(call), call)
        except (Exception, SystemExit, KeyboardInterrupt) as exc:  # see _rollout
            result = exc
        self.outside.add(max(time.monotonic() - generated, 0.0))
        return self._rollout(task, key, call, result)

    def _rollout(self, task: Task, key: RolloutKey, call: Call, result: Any) -> Rollout:
        """One finished call's rollout, given its verifier's result (or exception)."""
        try:
            if isinstance(result, BaseException):
                raise result
            reward, parts = parse_reward(result)
        except (Exception, SystemExit, KeyboardInterrupt) as exc:
            # The verifier's failure is the rollout's, recorded, never a reward. On a
            # pool thread an exit or interrupt can only be the verifier's own raise (a
            # Ctrl-C reaches the main thread), so it is that too, not the run's end.
            return Rollout(
                key=key,
                task=task,
                status=Status.INFRA_ERROR,
                calls=(call,),
                error=f"verifier failed: {error_text(exc)}",
            )
        truncated = call.finish_reason == "length"
        status = Status.TRUNCATED if truncated else Status.COMPLETED
        return Rollout(
            key=key,
            task=task,
            status=status,
            calls=(call,),
            reward=reward,
            components=parts,
            truncation="length" if truncated else None,
        )


def _lost(task: Task, key: RolloutKey, error: EngineError) -> Rollout:
    return Rollout(
        key=key, task=task, status=Status.INFRA_ERROR, error=f"engine: {error_text(error)}"
    )


def _reraise(error: BaseException) -> Rollout:
    raise error
