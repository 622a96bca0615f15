"""Batched next-token sampling with per-row settings and exact behavior log-probs.

Every row of a decode batch may belong to a different request, so temperature, top-k
and top-p are per-row tensors. The log-probability returned for a row is that of the
drawn token under the distribution the draw actually came from: logits divided by the
row's temperature, restricted to the row's top-k / top-p set and renormalized. For a
filtered row the ids that set contains (its *support*) are returned too, so a trainer
can renormalize over the same set.

Greedy rows (temperature 0) take the argmax of the raw logits, like ``model.generate``
with ``do_sample=False``. Their distribution is the point mass on that token, so the
log-prob is 0.0 and the support is the token itself.

Filter order follows Hugging Face's logits processors: temperature, then top-k, then
top-p over what top-k kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dew.core import scored_temperature

__all__ = ["Draw", "RowSettings", "sample", "settings"]


@dataclass(frozen=True)
class RowSettings:
    """Per-row sampling settings of one batch (all tensors are ``[n]`` on the logits' device).

    ``temperature`` is > 0 on sampled rows and ignored on greedy rows; ``top_k`` is 0
    where the row does not filter by rank; ``top_p`` is 1.0 where it does not filter by
    mass. ``filtered`` and ``greedy`` are Python-side summaries used to pick fast paths.
    """

    temperature: torch.Tensor  # [n] float32
    top_k: torch.Tensor  # [n] int64, 0 = off
    top_p: torch.Tensor  # [n] float32, 1.0 = off
    greedy: torch.Tensor  # [n] bool
    filtered: torch.Tensor  # [n] bool: row uses top-k or top-p
    any_greedy: bool
    any_filtered: bool


@dataclass(frozen=True)
class Draw:
    """What :func:`sample` drew: ``tokens`` [n] and ``log_probs`` [n] (CPU), and for
    rows that filter (or are greedy) the ids the sampler could have drawn."""

    tokens: list[int]
    log_probs: list[float]
    support: list[list[int] | None]
    # Rows set aside, not drawn: their logits were not finite (the model's doing), or
    # their logits were but not once divided by the row's temperature (the request's).
    broken: list[int] = field(default_factory=list)
    overflowed: list[int] = field(default_factory=list)


def settings(
    temperature: list[float],
    top_k: list[int | None],
    top_p: list[float | None],
    vocab: int,
    device: torch.device,
) -> RowSettings:
    """Build :class:`RowSettings` from per-request values (``None`` = not set)."""
    greedy = [t == 0.0 for t in temperature]
    k = [0 if (x is None or x >= vocab) else int(x) for x in top_k]
    p = [1.0 if (x is None or x >= 1.0) else float(x) for x in top_p]
    filtered = [(ki > 0 or pi < 1.0) and not g for ki, pi, g in zip(k, p, greedy, strict=True)]
    return RowSettings(
        temperature=torch.tensor([scored_temperature(t) for t in temperature], device=device),
        top_k=torch.tensor(k, dtype=torch.int64, device=device),
        top_p=torch.tensor(p, dtype=torch.float32, device=device),
        greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
        filtered=torch.tensor(filtered, dtype=torch.bool, device=device),
        any_greedy=any(greedy),
        any_filtered=any(filtered),
    )


def _filter_sorted(
    sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Which sorted positions survive top-k then top-p. Returns keep mask [m, V].

    The kept set is always a prefix of the descending order and never empty.
    """
    vocab = sorted_logits.shape[1]
    rank = torch.arange(vocab, device=sorted_logits.device).unsqueeze(0)  # [1, V]
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)  # [m, 1]
    keep = rank < k  # [m, V]
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)  # [m, V]
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each rank
    # Only rows with top_p < 1 cut by mass. At 1.0 (off) ``before < 1.0`` would still drop
    # a kept rank whose preceding mass rounds to 1.0 in float32 (a token of probability
    # below ~6e-8 after a dominant one), shrinking a top-k set below k.
    keep &= (before < top_p.unsqueeze(1)) | (top_p >= 1.0).unsqueeze(1)
    keep[:, 0] = True
    return keep


def sample(logits: torch.Tensor, rows: RowSettings, generator: torch.Generator) -> Draw:
    """Draw one token per row of ``logits`` [n, V] (any float dtype)."""
    logits = logits.float()
    n = logits.shape[0]
    scaled = logits / rows.temperature.unsqueeze(1)  # [n, V]
    # A row with a value that is not finite would fail the whole batch's draw: it is
    # drawn from zeros instead and named (``broken`` or ``overflowed``), so that its
    # request alone fails. A row's sum is finite iff its values are (or they are so
    # large that sampling them means nothing anyway): one cheap pass in the usual case.
    unusable = ~torch.isfinite(scaled.sum(dim=1))  # [n]
    broken: list[int] = []
    overflowed: list[int] = []
    if bool(unusable.any()):
        model_fault = unusable & ~torch.isfinite(logits.sum(dim=1))  # [n]
        broken = model_fault.nonzero().squeeze(1).tolist()
        overflowed = (unusable & ~model_fault).nonzero().squeeze(1).tolist()
        scaled = scaled.masked_fill(unusable.unsqueeze(1), 0.0)
        logits = logits.masked_fill(unusable.unsqueeze(1), 0.0)
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    log_probs = torch.zeros(n, dtype=torch.float32, device=logits.device)
    support: list[list[int] | None] = [None] * n

    if not (rows.any_greedy or rows.any_filtered):  # common case: plain sampling, no gathers
        logp = torch.log_softmax(scaled, dim=-1)  # [n, V]
        drawn = torch.multinomial(logp.exp(), 1, generator=generator)  # [n, 1]
        return Draw(
            tokens=drawn.squeeze(1).tolist(),
            log_probs=logp.gather(1, drawn).squeeze(1).tolist(),
            support=support,
            broken=broken,
            overflowed=overflowed,
        )

    plain = ~(rows.greedy | rows.filtered)  # [n]
    if bool(plain.any()):
        idx = plain.nonzero().squeeze(1)
        logp = torch.log_softmax(scaled[idx], dim=-1)  # [m, V]
        drawn = torch.multinomial(logp.exp(), 1, generator=generator)  # [m, 1]
        tokens[idx] = drawn.squeeze(1)
        log_probs[idx] = logp.gather(1, drawn).squeeze(1)

    filtered: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # fidx, order, counts
    if rows.any_filtered:
        fidx = rows.filtered.nonzero().squeeze(1)
        sorted_logits, order = torch.sort(scaled[fidx], dim=-1, descending=True)  # [m, V]
        keep = _filter_sorted(sorted_logits, rows.top_k[fidx], rows.top_p[fidx])
        logp = torch.log_softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
        drawn = torch.multinomial(logp.exp(), 1, generator=generator)  # [m, 1] sorted positions
        tokens[fidx] = order.gather(1, drawn).squeeze(1)
        log_probs[fidx] = logp.gather(1, drawn).squeeze(1)
        filtered = (fidx, order, keep.sum(dim=1))  # [m], [m, V], [m]

    if rows.any_greedy:
        gidx = rows.greedy.nonzero().squeeze(1)
        tokens[gidx] = logits[gidx].argmax(dim=-1)
        # log_probs stay 0.0: the greedy distribution is the point mass on the argmax.

    token_list = tokens.tolist()
    if rows.any_greedy:
        for i in rows.greedy.nonzero().squeeze(1).tolist():
            support[i] = [token_list[i]]
    if filtered is not None:
        fidx, order, counts = filtered
        order_cpu = order.cpu()
        for j, (i, c) in enumerate(zip(fidx.tolist(), counts.tolist(), strict=True)):
            support[i] = order_cpu[j, :c].tolist()
    return Draw(token_list, log_probs.tolist(), support, broken=broken, overflowed=overflowed)
