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

* *A kept prefix*: a finished request's slot (its prompt and completion) is copied
  into a slot of its own and kept, indexed by the request's affinity (a source's group
  id), so the next turn of that multi-turn session, whose prompt extends it, computes
  only its new tokens (the completion's last token and the observation), and a late
  sample of a group whose siblings all finished copies its prompt from one of them.

Only slots computed under the weights being served are matched: active requests are
recomputed right after a load, before any admission, and every kept prefix is dropped
at a load, so a load can never leave a stale prefix behind. Under the engine's
``on_load="keep"`` both outlive a load; a prefix computed under older weights then
serves only a *continuation* (a prompt that extends a kept run past its end: the next
turn of that session, which is as old as its own earlier turns anyway), never a new
start of the same prompt. Were a retried attempt to copy its prompt from an old
sibling, it would inherit that sibling's age, be discarded as stale again, and be
retried the same way for as long as the old slot lives. Partial overlaps (two
prompts that share a system prompt and then differ) are not matched: only whole active
prompts, and kept token runs that are a prefix of the prompt or that the prompt is a
prefix of, are looked up.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from dew.serving._kv import ModelCall, SlotCache
from dew.serving._requests import Request

__all__ = ["Kept", "KeptPrefixes", "Row", "forward_extend", "keep_finished", "plan_admission"]


@dataclass(eq=False)
class Kept:
    """A finished request's keys/values, held in cache slot ``slot``: the columns of
    ``tokens`` (its prompt and all but the last completion token), computed under
    weights no older than ``version``."""

    tokens: list[int]
    slot: int
    affinity: Hashable
    version: int


class KeptPrefixes:
    """Which finished requests' slots are kept, and where (bookkeeping only: the engine
    moves the keys/values). Slots ``first .. first + size - 1`` of the cache are theirs;
    the least recently kept or used entry makes room for a new one, except entries
    pinned by the admission in progress (which are about to be copied from), and an
    entry a newer one of its affinity extends is dropped (on :meth:`release` if pinned)."""

    def __init__(self, first: int, size: int) -> None:
        self.size = size
        self._free = list(range(first + size - 1, first - 1, -1))  # pop() takes the lowest
        self._lru: OrderedDict[Kept, None] = OrderedDict()  # oldest first
        self._by_affinity: dict[Hashable, list[Kept]] = {}
        self._pins: dict[Kept, int] = {}  # entry -> rows of the admission still to copy it
        self._superseded: set[Kept] = set()  # pinned when a later call extended them

    def __len__(self) -> int:
        return len(self._lru)

    def add(self, tokens: list[int], affinity: Hashable, version: int) -> Kept | None:
        """A slot for ``tokens`` (the caller copies them in), or None when every kept
        slot is pinned. Entries of the same affinity that ``tokens`` extends are dropped:
        the session has moved past them."""
        for old in [e for e in self._by_affinity.get(affinity, ()) if _starts(tokens, e.tokens)]:
            if old in self._pins:  # still to be copied from: dropped once it is
                self._superseded.add(old)
            else:
                self._drop(old)
        if not self._free:
            victim = next((e for e in self._lru if e not in self._pins), None)
            if victim is None:
                return None
            self._drop(victim)
        entry = Kept(tokens, self._free.pop(), affinity, version)
        self._lru[entry] = None
        self._by_affinity.setdefault(affinity, []).append(entry)
        return entry

    def match(
        self, prompt: list[int], affinity: Hashable, version: int | None = None
    ) -> tuple[Kept, int] | None:
        """The kept entry of ``affinity`` sharing the longest run with ``prompt`` (it is
        a prefix of the prompt, or the prompt a prefix of it) and that run's length; the
        newest on a tie. With ``version`` (the weights being served), an entry computed
        under older weights counts only when the prompt extends it past its end."""
        best: tuple[Kept, int] | None = None
        for entry in self._by_affinity.get(affinity, ()):
            n = len(entry.tokens)
            if n < len(prompt):
                shared = n if prompt[:n] == entry.tokens else 0
            elif version is not None and entry.version < version:
                continue  # an old entry starts nothing new (see the module docstring)
            else:
                shared = len(prompt) if entry.tokens[: len(prompt)] == prompt else 0
            if shared and (best is None or (shared, entry.version) > (best[1], best[0].version)):
                best = (entry, shared)
        if best is not None:
            self._lru.move_to_end(best[0])
        return best

    def pin(self, entry: Kept) -> None:
        """One more row of the admission in progress will copy from ``entry``."""
        self._pins[entry] = self._pins.get(entry, 0) + 1

    def unpin(self, entry: Kept) -> None:
        """A row has copied from ``entry``."""
        left = self._pins.get(entry, 0) - 1
        if left > 0:
            self._pins[entry] = left
            return
        self._pins.pop(entry, None)
        if entry in self._superseded:
            self._superseded.discard(entry)
            if entry in self._lru:
                self._drop(entry)

    def release(self) -> None:
        """End of an admission: unpin whatever is still pinned (rows that never got to
        copy, as when a step failed)."""
        for entry in list(self._pins):
            self._pins[entry] = 1
            self.unpin(entry)

    def clear(self) -> None:
        """Forget every entry (a load, or buffers whose contents are unknown)."""
        for entry in list(self._lru):
            self._drop(entry)
        self._pins.clear()
        self._superseded.clear()

    def _drop(self, entry: Kept) -> None:
        del self._lru[entry]
        same = self._by_affinity[entry.affinity]
        same.remove(entry)
        if not same:
            del self._by_affinity[entry.affinity]
        self._free.append(entry.slot)
        self._free.sort(reverse=True)


def keep_finished(
    kept: KeptPrefixes,
    cache: SlotCache,
    finished: Sequence[Request],
    active: Sequence[Request],
    served: int | None,
) -> None:
    """Copy the slots of ``finished`` requests (still in ``active``, whose index is the
    slot) into kept slots, stamped ``served`` or, when None, each request's own version."""
    slot = {id(r): i for i, r in enumerate(active)}
    src, dst, width = [], [], 0
    for r in finished:
        if r.affinity is None or r.cached < 1:
            continue
        version = r.version if served is None else served
        entry = kept.add(r.prompt + r.completion[:-1], r.affinity, version)
        if entry is None:
            continue
        src.append(slot[id(r)])
        dst.append(entry.slot)
        width = max(width, r.cached)
    if src:
        cache.reserve(max(dst) + 1, width)
        cache.move(src, dst, width)


def _starts(tokens: list[int], prefix: list[int]) -> bool:
    return len(prefix) <= len(tokens) and tokens[: len(prefix)] == prefix


@dataclass(eq=False)
class Row:
    """One prefill row: ``request``'s prompt from column ``start`` on is computed; columns
    ``0 .. start-1`` are first copied from ``source``'s slot (an active request or a kept
    prefix). When ``start`` is the whole prompt, nothing is computed: the logits are
    ``source``'s (an active request's; a kept prefix keeps no logits)."""

    request: Request
    start: int = 0
    source: Request | Kept | None = None
    followers: list[Request] = field(default_factory=list)  # identical prompts, copied after

    @property
    def new(self) -> int:
        """Tokens this row runs through the model."""
        return len(self.request.prompt) - self.start


def plan_admission(
    joiners: Sequence[Request],
    active: Sequence[Request],
    kept: KeptPrefixes | None = None,
    affinity: Sequence[Hashable] = (),
    version: int | None = None,
) -> list[Row]:
    """Rows to prefill for ``joiners`` (in arrival order of their leaders), with their
    followers attached and their longest resident prefix among ``active``'s prompts and,
    for joiners with an affinity (``affinity[i]`` of ``joiners[i]``, None for none),
    the ``kept`` prefixes; a kept prefix chosen is pinned until the row has copied it.
    ``version``: the weights being served; an active request that is older (it went on
    across a load) lends no prompt, and an older kept prefix serves continuations only
    (None: every slot holds keys/values of the weights being served)."""
    rows: dict[tuple[int, ...], Row] = {}
    groups: dict[tuple[int, ...], Hashable] = {}
    for i, r in enumerate(joiners):
        key = tuple(r.prompt)
        row = rows.get(key)
        if row is None:
            rows[key] = Row(r)
            groups[key] = affinity[i] if i < len(affinity) else None
        else:
            row.followers.append(r)
    if active:
        # Active prompts by length, so a joiner looks up each possible prefix length once.
        by_len: dict[int, dict[tuple[int, ...], Request]] = {}
        firsts: set[int] = set()
        for r in active:
            if version is not None and r.version < version:
                continue  # its prompt's keys/values are of older weights
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
    if kept is not None and len(kept):
        for key, row in rows.items():
            group = groups[key]
            if group is None:
                continue
            found = kept.match(row.request.prompt, group, version)
            if found is None:
                continue
            entry, shared = found
            start = min(shared, len(key) - 1)  # a kept prefix has no logits: compute one
            if start > row.start:
                row.start, row.source = start, entry
                kept.pin(entry)
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
