"""The GRPO objective, in its decoupled-PPO form for asynchronous rollouts.

Three policies meet in one update:

* *behavior*: the engine that sampled the tokens (``behavior_log_probs`` from the
  sources; possibly several weight versions old, possibly a different kernel);
* *proximal*: the trainer's weights when the batch was handed over, rescored over the
  packed rows (``proximal_log_probs``, filled by the scheduler with
  :meth:`GRPOObjective.packed_log_probs` under ``torch.no_grad()``), or, with
  ``proximal="forward"``, read off the loss's own forward (below);
* *current* (``pi_theta``): the weights being optimized.

The PPO trust region is taken around the proximal policy (ratio ``pi_theta /
pi_proximal``, clipped), and the off-policy gap between behavior and proximal is
corrected by a separate importance weight ``pi_proximal / pi_behavior`` that carries
no gradient (AReaL's decoupled objective). How that weight is bounded is a registered
rule (``importance``, see :data:`IMPORTANCE`): ``"truncate"`` (the default) caps it at
``importance_cap`` (``min(w, cap)``), so a token the engine found much less likely than
the trainer does still trains, with bounded weight; ``"mask"`` keeps ``w`` inside
``[1 / cap, cap]`` and gives every token outside that band weight 0 (masked importance
sampling, as IcePop and slime's MIS do): a token whose probability moved that far since
it was sampled stops training instead of training at the cap; ``"sequence"`` weighs every
token of a chain by the chain's whole likelihood ratio (the product of its tokens'
``w``), truncated at the cap, which also corrects for the earlier tokens the behavior
policy chose. Rollouts a few updates old under-sample the tokens the policy has been
learning fastest (likely now, rare then), so these are exactly the tokens with a large
``w``: a tight cap takes most of their correction away.

``clip_behavior=True`` also takes the clip band around the *behavior* policy: a token
whose probability has already moved past the band since it was sampled (``pi_theta /
pi_behavior`` above ``1 + clip_high`` with a positive advantage, or under ``1 - clip``
with a negative one) stops training, as in PPO's clip against the policy that sampled.
The proximal band alone cannot see that movement (under ``proximal="forward"`` its ratio
is exactly 1). Without it, rollouts a few updates old keep pushing a fast-moving
probability (the stop token's, say) in the direction the policy has already gone, and
the policy overshoots: a feedback loop with a delay swings (see ``bench/RESULTS.md``,
"async steps"). On a fresh batch ``pi_behavior`` is ``pi_proximal``, so it changes nothing
there. ``behavior_clip_fraction`` counts the tokens the rule stops (with the option off,
the tokens the two-sided rule would stop).

``clip_behavior="negative"`` keeps only the second half of that rule
(:data:`BEHAVIOR_CLIP`): a token is stopped when its advantage is negative and its
probability has already fallen under ``1 - clip`` of the behavior's, and a token with a
positive advantage trains however far it has risen. The case for it: the tokens that
rose most since a stale batch was sampled are the ones the policy is learning fastest,
and holding their gradient back delays the learning the batch was kept for. On the
heavy-tailed demo tasks it did no better than both sides on seeds no one tuned on
(``bench/RESULTS.md``, profile items 40 and 42), so ``True`` stays the rule to start from.

Decisions worth knowing:

* Normalization: the summed per-token loss is divided by a constant (default
  ``rows * width``), never by the number of trained tokens, so every process of a
  pool divides by the same number and per-process gradients add up to the pool's.
* ``loss_mask`` is a float weight; a token trains when its mask is > 0. Everything
  read at an untrained token is replaced by a neutral value before use, so garbage
  there (inf advantages, wild log-probs) cannot leak NaN into the gradient.
* ``importance_capped_fraction`` counts trained tokens whose weight the rule changed
  (truncated, or masked to 0).
* ``clip_fraction`` counts tokens whose gradient the clip switched off (the clipped
  branch won the minimum), which is what tells you the trust region is binding.
* ``mismatch_kl`` estimates KL(behavior || proximal) on the trained tokens with the
  k3 estimator ``r - 1 - log r``, ``r = pi_proximal / pi_behavior``: unbiased for
  tokens drawn from the behavior policy, never negative, 0 exactly when they agree.
* Metrics over an empty set of trained tokens are 0 (``trained_tokens`` says so).
* ``proximal="forward"`` skips the rescoring forward. When one optimizer update
  consumes a batch (``fit``'s loop, micro-batches included), the weights the loss
  runs under *are* the weights the batch was handed over with, so the loss's own
  log-probs, detached, are the proximal log-probs: the same numbers, one forward
  fewer. It is exact only then, so it is checked: the scheduler stamps the batch with
  the process's count of optimizer steps (every ``torch.optim.Optimizer``'s, counted by
  a step hook), fills ``proximal_log_probs`` with NaN so nothing mistakes them for
  values, and the loss refuses a batch once an optimizer has stepped since (a second
  update on one batch, as PPO epochs take, needs ``proximal="rescore"``, the default).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

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
    "BEHAVIOR_CLIP",
    "IMPORTANCE",
    "PROXIMAL",
    "PROXIMAL_STAMP",
    "GRPOObjective",
    "behavior_importance",
    "chain_attention",
    "chain_sums",
    "decoupled_ppo_loss",
    "masked_importance",
    "mismatch_kl",
    "optimizer_steps",
    "reference_kl",
    "sequence_importance",
    "support_log_normalizer",
    "token_log_probs",
    "truncated_importance",
]

_LOSS_KEYS = ("loss_mask", "advantages", "behavior_log_probs", "proximal_log_probs")

# Where the proximal log-probs come from: a rescoring forward when the batch is handed
# over, or the loss's own forward (see the module docstring).
PROXIMAL = ("rescore", "forward")
ProximalChoice = Literal["rescore", "forward"]
# The batch key of a batch packed for proximal="forward": optimizer_steps() at handover.
PROXIMAL_STAMP = "proximal_stamp"

_steps = [0]  # optimizer steps counted by _count_step, once it is registered
_step_hook: object = None


def _count_step(optimizer: object, args: object, kwargs: object) -> None:
    _steps[0] += 1


def optimizer_steps() -> int:
    """Optimizer steps this process has taken since the count began.

    Every ``torch.optim.Optimizer`` counts (a global step post-hook, registered on the
    first call and kept for the process's life): only differences between two reads
    mean anything.
    """
    global _step_hook
    if _step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _step_hook = register_optimizer_step_post_hook(_count_step)
    return _steps[0]


def truncated_importance(
    log_w: torch.Tensor, cap: float, segments: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min(w, cap), w > cap)`` with ``w = exp(log_w)``; [rows, width] -> two [rows, width]."""
    w = torch.exp(log_w)
    return w.clamp(max=cap), w > cap


def masked_importance(
    log_w: torch.Tensor, cap: float, segments: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w or 0, outside)``: ``w = exp(log_w)`` where ``1/cap <= w <= cap``, else 0.

    [rows, width] -> two [rows, width]; ``outside`` marks the tokens set to 0.
    """
    w = torch.exp(log_w)
    bound = torch.tensor(math.log(cap), dtype=log_w.dtype)  # in log_w's precision: +-symmetric
    outside = (log_w > bound) | (log_w < -bound)
    return torch.where(outside, torch.zeros_like(w), w), outside


def chain_sums(values: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """Each token's sum of ``values`` over its chain (its row's tokens of its segment).

    ``values`` [rows, width] float, ``segments`` [rows, width] int (0 = padding, whose
    sums mean nothing) -> [rows, width].
    """
    rows = values.shape[0]
    seg = segments.to(device=values.device, dtype=torch.long)  # [rows, width]
    span = int(seg.max()) + 1 if seg.numel() else 1
    cell = torch.arange(rows, device=values.device)[:, None] * span + seg  # [rows, width]
    sums = values.new_zeros(rows * span).scatter_add_(0, cell.reshape(-1), values.reshape(-1))
    return sums[cell]  # [rows, width]


def sequence_importance(
    log_w: torch.Tensor, cap: float, segments: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min(W, cap), W > cap)`` where ``W`` is the product of ``w`` over the token's chain.

    A chain's tokens all get its weight: the likelihood ratio of the whole rollout,
    which also corrects for the states (earlier tokens) the behavior policy visited.
    ``log_w`` [rows, width] (0 at untrained tokens), ``segments`` [rows, width] ->
    two [rows, width].
    """
    if segments is None:
        raise ValueError("importance='sequence' needs the batch's segments")
    w = torch.exp(chain_sums(log_w, segments))  # [rows, width]
    return w.clamp(max=cap), w > cap


# How the behavior weight w = pi_proximal / pi_behavior is bounded: name -> rule taking
# (log w, cap, segments) and returning (weight, changed), all [rows, width].
IMPORTANCE = {
    "truncate": truncated_importance,
    "mask": masked_importance,
    "sequence": sequence_importance,
}
ImportanceChoice = Literal["truncate", "mask", "sequence"]


def behavior_importance(
    proximal: torch.Tensor, behavior: torch.Tensor, cap: float, rule: str = "truncate"
) -> torch.Tensor:
    """The bounded weight ``pi_proximal / pi_behavior`` per token under ``rule``
    (:data:`IMPORTANCE`); [rows, width] -> [rows, width]."""
    if rule == "sequence":
        raise ValueError("importance='sequence' weighs chains: use decoupled_ppo_loss")
    return IMPORTANCE[rule](proximal - behavior, cap)[0]


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


def _pushed_past(
    ratio: torch.Tensor, adv: torch.Tensor, trained: torch.Tensor, clip: float, high: float
) -> torch.Tensor:
    """Trained tokens whose ``ratio`` left ``[1 - clip, 1 + high]`` on the side their
    advantage pushes it toward; all [rows, width]."""
    up = trained & (adv > 0) & (ratio > 1.0 + high)  # [rows, width]
    return up | _pushed_down_past(ratio, adv, trained, clip, high)


def _pushed_down_past(
    ratio: torch.Tensor, adv: torch.Tensor, trained: torch.Tensor, clip: float, high: float
) -> torch.Tensor:
    """Trained tokens whose ``ratio`` fell under ``1 - clip`` with a negative advantage
    (the upper side is left open); all [rows, width]."""
    return trained & (adv < 0) & (ratio < 1.0 - clip)


# Which tokens the behavior clip stops: name -> rule taking (pi_theta / pi_behavior,
# advantages, trained, clip, clip_high) and returning a bool mask, all [rows, width].
BEHAVIOR_CLIP = {"both": _pushed_past, "negative": _pushed_down_past}
BehaviorClipChoice = Literal["both", "negative"]


def _behavior_clip_rule(value: object) -> BehaviorClipChoice | None:
    """``clip_behavior``'s rule name, or None when the option is off (``True`` is
    ``"both"``)."""
    if value is False:
        return None
    if value is True:
        return "both"
    if isinstance(value, str) and value in BEHAVIOR_CLIP:
        return value  # type: ignore[return-value]
    raise ValueError(
        f"clip_behavior must be True, False or one of {list(BEHAVIOR_CLIP)}, got {value!r}"
    )


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
    importance: str = "truncate",
    segments: torch.Tensor | None = None,
    clip_behavior: bool | BehaviorClipChoice = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token decoupled PPO loss (to minimize) and detached metric scalars.

    ``logp`` [rows, width] current log-probs (with grad); ``proximal``, ``behavior``
    [rows, width] log-probs (no grad needed); ``advantages`` [rows, width];
    ``mask`` [rows, width] float weight (> 0 = trained).
    Returns ``per_token`` [rows, width] = ``-mask * w * min(r * A, clip(r) * A)`` with
    ``w = behavior_importance(proximal, behavior, cap, importance)`` (detached), ``r = exp(logp -
    proximal)`` and ``clip(r)`` in ``[1 - clip, 1 + (clip_high or clip)]``; 0 where
    ``mask`` is 0, and 0 with ``clip_behavior`` (``True`` or ``"both"``) where
    ``rho = pi_theta / pi_behavior`` (``r`` times the raw ``w``) is above
    ``1 + (clip_high or clip)`` with ``A > 0`` or under ``1 - clip`` with ``A < 0``; with
    ``"negative"``, only where it is under ``1 - clip`` with ``A < 0``. Metrics:
    mismatch_kl, importance_mean, importance_max (before the cap),
    importance_capped_fraction, clip_fraction, behavior_clip_fraction (the tokens the
    ``rho`` rule stops; the two-sided rule's when off), ratio_mean, trained_tokens.
    """
    rule = _behavior_clip_rule(clip_behavior)
    high = clip if clip_high is None else clip_high
    mask = mask.to(logp.dtype)
    trained = mask > 0  # [rows, width]
    zero = torch.zeros_like(logp)
    proximal = proximal.detach().to(logp.dtype)
    behavior = behavior.detach().to(logp.dtype)
    adv = torch.where(trained, advantages.to(logp.dtype), zero)  # [rows, width]
    log_w = torch.where(trained, proximal - behavior, zero)  # [rows, width]
    raw_w = torch.exp(log_w)  # [rows, width]
    weight, changed = IMPORTANCE[importance](log_w, cap, segments)  # [rows, width] each
    log_ratio = torch.where(trained, logp - proximal, zero)  # [rows, width], grad via logp
    ratio = torch.exp(log_ratio)  # [rows, width]
    clipped = ratio.clamp(1.0 - clip, 1.0 + high)  # [rows, width]
    surrogate = torch.minimum(ratio * adv, clipped * adv)  # [rows, width]
    # pi_theta / pi_behavior: how far each token's probability moved since it was sampled
    moved = ratio.detach() * raw_w  # [rows, width]
    past = BEHAVIOR_CLIP[rule or "both"](moved, adv, trained, clip, high)  # [rows, width]
    if rule is not None:
        surrogate = torch.where(past, zero, surrogate)
    per_token = -(mask * weight * surrogate)  # [rows, width]

    with torch.no_grad():
        n = trained.sum()
        denom = n.clamp(min=1).to(logp.dtype)
        r = ratio.detach()
        clip_active = _pushed_past(r, adv, trained, clip, high)
        metrics = {
            "mismatch_kl": mismatch_kl(proximal, behavior, trained),
            "importance_mean": torch.where(trained, raw_w, zero).sum() / denom,
            # amax over an empty batch is an error; the 0 in front covers that case
            "importance_max": torch.cat([zero.new_zeros(1), raw_w[trained]]).max(),
            "importance_capped_fraction": (trained & changed).sum() / denom,
            "clip_fraction": clip_active.sum() / denom,
            "behavior_clip_fraction": past.sum() / denom,
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
    (asymmetric, "clip-higher"). ``importance`` is how the behavior weight is bounded
    (:data:`IMPORTANCE`: ``"truncate"`` at ``importance_cap``, ``"mask"`` outside
    ``[1 / importance_cap, importance_cap]``, or ``"sequence"``, each chain's product
    truncated at ``importance_cap``; see the module docstring).
    ``clip_behavior`` (``True``, or a rule of :data:`BEHAVIOR_CLIP`) also stops every
    token whose ``pi_theta / pi_behavior`` has left the clip band in its advantage's
    direction (``True`` or ``"both"``), or only those pushed down past its lower edge
    (``"negative"``); see the module docstring.
    ``temperature`` must be the sampling temperature, so trainer log-probs describe
    the same distribution the engine drew from. ``kl_coef`` (0: off) adds that many
    times :func:`reference_kl` against the frozen ``reference`` model to every trained
    token's loss (metric ``kl_reference``: its mean over trained tokens).
    ``proximal``: ``"rescore"`` (the scheduler rescores each handed-over batch) or
    ``"forward"`` (the loss's own forward, detached, for one update per batch; see the
    module docstring).
    """

    def __init__(
        self,
        *,
        clip: float = 0.2,
        clip_high: float | None = None,
        importance_cap: float = 2.0,
        importance: ImportanceChoice = "truncate",
        temperature: float = 1.0,
        kl_coef: float = 0.0,
        reference: torch.nn.Module | None = None,
        proximal: ProximalChoice = "rescore",
        clip_behavior: bool | BehaviorClipChoice = False,
    ) -> None:
        self.clip = _positive("clip", clip)
        self.clip_high = None if clip_high is None else _positive("clip_high", clip_high)
        cap_ok = isinstance(importance_cap, (int, float)) and math.isfinite(importance_cap)
        if not (cap_ok and importance_cap >= 1):
            raise ValueError(f"importance_cap must be a finite number >= 1, got {importance_cap!r}")
        self.importance_cap = float(importance_cap)
        if importance not in IMPORTANCE:
            raise ValueError(f"importance={importance!r} is not one of {list(IMPORTANCE)}")
        self.importance: ImportanceChoice = importance
        self.temperature = _positive("temperature", temperature)
        kl_ok = isinstance(kl_coef, (int, float)) and math.isfinite(kl_coef) and kl_coef >= 0
        if not kl_ok:
            raise ValueError(f"kl_coef must be a finite number >= 0, got {kl_coef!r}")
        if kl_coef > 0 and reference is None:
            raise ValueError("kl_coef > 0 needs a reference model (reference=...)")
        self.kl_coef = float(kl_coef)
        self.reference = reference
        if proximal not in PROXIMAL:
            raise ValueError(f"proximal={proximal!r} is not one of {list(PROXIMAL)}")
        self.proximal: ProximalChoice = proximal
        # False when off, else the rule's name ("both" for True)
        self.clip_behavior: BehaviorClipChoice | Literal[False] = (
            _behavior_clip_rule(clip_behavior) or False
        )

    def __repr__(self) -> str:
        return (
            f"GRPOObjective(clip={self.clip}, clip_high={self.clip_high}, "
            f"importance_cap={self.importance_cap}, importance={self.importance!r}, "
            f"temperature={self.temperature}, "
            f"kl_coef={self.kl_coef}, proximal={self.proximal!r}, "
            f"clip_behavior={self.clip_behavior!r})"
        )

    def packed_log_probs(
        self, model: torch.nn.Module, batch: Mapping[str, np.ndarray | torch.Tensor]
    ) -> torch.Tensor:
        """[rows, width] float32 log-probs of the packed tokens, on the model's device.

        Attention stays inside each chain: the rows run in one forward with a
        block-diagonal mask, or the chains one per row in length buckets, whichever
        costs less (the same numbers either way). Differentiable (wrap in
        ``torch.no_grad()`` to rescore).
        """
        return packed_forward_log_probs(model, batch, temperature=self.temperature)

    def behavior_importance(self, proximal: torch.Tensor, behavior: torch.Tensor) -> torch.Tensor:
        """``exp(proximal - behavior)`` bounded by ``importance`` at ``importance_cap``;
        same shape as inputs."""
        return behavior_importance(proximal, behavior, self.importance_cap, self.importance)

    def fill_proximal(self, model: torch.nn.Module, batch: dict[str, np.ndarray]) -> None:
        """Set ``batch["proximal_log_probs"]`` for a batch handed over under ``model``.

        ``"rescore"``: one no-grad forward. ``"forward"``: NaN, and the batch is stamped
        (``PROXIMAL_STAMP``) for :meth:`loss` to check that no optimizer stepped since.
        """
        if self.proximal == "forward":
            shape = np.shape(batch["tokens"])
            batch["proximal_log_probs"] = np.full(shape, np.nan, dtype=np.float32)
            batch[PROXIMAL_STAMP] = np.asarray(optimizer_steps(), dtype=np.int64)
            return
        with torch.no_grad():
            proximal = self.packed_log_probs(model, batch)
        batch["proximal_log_probs"] = proximal.detach().float().cpu().numpy()

    def _proximal(self, logp: torch.Tensor, batch: Mapping[str, object]) -> torch.Tensor | None:
        """The loss's proximal log-probs when they are its own forward's, else None."""
        stamp = batch.get(PROXIMAL_STAMP)
        if self.proximal == "rescore":
            if stamp is not None:
                raise ValueError(
                    "batch was packed for proximal='forward' (its proximal_log_probs were "
                    "never computed); this objective has proximal='rescore'"
                )
            return None
        if stamp is not None and int(np.asarray(stamp)) != optimizer_steps():
            raise ValueError(
                "proximal='forward': an optimizer stepped since this batch was handed over, "
                "so the loss's forward no longer runs under the proximal weights (a second "
                "update on one batch needs GRPOObjective(proximal='rescore'))"
            )
        return logp.detach()

    @staticmethod
    def _segments(batch: Mapping[str, np.ndarray | torch.Tensor]) -> torch.Tensor:
        seg = batch["segments"]
        return seg if isinstance(seg, torch.Tensor) else torch.from_numpy(np.asarray(seg))

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
        needed = _LOSS_KEYS if self.proximal == "rescore" else _LOSS_KEYS[:-1]
        for key in needed:
            if key not in batch:
                raise ValueError(f"batch is missing {key!r}; the loss needs {list(needed)}")
        logp = self.packed_log_probs(model, batch)  # [rows, width]
        own = self._proximal(logp, batch)  # [rows, width] or None: the batch's
        rows, width = logp.shape
        for key in needed:
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
            get("proximal_log_probs") if own is None else own,
            get("behavior_log_probs"),
            get("advantages"),
            get("loss_mask"),
            clip=self.clip,
            clip_high=self.clip_high,
            cap=self.importance_cap,
            importance=self.importance,
            segments=self._segments(batch) if self.importance == "sequence" else None,
            clip_behavior=self.clip_behavior,
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
