"""Chains: a rollout's calls merged into the token sequences the trainer trains on.

Call ``k`` joins the current chain when its prompt starts with the chain's tokens so far
(earlier prompts and completions); the prompt's extra tokens (observations, tool
results, the next user turn) join the chain untrained. Otherwise it opens a new chain.
The comparison is token-exact: nothing is re-tokenized. :func:`chain_runs` gives each
chain as its runs (one per call stretch), which is what :mod:`dew.objectives.rl.pack`
writes; :func:`chains` joins them into arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from dew.core import Call, Rollout

__all__ = ["Chain", "Run", "chain_runs", "chains", "join_runs", "merge_ratio", "trained_mask"]


@dataclass(frozen=True, eq=False)
class Chain:
    """A token sequence trained as one causal sequence.

    ``tokens`` [n]; ``trained`` [n] bool (completion tokens); ``log_probs`` [n] the
    behavior log-prob of each trained token (0 elsewhere); ``versions`` [n] the
    version of the call that produced or consumed each token; ``support`` holds, for
    each trained token in order, its support row (empty when the calls carry none).
    """

    tokens: np.ndarray
    trained: np.ndarray
    log_probs: np.ndarray
    versions: np.ndarray
    support: tuple[Sequence[int], ...]


class Run(NamedTuple):
    """A stretch of one chain that came from one call, as one piece.

    ``tokens`` [n] int64; ``trained`` says whether they are completion tokens (then
    ``log_probs`` [n] holds their behavior log-probs and ``support`` their support
    rows, when the call carries any) or prompt tokens the call consumed (then both
    are None); ``version`` is the call's weights version.
    """

    tokens: np.ndarray
    trained: bool
    log_probs: np.ndarray | None
    version: int
    support: Sequence[Sequence[int]] | None


def _as_i64(x: Sequence[int]) -> np.ndarray:
    return np.asarray(x, dtype=np.int64).reshape(-1)


def chain_runs(calls: Sequence[Call]) -> list[list[Run]]:
    """Merge a rollout's calls into chains, each given as its runs in token order.

    Call k extends the current chain when its prompt starts with the chain's tokens
    so far; the prompt's extra tokens (observations, tool results, the next user
    turn) join the chain as an untrained run. Otherwise it opens a new chain.
    Comparison is token-exact: nothing is re-tokenized. Runs, not joined arrays, so
    that ``pack`` can write many chains with one concatenation per field.
    """
    if len(calls) == 1:  # the single-turn case, without the merge bookkeeping
        call = calls[0]
        lp = np.asarray(call.log_probs, dtype=np.float64).reshape(-1)
        return [
            [
                Run(_as_i64(call.prompt), False, None, call.version, None),
                Run(_as_i64(call.completion), True, lp, call.version, call.support),
            ]
        ]
    out: list[list[Run]] = []
    runs: list[Run] = []
    current: np.ndarray | None = None  # the open chain's tokens so far
    for call in calls:
        prompt = _as_i64(call.prompt)
        completion = _as_i64(call.completion)
        n = len(current) if current is not None else 0
        if current is not None and len(prompt) >= n and np.array_equal(prompt[:n], current):
            extra = prompt[n:]
        else:
            if runs:
                out.append(runs)
            runs, extra, current = [], prompt, np.empty(0, dtype=np.int64)
        if len(extra):
            runs.append(Run(extra, False, None, call.version, None))
        lp = np.asarray(call.log_probs, dtype=np.float64).reshape(-1)
        runs.append(Run(completion, True, lp, call.version, call.support))
        current = np.concatenate([current, extra, completion])
    if runs:
        out.append(runs)
    return out


def trained_mask(runs: Sequence[Run]) -> np.ndarray:
    """[n] bool over a chain's tokens: True on completion tokens."""
    return np.repeat(np.array([r.trained for r in runs], dtype=bool), [len(r.tokens) for r in runs])


def join_runs(runs: Sequence[Run]) -> Chain:
    """The :class:`Chain` made of ``runs`` (as :func:`chain_runs` gives them)."""
    lengths = [len(r.tokens) for r in runs]
    flags = trained_mask(runs)  # [n]
    log_probs = np.zeros(len(flags))  # [n]
    trained_lp = [r.log_probs for r in runs if r.log_probs is not None]
    if trained_lp:
        log_probs[flags] = np.concatenate(trained_lp)
    support: list[Sequence[int]] = []
    for r in runs:
        if r.support is not None:
            support.extend(r.support)
    return Chain(
        np.concatenate([r.tokens for r in runs]),
        flags,
        log_probs,
        np.repeat(np.asarray([r.version for r in runs], dtype=np.int64), lengths),
        tuple(support),
    )


def chains(calls: Sequence[Call]) -> list[Chain]:
    """Merge a rollout's calls into chains (see :func:`chain_runs` for the rule)."""
    return [join_runs(runs) for runs in chain_runs(calls)]


def merge_ratio(rollouts: Sequence[Rollout]) -> float:
    """Merged calls over calls after each rollout's first (1.0 when nothing to merge)."""
    later = merged = 0
    for r in rollouts:
        if len(r.calls) > 1:
            later += len(r.calls) - 1
            merged += len(r.calls) - len(chains(r.calls))
    return merged / later if later else 1.0
