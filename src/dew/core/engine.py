"""The engine contract: how sources ask for completions and how the trainer publishes.

An :class:`Engine` turns a prompt (token ids) and :class:`SamplingParams` into a
:class:`~dew.core.types.Call`: the completion with the behavior log-probability of each
token and the weights version that served it. Any engine works under any source,
because sources use nothing but this contract:

* ``submit(prompt, params, stop=..., affinity=...)`` returns a
  :class:`~concurrent.futures.Future`
  at once and never blocks on generation. The future resolves to the ``Call``, to
  :class:`Aborted` once the request was stopped (its ``stop`` event set, or
  :meth:`Engine.abort` called with its future), to :class:`EngineError` when this
  request was lost to an infrastructure fault that another attempt may not meet (an
  engine process died or hung and was taken out of a fleet), or to ``RuntimeError``
  when the engine as a whole is closed or broken. Invalid arguments raise
  ``ValueError`` from ``submit`` itself.
* ``affinity`` is a routing hint: calls with equal affinity should go to the same
  engine while it is healthy (a group's samples share their prompt, a multi-turn
  session's calls extend each other), so a shared prefix is computed once there.
  Sources pass the rollout's group id. One engine alone ignores it.
* ``generate(...)`` is ``submit(...).result()``: the blocking convenience.
* ``abort(future)`` asks the engine to drop that request; idempotent, never blocks, and
  a no-op for a future that already resolved.
* ``version`` is the weights version served now.

A :class:`Publisher` is where the trainer's weights go: ``load(variables, version)``
serves them under ``version`` once it returns. An in-process engine is one; so is the
publish sequence of a fleet of engine processes.

This module imports nothing else of dew.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from dew.core._checks import as_int, is_real
from dew.core.types import Call

__all__ = [
    "MIN_TEMPERATURE",
    "Aborted",
    "Engine",
    "EngineError",
    "Publisher",
    "SamplingParams",
    "Variables",
    "scored_temperature",
]

# The lowest sampling temperature but greedy's 0. Far below it, scaled logits overflow
# float32 and the draw fails (for the whole batch, in engines that sample rows
# together); just below it, the distribution is greedy in all but name.
MIN_TEMPERATURE = 1e-2

Variables = Any  # the trainer's policy: a torch.nn.Module, or a state dict of tensors


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one completion is sampled; validated once, at construction.

    ``max_tokens``: completion tokens at most (>= 1). ``temperature``: 0 is greedy,
    else at least :data:`MIN_TEMPERATURE`.
    ``top_k`` / ``top_p``: optional filters (``None`` = off). ``stop_ids``: token ids that
    end the completion (kept as its last token); ``None`` leaves the choice to whoever
    owns the tokenizer: a source with one uses its end-of-sequence id, and an engine uses
    its model's end-of-sequence ids, as vLLM and SGLang do; ``()`` never stops early.

    Checks that need the model (ids inside the vocabulary, prompt plus ``max_tokens``
    within the context) are the engine's, at ``submit``.
    """

    max_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    stop_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        max_tokens = as_int(self.max_tokens, "max_tokens")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        t = self.temperature
        if not is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if 0 < t < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {t!r}: below it "
                "the scaled logits overflow"
            )
        top_k = self.top_k
        if top_k is not None:
            top_k = as_int(top_k, "top_k")
            if top_k < 1:
                raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
        top_p = self.top_p
        if top_p is not None and (not is_real(top_p) or not 0.0 < top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")
        stop_ids = self.stop_ids
        if stop_ids is not None:
            if isinstance(stop_ids, (str, bytes)) or not hasattr(stop_ids, "__iter__"):
                raise ValueError(f"stop_ids must be token ids or None, got {stop_ids!r}")
            stop_ids = tuple(as_int(s, "stop_ids") for s in stop_ids)
            if any(s < 0 for s in stop_ids):
                raise ValueError(f"stop_ids must be token ids >= 0, got {stop_ids}")
        # Normalized forms: plain Python numbers, so equal settings compare equal.
        object.__setattr__(self, "max_tokens", max_tokens)
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_k", top_k)
        object.__setattr__(self, "top_p", None if top_p is None else float(top_p))
        object.__setattr__(self, "stop_ids", stop_ids)


def scored_temperature(temperature: float) -> float:
    """The temperature a completion's log-probs are reported under, for a request sampled
    at ``temperature``: itself, or 1.0 for greedy decoding (0).

    Greedy decoding samples from no tempered distribution (dividing the logits by 0
    defines none): its tokens come from the point mass on the argmax, so each token's
    log-prob is 0.0 and the call is reported under temperature 1.0, the raw logits.
    ``Call.temperature`` must be positive, and every engine reports greedy calls so.
    """
    return temperature or 1.0


class Aborted(Exception):
    """A request was stopped before it finished (its ``stop`` event, or ``abort``).

    ``tokens`` is how many completion tokens had been generated; ``iteration`` the engine
    iteration that dropped the request (-1 when it never reached the engine).
    """

    def __init__(self, message: str, *, tokens: int = 0, iteration: int = -1) -> None:
        super().__init__(message)
        self.tokens = tokens
        self.iteration = iteration


class EngineError(Exception):
    """This request was lost to an infrastructure fault; the rollout may run again.

    Sources record it as ``INFRA_ERROR`` (so the scheduler resubmits the sample), unlike
    a ``RuntimeError`` from a closed engine, which no retry can fix.
    """


@runtime_checkable
class Engine(Protocol):
    """What sources need of an engine (see the module docstring for the rules)."""

    @property
    def version(self) -> int:
        """The weights version served now."""
        ...

    def submit(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        stop: threading.Event | None = None,
        affinity: Hashable | None = None,
    ) -> Future[Call]:
        """Queue a completion of ``prompt``; returns its future at once."""
        ...

    def abort(self, future: Future[Call]) -> None:
        """Ask the engine to drop the request behind ``future``; returns at once."""
        ...

    def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        stop: threading.Event | None = None,
        affinity: Hashable | None = None,
    ) -> Call:
        """Block until the completion of ``prompt`` is done; raises what the future holds."""
        return self.submit(prompt, params, stop=stop, affinity=affinity).result()


@runtime_checkable
class Publisher(Protocol):
    """Serves the trainer's weights to the engines under a version number."""

    def load(self, variables: Variables, version: int) -> None: ...
