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
  slot before the forward, and only the rest of its prompt is computed. At least one
  token is always computed, since its logits are needed for the first draw.

Only prompts of *active* requests are matched (their slots hold keys/values computed
under the current weights: the engine recomputes them right after a load, before any
admission), never anything kept from finished requests, so a load can never leave a
stale prefix behind. Partial overlaps (two prompts that share a system prompt and then
differ) are not matched: only whole active prompts are looked up as prefixes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dew.serving._requests import Request

__all__ = ["Row", "plan_admission"]


@dataclass(eq=False)
class Row:
    """One prefill row: ``request``'s prompt from column ``start`` on is computed; columns
    ``0 .. start-1`` are first copied from ``source``'s slot (an active request)."""

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
                row.start = min(n, len(key) - 1)  # at least one token to compute
                row.source = source if row.start > 0 else None
                break
    return list(rows.values())
