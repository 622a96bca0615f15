"""PromptSource: single-turn RLVR: one prompt, one completion, one verifier score.

A task's id is the decimal index of its prompt in ``prompts`` (a list, any sequence, or
a ``datasets.Dataset`` column). A prompt is token ids, a string (encoded with the
tokenizer), or, with ``chat_template=True``, a string taken as one user message or a
list of chat messages, rendered with the tokenizer's chat template.

The verifier is called as ``verifier(task, completion, call)``:

* ``completion`` is the completion without its stop token: decoded text when the source
  has a tokenizer, else the token ids;
* ``call`` is the full :class:`~dew.objectives.rl.sessions.Call` (raw ids with the stop
  token, ``finish_reason``, log-probs, version);

and returns a float, or a mapping of named reward parts whose sum is the reward (the
parts are kept as the rollout's ``components``).

Outcomes: the engine stopping on a stop token gives ``COMPLETED``; reaching
``max_tokens`` gives ``TRUNCATED`` with ``truncation="length"``, still scored (the
scheduler's truncation policy decides what that score is worth). A verifier that
raises or returns something that is not a finite number gives ``INFRA_ERROR`` with the
error text and no reward. A cancelled session gives ``CANCELLED``. An engine that is
closed or broken raises out of the session: that is not a property of the rollout.

Concurrency: with an engine that offers ``submit`` (a future of the call, as
:class:`~dew.serving.RolloutServer` does), ``start`` encodes the prompt and submits it
on the caller's thread, and no thread waits on the generation. When the future
resolves (on the engine's thread), the verifier is handed to the
:class:`~dew.objectives.rl.sessions.ThreadedSource` pool, so a slow verifier never
holds the engine; an abort or engine failure resolves the session right there. With
an engine that only has ``generate``, each rollout runs on the pool and blocks in it.
Either way the continuous batching is where the concurrency pays off, and the
invariants of ``ThreadedSource`` hold (``close()`` waits for sessions resolved off the
pool too). The source holds no mutable state of its own besides the prompt cache,
which is filled under a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any

from dew.objectives.rl.sessions import (
    Call,
    Rollout,
    RolloutKey,
    Status,
    Task,
    ThreadedSource,
    _cancelled_rollout,
)
from dew.objectives.rl.sources._common import (
    ChatTokens,
    Engine,
    error_text,
    parse_reward,
    token_ids,
)
from dew.serving import Aborted

if TYPE_CHECKING:
    from dew.objectives.rl.sessions import _ThreadedSession

__all__ = ["PromptSource", "Verifier"]

Verifier = Callable[[Task, "str | list[int]", Call], "float | Mapping[str, float]"]


def default_stop_ids(server: object, tokenizer: Any) -> list[int]:
    """The tokenizer's end-of-sequence id, else the served model's (when it says)."""
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is None:
        eos = getattr(server, "eos_token_ids", None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]


def check_sampling(
    max_tokens: int, temperature: float, top_k: int | None, top_p: float | None
) -> None:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")


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
    """Single-turn rollouts from ``prompts`` scored by ``verifier`` (see module docstring)."""

    def __init__(
        self,
        server: Engine,
        prompts: Sequence[Any],
        verifier: Verifier,
        *,
        tokenizer: Any = None,
        chat_template: bool = False,
        max_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        stop_ids: Collection[int] | None = None,
        workers: int = 8,
    ) -> None:
        if not hasattr(prompts, "__getitem__") or not hasattr(prompts, "__len__"):
            raise ValueError(f"prompts must be a sequence, got {type(prompts).__name__}")
        if not callable(verifier):
            raise ValueError("verifier must be callable as verifier(task, completion, call)")
        if chat_template and tokenizer is None:
            raise ValueError("chat_template=True needs a tokenizer")
        check_sampling(max_tokens, temperature, top_k, top_p)
        super().__init__(workers=workers)
        self.server = server
        self.prompts = prompts
        self.verifier = verifier
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.stop_ids = (
            default_stop_ids(server, tokenizer) if stop_ids is None else [int(t) for t in stop_ids]
        )
        self._chat = ChatTokens(tokenizer) if chat_template else None
        self._encoded: dict[int, list[int]] = {}
        self._encoded_lock = threading.Lock()

    def start(self, task: Task, key: RolloutKey) -> Any:
        index = task_index(task, key, len(self.prompts))  # a bad id is the caller's bug
        submit = getattr(self.server, "submit", None)
        if not callable(submit):
            return super().start(task, key)
        session = self._open(task, key)
        session.future.set_running_or_notify_cancel()  # resolved by the engine's answer
        try:
            pending = self._ask(submit, index, session.stop)
        except BaseException as exc:  # resolves the session as run() raising would
            self._settle(session, partial(_reraise, exc))
            return session
        pending.add_done_callback(partial(self._generated, session))
        return session

    def _generated(self, session: _ThreadedSession, pending: Future[Call]) -> None:
        """The engine answered (on its thread): score on the pool, or resolve now."""
        error = pending.exception()
        cancelled = partial(_cancelled_rollout, session.task, session.key)
        if isinstance(error, Aborted):
            self._settle(session, cancelled)
        elif error is not None:  # a closed or broken engine is not the rollout's doing
            self._settle(session, partial(_reraise, error))
        else:
            call = pending.result()
            score = partial(self._score, session.task, session.key, call)
            try:
                self._pool.submit(self._settle, session, score)
            except RuntimeError:  # close() shut the pool after stopping this session
                self._settle(session, cancelled)

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
        name = f"prompts[{index}]"
        if self._chat is not None:
            messages = [{"role": "user", "content": item}] if isinstance(item, str) else item
            if not isinstance(messages, Sequence) or not all(
                isinstance(m, Mapping) for m in messages
            ):
                raise ValueError(f"{name} must be a string or a list of chat messages")
            return self._chat.first(messages)
        if isinstance(item, str):
            if self.tokenizer is None:
                raise ValueError(f"{name} is text; text prompts need a tokenizer")
            return [int(t) for t in self.tokenizer(item)["input_ids"]]
        return token_ids(item, name)

    def completion_view(self, call: Call) -> str | list[int]:
        """What the verifier sees: the completion without its stop token, as text when
        the source has a tokenizer."""
        ids = [int(t) for t in call.completion]
        if call.finish_reason == "stop" and ids:
            ids = ids[:-1]
        if self.tokenizer is None:
            return ids
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def run(self, task: Task, key: RolloutKey, stop: threading.Event) -> Rollout:
        """One rollout on a pool thread (engines without ``submit``)."""
        try:
            call = self._ask(self.server.generate, task_index(task, key, len(self.prompts)), stop)
        except Aborted:
            return _cancelled_rollout(task, key)
        return self._score(task, key, call)

    def _ask(self, method: Callable[..., Any], index: int, stop: threading.Event) -> Any:
        """``method`` (the engine's ``generate`` or ``submit``) on prompt ``index`` with
        the source's sampling settings."""
        return method(
            self.prompt_ids(index),
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            stop_ids=self.stop_ids,
            stop=stop,
        )

    def _score(self, task: Task, key: RolloutKey, call: Call) -> Rollout:
        """The verifier's verdict on one finished call, as a rollout."""
        try:
            reward, parts = parse_reward(self.verifier(task, self.completion_view(call), call))
        except Exception as exc:  # the verifier's failure is recorded, never a reward
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


def _reraise(error: BaseException) -> Rollout:
    raise error
