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
    cancelled_rollout,
    error_text,
    parse_reward,
)
from dew.objectives.rl.sources.chat import ChatTokens, resolve_stop_ids

__all__ = ["PromptSource", "Verifier"]

Verifier = Callable[[Task, "str | list[int]", Call], "float | Mapping[str, float]"]


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
    """

    def __init__(
        self,
        engine: Engine,
        prompts: Sequence[Any],
        verifier: Verifier,
        *,
        sampling: SamplingParams,
        tokenizer: Any = None,
        chat_template: bool = False,
        workers: int = 8,
        column: str | None = None,
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

    def start(self, task: Task, key: RolloutKey) -> Session:
        index = task_index(task, key, len(self.prompts))  # a bad id is the caller's bug
        session = self.begin(task, key)
        try:
            pending = self.engine.submit(
                self.prompt_ids(index), self.sampling, stop=session.stop, affinity=key.group
            )
        except BaseException as exc:  # resolves the session as run() raising would
            self.settle(session, partial(_reraise, exc))
            return session
        pending.add_done_callback(partial(self._generated, session))
        return session

    def _generated(self, session: ThreadedSession, pending: Future[Call]) -> None:
        """The engine answered (on its thread): score on the pool, or resolve now."""
        error = pending.exception()
        if isinstance(error, Aborted):
            self.settle(session, partial(cancelled_rollout, session.task, session.key))
        elif isinstance(error, EngineError):  # lost to a fault: the sample runs again
            self.settle(session, partial(_lost, session.task, session.key, error))
        elif error is not None:  # a closed or broken engine is not the rollout's doing
            self.settle(session, partial(_reraise, error))
        else:
            call = pending.result()
            self.settle_on_pool(session, partial(self._score, session.task, session.key, call))

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

    def _score(self, task: Task, key: RolloutKey, call: Call) -> Rollout:
        """The verifier's verdict on one finished call, as a rollout."""
        try:
            reward, parts = parse_reward(self.verifier(task, self.completion_view(call), call))
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
