"""Where the packed forward runs each chain: in its packed row, or alone in a bucket.

A packed row of width ``W`` costs its attention ``W * W`` query-key cells whatever
chains it holds: the block-diagonal mask keeps a chain from seeing its neighbours, but
the dense kernels still compute (and then discard) every cell. The same chains run
one per row, grouped by length into buckets of width ``L``, cost ``L * L`` cells each
and need no mask at all (plain causal attention: a right-padded chain never attends to
its own padding). On long multi-turn chains that is a third of the attention or less.
What buckets cost instead is padding (a bucket is as wide as its longest chain) and one
model call each.

This module is the plan and nothing else: it reads segments and positions (numpy),
finds the chains, and picks the cheapest layout under a cost model in flops (dense
layers per token, attention per cell, a fixed cost per call) built from the model's
config. It owns no tensors and runs no model; :mod:`._packed_forward` carries the plan
out. Either layout gives the same log-probs, so the cost model decides speed only.

Chains are runs of one nonzero segment id in a row. The chain layout is only offered
when every chain is one contiguous run whose positions count 0, 1, 2, ... (the packed
batch convention); anything else keeps the packed rows, which score it as given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Bucket", "Costs", "chain_buckets", "find_chains"]

# The CPU attention kernel runs at about two thirds of the matmul rate (bench/RESULTS.md,
# "vs trl: heavy-tailed workload: profile"); its cells are weighted up by this much.
_ATTENTION_SLOWDOWN = 1.5
# A model call's fixed cost (Python and per-op dispatch, forward and backward) in flops
# of work: a fixed part and a part per layer, as measured on the CPU host (bench/RESULTS.md,
# "Figures moved out of code comments").
_CALL_FLOPS = 3e7
_LAYER_CALL_FLOPS = 6e7


@dataclass(frozen=True)
class Costs:
    """Flops of one token position, one attention cell and one model call."""

    token: float
    cell: float
    call: float

    @classmethod
    def of(cls, config: Any) -> Costs | None:
        """The cost model of a transformers config (None when it lacks a size)."""
        try:
            hidden = int(config.hidden_size)
            layers = int(config.num_hidden_layers)
            heads = int(config.num_attention_heads)
            kv = int(getattr(config, "num_key_value_heads", None) or heads)
            head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
            inner = int(getattr(config, "intermediate_size", None) or 4 * hidden)
            vocab = int(config.vocab_size)
        except (AttributeError, TypeError, ValueError, ZeroDivisionError):
            return None
        attn = hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2  # q, o; k, v
        token = layers * 2.0 * (attn + 3 * hidden * inner) + 2.0 * hidden * vocab
        cell = layers * 4.0 * heads * head_dim * _ATTENTION_SLOWDOWN  # q.k and p.v
        return cls(token=token, cell=cell, call=_CALL_FLOPS + layers * _LAYER_CALL_FLOPS)

    def block(self, count: int | np.ndarray, width: int | np.ndarray) -> Any:
        """One call over ``count`` rows of ``width`` positions."""
        return self.call + count * width * (self.token + width * self.cell)


@dataclass(frozen=True)
class Bucket:
    """Chains scored together, one per row, right-padded to ``width``."""

    chains: np.ndarray  # [n] indices into find_chains' arrays
    width: int


def find_chains(segments: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, ...] | None:
    """(starts, lengths) of the chains in ``segments`` [rows, width], flat indices.

    ``starts`` [chains] is each chain's first slot in ``segments.ravel()``; ``lengths``
    [chains]. None when a chain is not one run of positions 0, 1, 2, ... (then only the
    packed rows score it as given).
    """
    rows, width = segments.shape
    flat = segments.reshape(-1)
    col = np.tile(np.arange(width), rows)  # [rows * width]
    real = flat > 0
    prev = np.empty_like(flat)
    prev[0] = 0
    prev[1:] = flat[:-1]
    first = real & ((col == 0) | (prev != flat))  # a run of one segment id begins
    starts = np.flatnonzero(first)  # [chains]
    if len(starts) == 0:
        return None
    run = np.cumsum(first) - 1  # [rows * width] run index of each slot (valid where real)
    lengths = np.bincount(run[real], minlength=len(starts))  # [chains]
    # a segment id that appears in two runs of a row is one chain with a gap: not ours
    ids = flat[starts].astype(np.int64) + (starts // width) * (int(flat.max()) + 1)
    if len(np.unique(ids)) != len(starts):
        return None
    # positions must count up from 0 along each run
    offset = np.arange(len(flat)) - starts[np.clip(run, 0, None)]  # [rows * width]
    if not np.array_equal(positions.reshape(-1)[real], offset[real]):
        return None
    return starts, lengths


def chain_buckets(lengths: np.ndarray, costs: Costs) -> tuple[list[Bucket], float]:
    """The cheapest grouping of chains into length buckets, and its cost in flops.

    Buckets cover runs of the chains sorted by length (a bucket of the shortest chains
    never borrows a long one); the grouping minimizes the summed :meth:`Costs.block`
    over the distinct lengths with one pass of dynamic programming.
    """
    order = np.argsort(lengths, kind="stable")
    values, counts = np.unique(lengths[order], return_counts=True)  # [m] ascending
    total = np.concatenate([[0], np.cumsum(counts)])  # [m + 1] chains below each value
    m = len(values)
    best = np.full(m + 1, np.inf)
    best[0] = 0.0
    cut = np.zeros(m + 1, dtype=np.int64)
    for k in range(1, m + 1):
        # a bucket of values i..k-1 is as wide as values[k - 1]
        block = costs.block(total[k] - total[:k], int(values[k - 1]))  # [k]
        options = best[:k] + block
        cut[k] = int(np.argmin(options))
        best[k] = options[cut[k]]
    buckets = []
    k = m
    while k > 0:
        i = int(cut[k])
        buckets.append(Bucket(order[total[i] : total[k]], int(values[k - 1])))
        k = i
    return buckets[::-1], float(best[m])
