"""What the serving engine keeps per request and per weight load, and how it checks them.

Everything here runs in the *caller's* thread before anything reaches the engine: a bad
argument raises ``ValueError`` naming the parameter and the rule, and the engine never
sees it. The records themselves are then owned by the engine thread until it resolves
them: a request through its ``future``, a load through ``done`` and ``error``.
"""

from __future__ import annotations

import math
import numbers
import operator
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from dew.objectives.rl.sessions import Call

__all__ = ["Load", "Request", "as_int", "check_weights", "make_request", "prefill_groups"]

# Prefill groups are bounded so the [k, 1, T, T] mask and the activations stay small.
_PREFILL_TOKENS = 16384
_PREFILL_MASK = 1 << 26


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
    future: Future[Call] = field(default_factory=Future)

    @property
    def stopped(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    @property
    def cached(self) -> int:
        # Tokens whose keys/values are in the slot: all but the last sampled one.
        return len(self.prompt) + len(self.completion) - 1


@dataclass(eq=False)
class Load:
    """One ``load`` call: the tensors to copy (one per storage) and the new version."""

    state: Mapping[str, torch.Tensor]
    version: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def as_int(value: object, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None


def _check_ids(ids: list[int], name: str, vocab: int) -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise ValueError(f"{name}[{i}] = {t} is outside the vocabulary [0, {vocab})")


def _real(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def make_request(
    prompt: Sequence[int],
    *,
    max_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    stop_ids: Collection[int],
    stop: threading.Event | None,
    vocab: int,
    max_len: int,
) -> Request:
    """Validate one request's arguments and build its record."""
    items = prompt.tolist() if hasattr(prompt, "tolist") else prompt
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise ValueError(f"prompt must be a sequence of token ids, got {type(prompt).__name__}")
    ids = [as_int(t, f"prompt[{i}]") for i, t in enumerate(items)]
    if not ids:
        raise ValueError("prompt is empty; it needs at least one token id")
    _check_ids(ids, "prompt", vocab)
    max_tokens = as_int(max_tokens, "max_tokens")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if len(ids) + max_tokens > max_len:
        raise ValueError(
            f"len(prompt) + max_tokens = {len(ids)} + {max_tokens} exceeds max_len={max_len}"
        )
    if not _real(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None:
        top_k = as_int(top_k, "top_k")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    if top_p is not None and (not _real(top_p) or not 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")
    stops = [as_int(t, "stop_ids") for t in stop_ids]
    _check_ids(stops, "stop_ids", vocab)
    if stop is not None and not isinstance(stop, threading.Event):
        raise ValueError(f"stop must be a threading.Event or None, got {type(stop).__name__}")
    temperature = float(temperature)
    filtered = (top_k is not None and top_k < vocab) or (top_p is not None and top_p < 1.0)
    return Request(
        prompt=ids,
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=None if top_p is None else float(top_p),
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


def prefill_groups(
    requests: Sequence[Request], length: Callable[[Request], int]
) -> list[list[Request]]:
    """Split requests into prefill groups, longest first, so padding stays under half
    of each group's tokens and the group's mask stays bounded."""
    out: list[list[Request]] = []
    group: list[Request] = []
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
