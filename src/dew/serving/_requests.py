"""What the serving engine keeps per request and per weight load, and how it checks them.

Everything here runs in the *caller's* thread before anything reaches the engine: a bad
argument raises ``ValueError`` naming the parameter and the rule, and the engine never
sees it. The records themselves are then owned by the engine thread until it resolves
them: a request through its ``future``, a load through ``done`` and ``error``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from dew.core import Call, SamplingParams, as_int

__all__ = [
    "CallFuture",
    "Load",
    "Request",
    "check_weights",
    "make_request",
    "prefill_groups",
]

# Prefill groups are bounded so the [k, 1, T, T] mask and the activations stay small.
_PREFILL_TOKENS = 16384
_PREFILL_MASK = 1 << 26

R = TypeVar("R")


class CallFuture(Future[Call]):
    """The future ``submit`` returns; ``abort`` marks it, and the engine drops its request
    at the next iteration boundary.

    Waiting on it from the engine thread itself (a done-callback calling ``generate``)
    would wait forever, so it raises ``RuntimeError`` instead.
    """

    aborted = False
    engine_thread: threading.Thread | None = None

    def result(self, timeout: float | None = None) -> Call:
        if not self.done() and threading.current_thread() is self.engine_thread:
            raise RuntimeError(
                "a RolloutServer request was waited on from the engine thread (a submit "
                "future's done-callback, e.g. through generate()); it would wait forever. "
                "Use submit() there."
            )
        return super().result(timeout)


@dataclass(eq=False)
class Request:
    """One ``submit`` (or ``generate``) call: its settings, what has been sampled, and
    the future that reports how it ended."""

    prompt: list[int]
    max_tokens: int
    temperature: float  # 0 = greedy
    top_k: int | None
    top_p: float | None
    stop_ids: frozenset[int]
    stop: threading.Event | None
    keeps_support: bool  # filtered or greedy: each token records its support
    completion: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    support: list[list[int]] = field(default_factory=list)
    version: int = -1
    finish_reason: str | None = None
    future: CallFuture = field(default_factory=CallFuture)
    # Engine thread only: the prompt's last-position logits [V] while the request is
    # active and the weights that computed them are served (prefix sharing reuses them).
    prompt_logits: torch.Tensor | None = None
    affinity: Hashable | None = None  # the caller's routing hint: where its prefix is kept

    @property
    def stopped(self) -> bool:
        return self.future.aborted or (self.stop is not None and self.stop.is_set())

    @property
    def cached(self) -> int:
        # Tokens whose keys/values are in the slot: all but the last sampled one.
        return len(self.prompt) + len(self.completion) - 1


@dataclass(eq=False)
class Load:
    """One ``load`` call: the tensors to copy (one per storage) and the new version."""

    state: Mapping[str, torch.Tensor]
    version: int
    restart: bool = False  # a new version sequence: kept prefixes are forgotten
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def _check_ids(ids: list[int], name: str, vocab: int) -> None:
    if not ids or (min(ids) >= 0 and max(ids) < vocab):  # the usual case, without a loop
        return
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise ValueError(f"{name}[{i}] = {t} is outside the vocabulary [0, {vocab})")


def make_request(
    prompt: Sequence[int],
    params: SamplingParams,
    stop: threading.Event | None,
    *,
    vocab: int,
    max_len: int,
    eos: Sequence[int],
) -> Request:
    """Check one request against the served model and build its record.

    ``params`` were checked when they were made; what is left needs the model: ids in
    the vocabulary, the length within ``max_len``. ``params.stop_ids=None`` stops at
    ``eos``, the model's end-of-sequence ids.
    """
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
    items = prompt.tolist() if hasattr(prompt, "tolist") else prompt
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise ValueError(f"prompt must be a sequence of token ids, got {type(prompt).__name__}")
    ids = list(items)
    if not all(type(t) is int for t in ids):  # numpy ints, or an entry to name
        ids = [as_int(t, f"prompt[{i}]") for i, t in enumerate(ids)]
    if not ids:
        raise ValueError("prompt is empty; it needs at least one token id")
    _check_ids(ids, "prompt", vocab)
    max_tokens = params.max_tokens
    if len(ids) + max_tokens > max_len:
        raise ValueError(
            f"len(prompt) + max_tokens = {len(ids)} + {max_tokens} exceeds max_len={max_len}"
        )
    stops = list(eos if params.stop_ids is None else params.stop_ids)
    _check_ids(stops, "stop_ids", vocab)
    if stop is not None and not isinstance(stop, threading.Event):
        raise ValueError(f"stop must be a threading.Event or None, got {type(stop).__name__}")
    top_k, top_p, temperature = params.top_k, params.top_p, params.temperature
    filtered = (top_k is not None and top_k < vocab) or (top_p is not None and top_p < 1.0)
    return Request(
        prompt=ids,
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        stop_ids=frozenset(stops),
        stop=stop,
        keeps_support=temperature == 0.0 or filtered,
    )


def check_weights(
    targets: Mapping[str, torch.Tensor], variables: torch.nn.Module | Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Match ``variables`` to the served model's tensors; returns name -> source tensor
    with one name per storage.

    Names that share storage in the served model (tied embeddings) may be given once:
    a checkpoint saved without the duplicate loads as well.
    """
    state = variables.state_dict() if isinstance(variables, torch.nn.Module) else variables
    if not isinstance(state, Mapping):
        raise ValueError(
            f"variables must be an nn.Module or a mapping of tensors, "
            f"got {type(variables).__name__}"
        )
    groups: dict[int, list[str]] = {}
    for name, t in targets.items():
        groups.setdefault(t.data_ptr(), []).append(name)
    unexpected = sorted(set(state) - set(targets))
    missing = [names[0] for names in groups.values() if not any(n in state for n in names)]
    if missing or unexpected:
        raise ValueError(
            f"variables do not match the served model: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
            f"{'...' if len(unexpected) > 5 else ''}"
        )
    out: dict[str, torch.Tensor] = {}
    for names in groups.values():
        for name in names:
            if name not in state:
                continue
            got, want = state[name], targets[name]
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                raise ValueError(
                    f"variables[{name!r}] has shape {shape}, expected {tuple(want.shape)}"
                )
            out.setdefault(names[0], got)
    return out


def prefill_groups(requests: Sequence[R], length: Callable[[R], int]) -> list[list[R]]:
    """Split requests (or prefill rows) into prefill groups, longest first, so padding
    stays under half of each group's tokens and the group's mask stays bounded."""
    out: list[list[R]] = []
    group: list[R] = []
    width = real = 0
    for r in sorted(requests, key=length, reverse=True):
        n = length(r)
        if group:
            size = len(group) + 1
            if (
                size * width > 2 * (real + n)
                or size * width > _PREFILL_TOKENS
                or size * width * width > _PREFILL_MASK
            ):
                out.append(group)
                group, real = [], 0
        if not group:
            width = n
        group.append(r)
        real += n
    if group:
        out.append(group)
    return out
