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
    for status in Status:
        out[f"status/{status.value}"] = sum(r.status is status for r in rollouts) / n
    rewards = [r.reward for r in rollouts if r.reward is not None]
    if rewards:
        out["reward/mean"] = float(np.mean(rewards))
    names = sorted({k for r in rollouts for k in r.components})
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
        mask = np.asarray(batch["loss_mask"]) > 0
        real = np.asarray(batch["segments"]) > 0
        versions = np.asarray(batch["versions"])
        out["trained_tokens"] = float(mask.sum())
        # Share of completion tokens that carry no loss (masked truncations).
        completion = real & (versions >= 0) & (np.asarray(batch["completion_mask"]) > 0)
        out["masked_share"] = float((completion & ~mask).sum() / max(completion.sum(), 1))
        if updates is not None and mask.any():
            lag = updates - versions[mask]
            out["token_lag_mean"] = float(lag.mean())
            out["token_lag_max"] = float(lag.max())
    return out
