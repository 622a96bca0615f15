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
    # Every array is [rows, width]: millions of slots a call, so each pass over one
    # counts, and counts are taken with count_nonzero rather than by summing masks.
    out: dict[str, float] = {}
    mask = np.asarray(batch["loss_mask"]) > 0
    versions = np.asarray(batch["versions"])
    trained = np.count_nonzero(mask)
    out["trained_tokens"] = float(trained)
    # Share of completion tokens that carry no loss (masked truncations).
    completion = np.asarray(batch["completion_mask"])
    completion = completion.copy() if completion.dtype == bool else completion > 0
    completion &= np.asarray(batch["segments"]) > 0
    completion &= versions >= 0
    tokens = np.count_nonzero(completion)
    masked = tokens - np.count_nonzero(completion & mask)
    out["masked_share"] = float(masked / max(tokens, 1))
    if updates is not None and trained:
        # The lag's sum and minimum, summed and taken where the mask is rather than over
        # a gathered copy; the mean is the exact integer sum over the count, as before.
        total = int(np.add.reduce(versions, axis=None, where=mask, dtype=np.int64))
        newest_lag = updates - int(
            np.minimum.reduce(versions, axis=None, where=mask, initial=_INT_MAX)
        )
        out["token_lag_mean"] = float((updates * trained - total) / trained)
        out["token_lag_max"] = float(newest_lag)
    return out


_INT_MAX = np.iinfo(np.int64).max
