"""Summary figures of one trainer call's admitted rollouts and their packed batch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from dew.core import Rollout, Status
from dew.objectives.rl.chains import merge_ratio

__all__ = ["session_metrics"]

_BATCH_KEYS = frozenset({"loss_mask", "segments", "versions", "completion_mask"})


def _percentiles(values: Sequence[float], prefix: str, out: dict[str, float]) -> None:
    if not values:
        return
    arr = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    out[f"{prefix}_p50"] = float(p50)
    out[f"{prefix}_p90"] = float(p90)
    out[f"{prefix}_p99"] = float(p99)
    out[f"{prefix}_max"] = float(arr.max())


def session_metrics(
    rollouts: Sequence[Rollout],
    batch: Mapping[str, np.ndarray] | None = None,
    *,
    updates: int | None = None,
) -> dict[str, float]:
    """Summary figures over admitted rollouts and, when given, their packed batch.

    Keys: ``merge_ratio``; ``status/<name>`` shares; ``reward/mean`` and
    ``reward/<component>``; ``latency_p50|p90|p99|max`` (submission to finish,
    seconds); from the batch: ``masked_share`` (share of real tokens not trained),
    ``token_lag_mean|max`` (``updates - version`` over trained tokens, when
    ``updates`` is given) and ``trained_tokens``.
    """
    out: dict[str, float] = {}
    n = len(rollouts)
    if n == 0:
        return out
    out["merge_ratio"] = merge_ratio(rollouts)
    statuses = [r.status for r in rollouts]
    for status in Status:
        out[f"status/{status.value}"] = statuses.count(status) / n
    rewards = [r.reward for r in rollouts if r.reward is not None]
    if rewards:
        out["reward/mean"] = float(np.mean(rewards))
    names = sorted({k for r in rollouts if r.components for k in r.components})
    for name in names:
        vals = [r.components[name] for r in rollouts if name in r.components]
        out[f"reward/{name}"] = float(np.mean(vals))
    lat = [
        r.finished - r.submitted
        for r in rollouts
        if r.finished is not None and r.submitted is not None
    ]
    _percentiles(lat, "latency", out)
    out["completion_tokens_mean"] = float(np.mean([r.completion_tokens for r in rollouts]))
    if batch is not None:
        missing = sorted(_BATCH_KEYS - set(batch))
        if missing:
            raise ValueError(f"batch lacks {missing}; session_metrics reads a batch made by pack")
        out.update(_batch_metrics(batch, updates))
    return out


def _batch_metrics(batch: Mapping[str, np.ndarray], updates: int | None) -> dict[str, float]:
    loss = np.asarray(batch["loss_mask"])
    segments = np.asarray(batch["segments"])
    versions = np.asarray(batch["versions"])
    completion = np.asarray(batch["completion_mask"])
    # Millions of slots a call, read by several passes each: taken a slice of slots at a
    # time so that every pass after the first finds its slice in cache. (Arrays of other
    # shapes, which pack never makes, are taken whole: numpy broadcasts them as before.)
    shape = loss.shape
    if segments.shape == versions.shape == completion.shape == shape:
        loss, segments, versions, completion = (
            x.reshape(-1) for x in (loss, segments, versions, completion)
        )
        step = _SLICE
    else:
        step = loss.size or 1
    trained = tokens = masked = lag_sum = 0
    oldest = _INT_MAX  # the smallest version among trained tokens
    for at in range(0, loss.size, step) if loss.size else ():
        end = at + step
        mask = loss[at:end] > 0
        v = versions[at:end]
        c = completion[at:end]
        c = c.copy() if c.dtype == bool else c > 0
        c &= segments[at:end] > 0
        c &= v >= 0  # completion tokens: real, with a version
        k = np.count_nonzero(mask)
        trained += k
        tokens += np.count_nonzero(c)
        masked += np.count_nonzero(c & ~mask)
        if updates is not None and k:
            # Summed and taken where the mask is, not over a gathered copy; the mean is
            # the exact integer sum over the count.
            lag_sum += int(np.add.reduce(v, axis=None, where=mask, dtype=np.int64))
            low = int(np.minimum.reduce(v, axis=None, where=mask, initial=_INT_MAX))
            oldest = min(oldest, low)
    out: dict[str, float] = {"trained_tokens": float(trained)}
    # Share of completion tokens that carry no loss (masked truncations).
    out["masked_share"] = float(masked / max(tokens, 1))
    if updates is not None and trained:
        out["token_lag_mean"] = float((updates * trained - lag_sum) / trained)
        out["token_lag_max"] = float(updates - oldest)
    return out


_SLICE = 1 << 17  # slots per slice: a few MB over the four arrays
_INT_MAX = np.iinfo(np.int64).max
