"""Scoring packed rows with a Hugging Face causal LM.

A packed row holds several chains back to back (see ``pack``). Scoring it in one
forward pass is only equivalent to scoring each chain alone when

* attention stays inside a chain: a query attends to keys of its own segment at or
  before itself (a block-diagonal causal mask built from ``segments``);
* rotary positions restart with each chain (``position_ids`` come from ``positions``).

Padding (segment 0) attends to itself only. A padding query with no allowed key
would make SDPA's softmax divide zero by zero and produce NaN, which then poisons
gradients even where the result is masked out; the diagonal keeps it finite.

The mask is handed to the model already in 4-D form, which transformers passes to the
attention kernel unchanged. The two kernels that accept an explicit dense mask want
different encodings (SDPA: boolean, True = attend; eager: additive float, added to
the scores), so the encoding is picked from a registry keyed by the model's
``config._attn_implementation``. Flash/flex kernels take no dense mask and are
refused with a clear error rather than silently attending across chains.

Log-probabilities follow the packed-batch convention: entry ``t`` is the log-prob of
``tokens[t]`` given the chain's earlier tokens, so it is read from the logits at
``t - 1``. Chain starts and padding get 0. With a ``support`` set at ``t`` the
softmax is renormalized over that set (the filtered distribution the sampler drew
from); without one it runs over the whole vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from dew._attention import ATTENTION_MASKS, additive_mask, boolean_mask
from dew.objectives.rl._chain_layout import Bucket, Costs, chain_buckets, find_chains

__all__ = [
    "ATTENTION_MASKS",
    "LAYOUTS",
    "additive_mask",
    "boolean_mask",
    "chain_attention",
    "chain_continues",
    "packed_forward_log_probs",
    "support_log_normalizer",
    "token_log_probs",
]

_REQUIRED = ("tokens", "positions", "segments")
# The trimmed forward's width is a multiple of this, so a run sees a few dozen shapes
# rather than one per step (a compiled or cached kernel is keyed by shape).
_COLUMNS = 16


def chain_attention(segments: torch.Tensor) -> torch.Tensor:
    """Which key each query may attend to: same chain and not in the future.

    ``segments`` [rows, width] int (0 = padding) -> [rows, 1, width, width] bool.
    Padding attends to itself alone (never an all-False row).
    """
    width = segments.shape[-1]
    idx = torch.arange(width, device=segments.device)
    causal = idx[None, :] <= idx[:, None]  # [width(q), width(k)]
    same = segments[:, :, None] == segments[:, None, :]  # [rows, q, k]
    real = (segments > 0)[:, :, None]  # [rows, q, 1]
    diagonal = torch.eye(width, dtype=torch.bool, device=segments.device)  # [q, k]
    allowed = (same & real & causal) | diagonal  # [rows, q, k]
    return allowed[:, None]  # [rows, 1, q, k]


def chain_continues(segments: torch.Tensor) -> torch.Tensor:
    """Positions whose token has a predecessor in its chain (the ones that get a log-prob).

    [rows, width] int -> [rows, width] bool; False at column 0, chain starts and padding.
    """
    cont = torch.zeros_like(segments, dtype=torch.bool)  # [rows, width]
    cont[:, 1:] = (segments[:, 1:] > 0) & (segments[:, 1:] == segments[:, :-1])
    return cont


def support_log_normalizer(
    logits: torch.Tensor,
    support: torch.Tensor,
    offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logsumexp of each token's predicting logits over its support set.

    ``logits`` [rows, width, vocab]: row ``t`` already holds the logits that predict
    token ``t`` (shifted by the caller). ``support`` [rows, capacity] token ids (-1 =
    unused); ``offsets`` [rows, width + 1]: token ``t``'s ids are
    ``support[r, offsets[r, t]:offsets[r, t + 1]]``.
    Returns (normalizer [rows, width] float, has_support [rows, width] bool); the
    normalizer is 0 where a token has no support entry.
    """
    rows, width, vocab = logits.shape
    capacity = support.shape[1]
    device = logits.device
    slot = torch.arange(capacity, device=device).expand(rows, capacity)  # [rows, capacity]
    # owner[r, k] = t with offsets[r, t] <= k < offsets[r, t + 1]
    owner = torch.searchsorted(offsets.contiguous(), slot.contiguous(), right=True) - 1
    used = (slot < offsets[:, -1:]) & (support >= 0) & (owner >= 0) & (owner < width)
    row = torch.arange(rows, device=device)[:, None].expand(rows, capacity)  # [rows, capacity]
    group = (row * width + owner.clamp(0, width - 1))[used]  # [n] flat (row, token) index
    ids = support[used]  # [n]
    if ids.numel() and (int(ids.max()) >= vocab):
        raise ValueError(
            f"support holds token id {int(ids.max())} outside the vocabulary ({vocab})"
        )
    values = logits.reshape(rows * width, vocab)[group, ids]  # [n]
    # max per group, for a stable logsumexp; constant w.r.t. the gradient
    peak = torch.full((rows * width,), -torch.inf, dtype=values.dtype, device=device)
    peak = peak.scatter_reduce(0, group, values.detach(), reduce="amax", include_self=True)
    has = torch.isfinite(peak)  # [rows * width]
    peak = torch.where(has, peak, torch.zeros_like(peak))
    total = torch.zeros(rows * width, dtype=values.dtype, device=device)
    total = total.index_add(0, group, torch.exp(values - peak[group]))  # [rows * width]
    safe = torch.where(has, total, torch.ones_like(total))
    normalizer = torch.where(has, torch.log(safe) + peak, torch.zeros_like(peak))
    return normalizer.view(rows, width), has.view(rows, width)


def token_log_probs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    segments: torch.Tensor,
    *,
    temperature: float = 1.0,
    support: torch.Tensor | None = None,
    support_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-prob of each packed token under the model's logits.

    ``logits`` [rows, width, vocab] (position ``t`` predicts ``t + 1``), ``tokens`` and
    ``segments`` [rows, width]. Returns [rows, width] float32: ``log p(tokens[t] |
    chain before t)`` at ``temperature``, renormalized over the support where given;
    0 at chain starts and padding.
    """
    rows, width, _ = logits.shape
    out = torch.zeros(rows, width, dtype=torch.float32, device=logits.device)
    if width < 2:
        return out
    pred = logits[:, :-1].float()  # [rows, width - 1, vocab]: predicts tokens[:, 1:]
    if temperature != 1.0:
        pred = pred / temperature
    target = tokens[:, 1:]  # [rows, width - 1]
    picked = pred.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # [rows, width - 1]
    normalizer = torch.logsumexp(pred, dim=-1)  # [rows, width - 1]
    if support is not None:
        if support_offsets is None:
            raise ValueError("support given without support_offsets")
        # column j of the shifted logits predicts token j + 1, whose support starts at
        # offsets[j + 1]; entries of token 0 (no predecessor) fall before column 0 and drop
        sub, has = support_log_normalizer(pred, support, support_offsets[:, 1:])
        normalizer = torch.where(has, sub, normalizer)
    cont = chain_continues(segments)[:, 1:]  # [rows, width - 1]
    out[:, 1:] = torch.where(cont, picked - normalizer, torch.zeros_like(picked))
    return out


def _as_tensor(
    value: np.ndarray | torch.Tensor, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype)
    return torch.from_numpy(np.ascontiguousarray(value)).to(device=device, dtype=dtype)


def _check_shapes(batch: Mapping[str, np.ndarray | torch.Tensor]) -> tuple[int, int]:
    for key in _REQUIRED:
        if key not in batch:
            raise ValueError(f"batch is missing {key!r}; packed_log_probs needs {list(_REQUIRED)}")
    shape = tuple(batch["tokens"].shape)
    if len(shape) != 2:
        raise ValueError(f"batch['tokens'] must be [rows, width], got shape {shape}")
    rows, width = shape
    for key in _REQUIRED[1:]:
        if tuple(batch[key].shape) != shape:
            raise ValueError(
                f"batch[{key!r}] has shape {tuple(batch[key].shape)}, expected {shape}"
            )
    if "support" in batch:
        if "support_offsets" not in batch:
            raise ValueError("batch has 'support' but no 'support_offsets'")
        sup = tuple(batch["support"].shape)
        if len(sup) != 2 or sup[0] != rows:
            raise ValueError(f"batch['support'] must be [rows={rows}, capacity], got shape {sup}")
        off = tuple(batch["support_offsets"].shape)
        if off != (rows, width + 1):
            raise ValueError(
                f"batch['support_offsets'] has shape {off}, expected (rows, width + 1) = "
                f"{(rows, width + 1)}"
            )
    return rows, width


# How packed_forward_log_probs lays the chains out for the model (see _chain_layout):
# "auto" picks the cheaper under the cost model; "rows" and "chains" force one.
LAYOUTS = ("auto", "rows", "chains")
# "auto" leaves the one packed forward only for buckets the cost model finds at least
# this much cheaper: the model is rough, and near a tie one call is the safer bet.
_SAVING = 0.9


def _numpy(value: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _sharded(param: torch.Tensor) -> bool:
    """A parameter of a model laid out on a device mesh (FSDP2, tensor parallel)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support
        return False
    return isinstance(param, DTensor)


def _chain_plan(
    model: torch.nn.Module,
    segments: np.ndarray,
    positions: np.ndarray,
    layout: str,
) -> tuple[np.ndarray, np.ndarray, list[Bucket]] | None:
    """The chains of the trimmed ``segments`` [kept, used] and their buckets, or None
    for the packed rows."""
    costs = Costs.of(getattr(model, "config", None))
    chains = find_chains(segments, positions)
    if costs is None or chains is None:
        return None
    starts, lengths = chains
    buckets, cost = chain_buckets(lengths, costs)
    kept, used = segments.shape
    if layout == "auto" and cost > _SAVING * costs.block(kept, used):
        return None
    return starts, lengths, buckets


def _chains_log_probs(
    model: torch.nn.Module,
    plan: tuple[np.ndarray, np.ndarray, list[Bucket]],
    tokens: torch.Tensor,
    segments: torch.Tensor,
    *,
    temperature: float,
    support: torch.Tensor | None,
    offsets: torch.Tensor | None,
) -> torch.Tensor:
    """[kept, used] log-probs with each chain scored alone in its bucket's rows.

    ``tokens`` [kept, used] (padding already 0), ``segments`` [kept, used]. A bucket's
    rows are right-padded chains with positions 0.. and no mask: causal attention keeps
    every real token off the padding after it. Without support sets, each bucket's
    log-probs are taken in its own layout and scattered back; with them, the logits are
    scattered back into the packed layout, whose support offsets they then index.
    """
    starts, lengths, buckets = plan
    kept, used = tokens.shape
    device = tokens.device
    flat_tokens = tokens.reshape(-1)
    slots, values = [], []
    for bucket in buckets:
        n, span = len(bucket.chains), bucket.width
        step = np.arange(span)
        valid_np = step[None, :] < lengths[bucket.chains][:, None]  # [n, span]
        index_np = np.where(valid_np, starts[bucket.chains][:, None] + step[None, :], 0)
        index = torch.from_numpy(index_np).to(device)  # [n, span] flat slots
        valid = torch.from_numpy(valid_np).to(device)  # [n, span]
        ids = torch.where(valid, flat_tokens[index], torch.zeros_like(index))  # [n, span]
        position_ids = torch.arange(span, device=device).expand(n, span)
        logits = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
        slots.append(index[valid])  # [real tokens of the bucket]
        if support is None:
            logp = token_log_probs(logits, ids, valid.long(), temperature=temperature)
            values.append(logp[valid])  # [n, span] -> [real]
        else:
            values.append(logits[valid])  # [real, vocab]
    slot = torch.cat(slots)
    if support is None:
        flat = torch.zeros(kept * used, dtype=torch.float32, device=device)
        return flat.index_copy(0, slot, torch.cat(values)).view(kept, used)
    vocab = values[0].shape[-1]
    flat = torch.zeros(kept * used, vocab, dtype=values[0].dtype, device=device)
    logits = flat.index_copy(0, slot, torch.cat(values)).view(kept, used, vocab)
    return token_log_probs(
        logits, tokens, segments, temperature=temperature, support=support, support_offsets=offsets
    )


def packed_forward_log_probs(
    model: torch.nn.Module,
    batch: Mapping[str, np.ndarray | torch.Tensor],
    *,
    temperature: float = 1.0,
    layout: str = "auto",
) -> torch.Tensor:
    """The model's log-probs of the packed tokens -> [rows, width] float32.

    The forward covers only the rows that hold a token and the columns up to the last
    one any row uses (rounded up to ``_COLUMNS``): a fixed-shape batch of short chains
    is mostly padding, and padding changes no real token's result (attention never
    leaves a chain), so the trimmed forward gives the same log-probs at a fraction of
    the cost. The result keeps the batch's shape, with 0 where nothing was computed.

    ``layout``: ``"rows"`` runs one forward over the packed rows with a block-diagonal
    mask; ``"chains"`` runs each chain alone, in buckets of similar length (one forward
    each, no mask; see :mod:`._chain_layout`); ``"auto"`` (the default) takes whichever
    the cost model finds cheaper. A model sharded on a device mesh always takes the
    rows: every process must make the same forward calls.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {list(LAYOUTS)}")
    rows, width = _check_shapes(batch)
    param = next(model.parameters())
    device = param.device
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    encode = ATTENTION_MASKS.get(str(impl))
    if encode is None:
        raise ValueError(
            f"model attn_implementation={impl!r} cannot take a packed block-diagonal mask; "
            f"use one of {sorted(ATTENTION_MASKS)}"
        )
    segments = _as_tensor(batch["segments"], device, torch.long)  # [rows, width]
    real = segments > 0
    columns = real.any(dim=0).nonzero()  # [used columns, 1]
    if len(columns):
        used = min(width, -(-(int(columns.max()) + 1) // _COLUMNS) * _COLUMNS)
        keep = real.any(dim=1).nonzero().squeeze(1)  # [kept rows]
    else:  # nothing to score, but the forward still runs, over one row: a sharded
        # model's collectives need every process in it, and the loss needs a graph
        used, keep = min(width, _COLUMNS), torch.zeros(1, dtype=torch.long, device=device)
    whole = len(keep) == rows and used == width

    def cut(key: str) -> torch.Tensor:
        value = _as_tensor(batch[key], device, torch.long)  # [rows, width]
        return value if whole else value[keep, :used]

    tokens, positions = cut("tokens"), cut("positions")  # [kept, used]
    if not whole:
        segments, real = segments[keep, :used], real[keep, :used]
    # padding may carry any id/position; make them harmless for the embedding and rotary
    tokens_in = torch.where(real, tokens, torch.zeros_like(tokens))
    support = offsets = None
    if "support" in batch:
        support = _as_tensor(batch["support"], device, torch.long)  # [rows, capacity]
        offsets = _as_tensor(batch["support_offsets"], device, torch.long)  # [rows, width + 1]
        if not whole:  # token t's ids sit between offsets t and t + 1: keep used + 1 of them
            support, offsets = support[keep], offsets[keep, : used + 1]
    plan = None
    if layout != "rows" and len(columns) and not _sharded(param):
        picked = keep.cpu().numpy()
        plan = _chain_plan(
            model,
            _numpy(batch["segments"])[picked, :used],
            _numpy(batch["positions"])[picked, :used],
            layout,
        )
    if plan is not None:
        logp = _chains_log_probs(
            model,
            plan,
            tokens_in,
            segments,
            temperature=temperature,
            support=support,
            offsets=offsets,
        )  # [kept, used]
    else:
        positions_in = torch.where(real, positions, torch.zeros_like(positions))
        dtype = getattr(model, "dtype", param.dtype)
        mask = encode(chain_attention(segments), dtype)  # [kept, 1, used, used]
        logits = model(
            input_ids=tokens_in, attention_mask=mask, position_ids=positions_in, use_cache=False
        ).logits  # [kept, used, vocab]
        logp = token_log_probs(
            logits,
            tokens_in,
            segments,
            temperature=temperature,
            support=support,
            support_offsets=offsets,
        )  # [kept, used]
    if whole:
        return logp
    out = torch.zeros(rows, width, dtype=logp.dtype, device=device)
    return out.index_copy(0, keep, torch.nn.functional.pad(logp, (0, width - used)))
