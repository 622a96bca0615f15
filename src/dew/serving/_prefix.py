"""Prefix sharing at admission: which prompt tokens the engine must compute, and which
it can copy from keys/values it already holds.

Two sources of reuse, both exact (a token's keys/values depend only on the tokens up to
it and on its position, which is its column, so a copy is what a recompute would give):

* *Identical prompts admitted together* (the G samples of a GRPO group): the first one
  (the *leader*) is computed; every later one (a *follower*) gets the leader's columns
  copied into its own slot after the forward and samples its first token from the
  leader's last-position logits, independently of the others.
* *A resident prefix*: a prompt that equals, or extends, the prompt of a request that is
  active right now (a late sample of a group, or the next turn of a multi-turn episode
  whose sibling is still decoding) gets that request's prompt columns copied into its
  slot, and only the rest of its prompt is computed. An equal prompt computes nothing
  when the active request still holds its prompt's last-position logits (kept from its
  admission until the next load); otherwise its last token is computed for them.

Only prompts of *active* requests are matched (their slots hold keys/values computed
under the current weights: the engine recomputes them right after a load, before any
admission), never anything kept from finished requests, so a load can never leave a
stale prefix behind. Partial overlaps (two prompts that share a system prompt and then
differ) are not matched: only whole active prompts are looked up as prefixes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dew.serving._kv import ModelCall, SlotCache
from dew.serving._requests import Request

__all__ = ["Row", "forward_extend", "plan_admission"]


@dataclass(eq=False)
class Row:
    """One prefill row: ``request``'s prompt from column ``start`` on is computed; columns
    ``0 .. start-1`` are first copied from ``source``'s slot (an active request). When
    ``start`` is the whole prompt, nothing is computed: the logits are ``source``'s."""

    request: Request
    start: int = 0
    source: Request | None = None
    followers: list[Request] = field(default_factory=list)  # identical prompts, copied after

    @property
    def new(self) -> int:
        """Tokens this row runs through the model."""
        return len(self.request.prompt) - self.start


def plan_admission(joiners: Sequence[Request], active: Sequence[Request]) -> list[Row]:
    """Rows to prefill for ``joiners`` (in arrival order of their leaders), with their
    followers attached and their longest resident prefix among ``active``'s prompts."""
    rows: dict[tuple[int, ...], Row] = {}
    for r in joiners:
        key = tuple(r.prompt)
        row = rows.get(key)
        if row is None:
            rows[key] = Row(r)
        else:
            row.followers.append(r)
    if not active:
        return list(rows.values())
    # Active prompts by length, so a joiner looks up each possible prefix length once.
    by_len: dict[int, dict[tuple[int, ...], Request]] = {}
    firsts: set[int] = set()
    for r in active:
        by_len.setdefault(len(r.prompt), {}).setdefault(tuple(r.prompt), r)
        firsts.add(r.prompt[0])
    lengths = sorted(by_len, reverse=True)
    for key, row in rows.items():
        if key[0] not in firsts:
            continue
        for n in lengths:
            if n > len(key):
                continue
            source = by_len[n].get(key[:n])
            if source is not None:
                whole = n == len(key) and source.prompt_logits is not None
                row.start = n if whole else min(n, len(key) - 1)
                row.source = source if row.start > 0 else None
                break
    return list(rows.values())


def forward_extend(call: ModelCall, cache: SlotCache, rows: list[Row], first: int) -> torch.Tensor:
    """Run each row's prompt from its ``start`` on (left-padded; ``rows`` longest first)
    through the model into slots ``first ..``, over the prefix columns those slots
    already hold; returns the last position's logits [k, V]."""
    device = cache.device
    news = [r.request.prompt[r.start :] for r in rows]
    width = len(news[0])
    span = max(len(r.request.prompt) for r in rows)
    lens = torch.tensor([len(t) for t in news], device=device)  # [k]
    starts = torch.tensor([r.start for r in rows], device=device)  # [k]
    ids = torch.tensor([[0] * (width - len(t)) + t for t in news], device=device)  # [k, T]
    col = torch.arange(width, device=device)  # [T]
    # Padded queries get position 0 or a copied one: they only see finite columns.
    positions = (starts.unsqueeze(1) + col - (width - lens).unsqueeze(1)).clamp(min=0)
    key = torch.arange(span, device=device)  # [S]
    allowed = key <= positions.unsqueeze(2)  # [k, T, S] key column <= query position
    cache.set_extend(first, [r.start for r in rows], [len(t) for t in news], width, span)
    return call.prefill(ids, positions, lens, allowed.unsqueeze(1), cache)
