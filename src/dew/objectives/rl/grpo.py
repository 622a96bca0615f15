"""The GRPO objective, in its decoupled-PPO form for asynchronous rollouts.

Three policies meet in one update:

* *behavior*: the engine that sampled the tokens (``behavior_log_probs`` from the
  sources; possibly several weight versions old, possibly a different kernel);
* *proximal*: the trainer's weights when the batch was handed over, rescored over the
  packed rows (``proximal_log_probs``, filled by the scheduler with
  :meth:`GRPOObjective.packed_log_probs` under ``torch.no_grad()``);
* *current* (``pi_theta``): the weights being optimized.

The PPO trust region is taken around the proximal policy (ratio ``pi_theta /
pi_proximal``, clipped), and the off-policy gap between behavior and proximal is
corrected by a separate importance weight ``pi_proximal / pi_behavior`` that carries
no gradient (AReaL's decoupled objective). That weight is *truncated* at
``importance_cap`` (``min(w, cap)``), not used to drop tokens: a token the engine
found much less likely than the trainer does still trains, with bounded weight.

Decisions worth knowing:

* Normalization: the summed per-token loss is divided by a constant (default
  ``rows * width``), never by the number of trained tokens, so every process of a
  pool divides by the same number and per-process gradients add up to the pool's.
* ``loss_mask`` is a float weight; a token trains when its mask is > 0. Everything
  read at an untrained token is replaced by a neutral value before use, so garbage
  there (inf advantages, wild log-probs) cannot leak NaN into the gradient.
* ``clip_fraction`` counts tokens whose gradient the clip switched off (the clipped
  branch won the minimum), which is what tells you the trust region is binding.
* ``mismatch_kl`` estimates KL(behavior || proximal) on the trained tokens with the
  k3 estimator ``r - 1 - log r``, ``r = pi_proximal / pi_behavior``: unbiased for
  tokens drawn from the behavior policy, never negative, 0 exactly when they agree.
* Metrics over an empty set of trained tokens are 0 (``trained_tokens`` says so).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from dew.objectives.rl._packed_forward import (
    ATTENTION_MASKS,
    chain_attention,
    packed_forward_log_probs,
    support_log_normalizer,
    token_log_probs,
)

__all__ = [
    "ATTENTION_MASKS",
    "GRPOObjective",
    "behavior_importance",
    "chain_attention",
    "decoupled_ppo_loss",
    "mismatch_kl",
    "reference_kl",
    "support_log_normalizer",
    "token_log_probs",
]

_LOSS_KEYS = ("loss_mask", "advantages", "behavior_log_probs", "proximal_log_probs")


def behavior_importance(proximal: torch.Tensor, behavior: torch.Tensor, cap: float) -> torch.Tensor:
    """``min(exp(proximal - behavior), cap)`` per token; [rows, width] -> [rows, width]."""
    return torch.exp(proximal - behavior).clamp(max=cap)


def mismatch_kl(
    proximal: torch.Tensor, behavior: torch.Tensor, trained: torch.Tensor
) -> torch.Tensor:
    """k3 estimate of KL(behavior || proximal) over ``trained`` tokens -> 0-dim tensor.

    ``proximal``, ``behavior`` [rows, width] log-probs; ``trained`` [rows, width] bool.
    """
    log_r = torch.where(trained, proximal - behavior, torch.zeros_like(proximal))  # [rows, width]
    k3 = torch.exp(log_r) - 1.0 - log_r  # [rows, width], >= 0
    return k3.sum() / trained.sum().clamp(min=1)


def reference_kl(logp: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(current || reference) -> [rows, width], 0 off ``mask``.

    ``logp`` [rows, width] current log-probs (differentiable), ``reference`` [rows,
    width] a frozen model's, ``mask`` [rows, width] float loss mask. ``exp(d) - d - 1``
    with ``d = reference - logp``: never negative, 0 exactly where the two agree, and
    its gradient pulls the current policy toward the reference (DeepSeekMath's GRPO).
    """
    trained = mask > 0
    d = torch.where(trained, reference - logp, torch.zeros_like(logp))  # [rows, width]
    return torch.exp(d) - d - 1.0  # [rows, width]


def decoupled_ppo_loss(
    logp: torch.Tensor,
    proximal: torch.Tensor,
    behavior: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float,
    clip_high: float | None,
    cap: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token decoupled PPO loss (to minimize) and detached metric scalars.

    ``logp`` [rows, width] current log-probs (with grad); ``proximal``, ``behavior``
    [rows, width] log-probs (no grad needed); ``advantages`` [rows, width];
    ``mask`` [rows, width] float weight (> 0 = trained).
    Returns ``per_token`` [rows, width] = ``-mask * w * min(r * A, clip(r) * A)`` with
    ``w = behavior_importance(proximal, behavior, cap)`` (detached), ``r = exp(logp -
    proximal)`` and ``clip(r)`` in ``[1 - clip, 1 + (clip_high or clip)]``; 0 where
    ``mask`` is 0. Metrics: mismatch_kl, importance_mean, importance_max (before the
    cap), importance_capped_fraction, clip_fraction, ratio_mean, trained_tokens.
    """
    high = clip if clip_high is None else clip_high
    mask = mask.to(logp.dtype)
    trained = mask > 0  # [rows, width]
    zero = torch.zeros_like(logp)
    proximal = proximal.detach().to(logp.dtype)
    behavior = behavior.detach().to(logp.dtype)
    adv = torch.where(trained, advantages.to(logp.dtype), zero)  # [rows, width]
    log_w = torch.where(trained, proximal - behavior, zero)  # [rows, width]
    raw_w = torch.exp(log_w)  # [rows, width]
    weight = raw_w.clamp(max=cap)  # [rows, width]
    log_ratio = torch.where(trained, logp - proximal, zero)  # [rows, width], grad via logp
    ratio = torch.exp(log_ratio)  # [rows, width]
    clipped = ratio.clamp(1.0 - clip, 1.0 + high)  # [rows, width]
    surrogate = torch.minimum(ratio * adv, clipped * adv)  # [rows, width]
    per_token = -(mask * weight * surrogate)  # [rows, width]

    with torch.no_grad():
        n = trained.sum()
        denom = n.clamp(min=1).to(logp.dtype)
        r = ratio.detach()
        clip_active = trained & (((adv > 0) & (r > 1.0 + high)) | ((adv < 0) & (r < 1.0 - clip)))
        metrics = {
            "mismatch_kl": mismatch_kl(proximal, behavior, trained),
            "importance_mean": torch.where(trained, raw_w, zero).sum() / denom,
            # amax over an empty batch is an error; the 0 in front covers that case
            "importance_max": torch.cat([zero.new_zeros(1), raw_w[trained]]).max(),
            "importance_capped_fraction": (trained & (raw_w > cap)).sum() / denom,
            "clip_fraction": clip_active.sum() / denom,
            "ratio_mean": torch.where(trained, r, zero).sum() / denom,
            "trained_tokens": n.to(logp.dtype),
        }
    return per_token, metrics


def _positive(name: str, value: float) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


class GRPOObjective:
    """Decoupled-PPO GRPO loss over packed batches, and the packed scorer it relies on.

    ``clip`` bounds the ratio from below (``1 - clip``) and, unless ``clip_high`` is
    given, from above (``1 + clip``); ``clip_high`` alone widens the upper side
    (asymmetric, "clip-higher"). ``importance_cap`` truncates the behavior weight.
    ``temperature`` must be the sampling temperature, so trainer log-probs describe
    the same distribution the engine drew from. ``kl_coef`` (0: off) adds that many
    times :func:`reference_kl` against the frozen ``reference`` model to every trained
    token's loss (metric ``kl_reference``: its mean over trained tokens).
    """

    def __init__(
        self,
        *,
        clip: float = 0.2,
        clip_high: float | None = None,
        importance_cap: float = 2.0,
        temperature: float = 1.0,
        kl_coef: float = 0.0,
        reference: torch.nn.Module | None = None,
    ) -> None:
        self.clip = _positive("clip", clip)
        self.clip_high = None if clip_high is None else _positive("clip_high", clip_high)
        cap_ok = isinstance(importance_cap, (int, float)) and math.isfinite(importance_cap)
        if not (cap_ok and importance_cap >= 1):
            raise ValueError(f"importance_cap must be a finite number >= 1, got {importance_cap!r}")
        self.importance_cap = float(importance_cap)
        self.temperature = _positive("temperature", temperature)
        kl_ok = isinstance(kl_coef, (int, float)) and math.isfinite(kl_coef) and kl_coef >= 0
        if not kl_ok:
            raise ValueError(f"kl_coef must be a finite number >= 0, got {kl_coef!r}")
        if kl_coef > 0 and reference is None:
            raise ValueError("kl_coef > 0 needs a reference model (reference=...)")
        self.kl_coef = float(kl_coef)
        self.reference = reference

    def __repr__(self) -> str:
        return (
            f"GRPOObjective(clip={self.clip}, clip_high={self.clip_high}, "
            f"importance_cap={self.importance_cap}, temperature={self.temperature}, "
            f"kl_coef={self.kl_coef})"
        )

    def packed_log_probs(
        self, model: torch.nn.Module, batch: Mapping[str, np.ndarray | torch.Tensor]
    ) -> torch.Tensor:
        """[rows, width] float32 log-probs of the packed tokens, on the model's device.

        One forward over all rows with attention confined to each chain; differentiable
        (wrap in ``torch.no_grad()`` to rescore).
        """
        return packed_forward_log_probs(model, batch, temperature=self.temperature)

    def behavior_importance(self, proximal: torch.Tensor, behavior: torch.Tensor) -> torch.Tensor:
        """``exp(proximal - behavior)`` truncated at ``importance_cap``; same shape as inputs."""
        return behavior_importance(proximal, behavior, self.importance_cap)

    def loss(
        self,
        model: torch.nn.Module,
        batch: Mapping[str, np.ndarray | torch.Tensor],
        *,
        normalizer: float | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """(scalar loss to minimize, metrics) for one packed batch.

        The loss is the masked sum of per-token decoupled PPO terms divided by
        ``normalizer`` (default ``rows * width``).
        """
        for key in _LOSS_KEYS:
            if key not in batch:
                raise ValueError(f"batch is missing {key!r}; the loss needs {list(_LOSS_KEYS)}")
        logp = self.packed_log_probs(model, batch)  # [rows, width]
        rows, width = logp.shape
        for key in _LOSS_KEYS:
            if tuple(batch[key].shape) != (rows, width):
                raise ValueError(
                    f"batch[{key!r}] has shape {tuple(batch[key].shape)}, expected {(rows, width)}"
                )
        if normalizer is None:
            normalizer = float(rows * width)
        normalizer = _positive("normalizer", normalizer)
        device = logp.device

        def get(key: str) -> torch.Tensor:
            value = batch[key]
            if not isinstance(value, torch.Tensor):
                value = torch.from_numpy(np.ascontiguousarray(value))
            return value.to(device=device, dtype=torch.float32)

        per_token, stats = decoupled_ppo_loss(
            logp,
            get("proximal_log_probs"),
            get("behavior_log_probs"),
            get("advantages"),
            get("loss_mask"),
            clip=self.clip,
            clip_high=self.clip_high,
            cap=self.importance_cap,
        )
        if self.kl_coef > 0:
            assert self.reference is not None
            with torch.no_grad():
                ref = self.packed_log_probs(self.reference, batch).to(device)  # [rows, width]
            mask = get("loss_mask")  # [rows, width]
            kl = reference_kl(logp, ref, mask) * mask  # [rows, width]
            per_token = per_token + self.kl_coef * kl
            stats["kl_reference"] = kl.sum() / (mask > 0).sum().clamp(min=1)
        loss = per_token.sum() / normalizer
        names = list(stats)
        values = torch.stack([stats[k].float() for k in names]).tolist()  # one device sync
        return loss, dict(zip(names, values, strict=True))
