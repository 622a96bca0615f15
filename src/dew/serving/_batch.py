"""The engine thread's batch: the active requests, their key/value slots, kept prefixes.

:class:`RolloutServer` owns the threads, the queues and the weights;
:class:`ActiveBatch` is what its engine thread drives between two queue visits:
admitting requests (with shared prefixes, :mod:`dew.serving._prefix`), one decode step
for every active request, sampling, finishing, and recomputing after a weight load.

Invariants (the server's module docstring states the ones a caller sees):

* Only the engine thread calls into an ``ActiveBatch``; it owns no thread and takes no
  lock. ``active[i]`` holds slot ``i`` of the cache; slots ``max_batch`` and up hold the
  kept prefixes.
* A request leaves ``active`` (and lets go of its prompt logits) before its future is
  resolved, so a done-callback already sees the tables clean.
* ``served`` counts the prompt tokens of every admitted request, ``computed`` those the
  model ran at admission; the rest were copied.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet

import torch

from dew.core import Call, scored_temperature
from dew.serving._kv import ModelCall, SlotCache, forward_decode, forward_prefill
from dew.serving._prefix import (
    Kept,
    KeptPrefixes,
    Row,
    forward_extend,
    keep_finished,
    plan_admission,
)
from dew.serving._requests import Request, prefill_groups
from dew.serving._sampling import RowSettings, sample, settings

__all__ = ["ActiveBatch"]


class ActiveBatch:
    """The active requests (index = slot) of one engine and everything they compute with.

    ``recompute``: a load recomputes the active requests' keys/values and drops the kept
    prefixes (``on_load="recompute"``), so every slot holds keys/values of the served
    weights; otherwise they stay and each request's version is the oldest weights behind
    them. ``share``: identical and extending prompts copy each other's keys/values.
    """

    def __init__(
        self,
        call: ModelCall,
        cache: SlotCache,
        kept: KeptPrefixes | None,
        generator: torch.Generator,
        vocab: int,
        device: torch.device,
        *,
        recompute: bool,
        share: bool,
    ) -> None:
        self.active: list[Request] = []
        self.kept = kept
        self.served = 0  # prompt tokens admitted
        self.computed = 0  # ... and those of them run through the model
        self._call = call
        self._cache = cache
        self._generator = generator
        self._vocab = vocab
        self._device = device
        self._recompute = recompute
        self._share = share
        self._rows: RowSettings | None = None  # the sampling settings of ``active``

    def before_load(self, *, restart: bool = False) -> None:
        """Forget what the weights being replaced computed and would serve no one
        (``restart``: a new version sequence, where a kept prefix's version no longer
        tells whether older weights computed it, so none is kept)."""
        for r in self.active:
            r.prompt_logits = None
        if self.kept is not None and (self._recompute or restart):
            self.kept.clear()

    def after_load(self, version: int) -> None:
        """The active requests now go on under ``version`` too: their oldest weights."""
        for r in self.active:
            r.version = min(r.version, version)

    def recompute_after_load(self) -> bool:
        """Whether the active requests' keys/values must be recomputed after a load."""
        return self._recompute and bool(self.active)

    def clear(self) -> list[Request]:
        """Empty the batch and forget every slot's keys/values (after a failed step their
        contents are unknown); returns the requests that were active."""
        active, self.active = self.active, []
        self._rows = None
        self._cache.clear()
        if self.kept is not None:
            self.kept.clear()
        return active

    def remove(self, leaving: AbstractSet[Request]) -> None:
        """Take ``leaving`` out of the active table, filling holes from the end."""
        if not leaving:
            return
        active = self.active
        keep = len(active) - sum(r in leaving for r in active)
        holes = [i for i in range(keep) if active[i] in leaving]
        movers = [i for i in range(keep, len(active)) if active[i] not in leaving]
        if movers:
            width = max(active[i].cached for i in movers) + 1
            self._cache.move(movers, holes, width)
        for h, m in zip(holes, movers, strict=True):
            active[h] = active[m]
        del active[keep:]
        self._rows = None
        for r in leaving:
            r.prompt_logits = None

    def prefill(self, joiners: list[Request], version: int) -> None:
        """Admit ``joiners`` under the weights ``version``: compute each distinct prompt
        once (from its resident prefix on, see :mod:`dew.serving._prefix`), copy it to its
        identical followers, and sample every joiner's first token."""
        if not self._share:
            plan = [Row(r) for r in joiners]
        else:
            groups = [r.affinity for r in joiners]
            # Recomputing at a load leaves no keys/values of older weights to guard
            # against (a request's version still names the weights of its first tokens).
            served = None if self._recompute else version
            plan = plan_admission(joiners, self.active, self.kept, groups, served)
        try:
            copied = [row for row in plan if row.start == len(row.request.prompt)]
            if copied:  # resident identical prompts: nothing to compute
                self._admit(copied, None, version)
            computed = [row for row in plan if row.start < len(row.request.prompt)]
            for group in prefill_groups(computed, lambda row: row.new):
                self._admit(group, group, version)
        finally:
            if self.kept is not None:  # what the plan copies from is copied by now
                self.kept.release()

    def refill(self) -> None:
        """Recompute every active request's keys/values under the weights just loaded, so
        each later token is drawn from the new weights alone."""
        slot = {id(r): i for i, r in enumerate(self.active)}
        for group in prefill_groups(self.active, lambda r: r.cached):
            forward_prefill(
                self._call,
                self._cache,
                [r.prompt + r.completion[:-1] for r in group],
                [slot[id(r)] for r in group],
            )

    def decode(self, version: int) -> None:
        """One decode step for every active request, under the weights ``version``."""
        active = list(self.active)
        cols = [r.cached for r in active]
        logits = forward_decode(self._call, self._cache, [r.completion[-1] for r in active], cols)
        self._take(active, logits, self._row_settings(), version)

    # ------------------------------------------------------------------ internals

    def _row_settings(self) -> RowSettings:
        if self._rows is None:
            self._rows = self._settings(self.active)
        return self._rows

    def _settings(self, requests: Sequence[Request]) -> RowSettings:
        return settings(
            [r.temperature for r in requests],
            [r.top_k for r in requests],
            [r.top_p for r in requests],
            self._vocab,
            self._device,
        )

    def _take(
        self, requests: Sequence[Request], logits: torch.Tensor, rows: RowSettings, version: int
    ) -> None:
        """Sample one token for each of ``requests`` from ``logits`` [n, V]; finish the
        requests that are done."""
        draw = sample(logits, rows, self._generator)
        failed: dict[Request, Exception] = {
            **{requests[i]: _overflowed(requests[i]) for i in draw.overflowed},
            **{requests[i]: _broken(requests[i]) for i in draw.broken},
        }
        finished: dict[Request, Call] = {}
        for r, tok, lp, sup in zip(
            requests, draw.tokens, draw.log_probs, draw.support, strict=True
        ):
            if r in failed:
                continue
            r.completion.append(tok)
            r.log_probs.append(lp)
            if r.keeps_support:
                assert sup is not None
                r.support.append(sup)
            if tok in r.stop_ids:
                r.finish_reason = "stop"
            elif len(r.completion) >= r.max_tokens:
                r.finish_reason = "length"
            else:
                continue
            finished[r] = Call(
                prompt=r.prompt,
                completion=r.completion,
                log_probs=r.log_probs,
                version=r.version,
                temperature=scored_temperature(r.temperature),
                support=r.support if r.keeps_support else None,
                finish_reason=r.finish_reason,
            )
        if finished and self.kept is not None:
            # the oldest weights behind their keys/values: the served ones, unless kept
            served = version if self._recompute else None
            keep_finished(self.kept, self._cache, list(finished), self.active, served)
        self.remove(finished.keys() | failed.keys())
        for r, call in finished.items():
            r.future.set_result(call)
        for r, error in failed.items():  # these alone: the others of the batch drew as usual
            r.future.set_exception(error)

    def _admit(self, rows: list[Row], forward: list[Row] | None, version: int) -> None:
        """Put ``rows`` and their followers in the next slots, copy their resident
        prefixes in, run ``forward`` (the rows themselves, or None when every row is a
        whole copy) and sample each member's first token."""
        first = len(self.active)
        members = [row.request for row in rows]
        source_of = list(range(len(rows)))  # member -> the row whose logits it draws from
        for i, row in enumerate(rows):
            members += row.followers
            source_of += [i] * len(row.followers)
        span = max(len(r.prompt) for r in members)
        self._cache.reserve(first + len(members), span)
        copies = [(row.source, first + i, row.start) for i, row in enumerate(rows)]
        copies = [c for c in copies if c[0] is not None]
        if copies:  # resident and kept prefixes into the new slots, before the forward
            slot = {id(r): i for i, r in enumerate(self.active)}
            self._cache.move(
                [c[0].slot if isinstance(c[0], Kept) else slot[id(c[0])] for c in copies],
                [c[1] for c in copies],
                max(c[2] for c in copies),
            )
            if self.kept is not None:
                for c in copies:
                    if isinstance(c[0], Kept):
                        self.kept.unpin(c[0])
        if forward is None:
            # whole copies come from active requests only (a kept prefix has no logits)
            held = [row.source.prompt_logits for row in rows if isinstance(row.source, Request)]
            logits = torch.stack([t for t in held if t is not None])  # [len(rows), V]
            assert len(logits) == len(rows)
        else:
            logits = forward_extend(self._call, self._cache, forward, first)  # [len(rows), V]
            self.computed += sum(row.new for row in rows)
        if self._share:
            for row, row_logits in zip(rows, logits, strict=True):
                row.request.prompt_logits = row_logits
        if len(members) > len(rows):  # identical prompts: copy the leader's columns
            self._cache.move(
                [first + i for i in source_of[len(rows) :]],
                list(range(first + len(rows), first + len(members))),
                span,
            )
            logits = logits[torch.tensor(source_of, device=self._device)]  # [m, V]
        self.served += sum(len(r.prompt) for r in members)
        for i, r in enumerate(members):
            source = rows[source_of[i]].source
            if source is None or self._recompute:
                r.version = version
            else:  # a prefix copied from keys/values of older weights ages the call
                r.version = min(version, source.version)
        self.active.extend(members)
        self._rows = None
        self._take(members, logits, self._settings(members), version)


def _overflowed(r: Request) -> ValueError:
    """The request's own doing: finite logits, not finite over its temperature."""
    return ValueError(
        f"the logits over temperature {r.temperature} were not finite at completion token "
        f"{len(r.completion)}; the request was dropped"
    )


def _broken(r: Request) -> RuntimeError:
    """The model's doing: logits that were not finite (its weights, or this input)."""
    return RuntimeError(
        f"model step failed: the logits were not finite at completion token "
        f"{len(r.completion)}; the request was dropped"
    )
