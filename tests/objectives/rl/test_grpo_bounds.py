"""GRPO objective at its edges: exact clip and cap boundaries, zero advantages, a single
trained token, dtypes, and the exact messages of refused arguments."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dew.objectives.rl.grpo import (
    GRPOObjective,
    behavior_importance,
    chain_sums,
    decoupled_ppo_loss,
    masked_importance,
    mismatch_kl,
    reference_kl,
    sequence_importance,
    truncated_importance,
)

from .test_grpo import loss_batch, sharp_model


def exact_log(x: float) -> float:
    """A float32 log whose exp gives ``x`` back exactly, so a ratio can sit on a bound."""
    log = torch.log(torch.tensor(x))
    assert torch.exp(log).item() == x
    return log.item()


# --------------------------------------------------------------------------- pure loss math


def test_behavior_importance_is_the_exp_of_the_difference() -> None:
    proximal = torch.tensor([-1.0, -2.0, -0.5])
    behavior = torch.tensor([-1.5, -1.0, -3.0])  # differences 0.5, -1, 2.5
    w = behavior_importance(proximal, behavior, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([math.exp(0.5), math.exp(-1.0), 2.0]))


def test_truncation_caps_the_weight_and_masking_zeroes_it_outside_the_band() -> None:
    # weights 0.4, 0.6, 1.0, 1.9, 2.5 against cap 2: the band is [0.5, 2]
    log_w = torch.log(torch.tensor([[0.4, 0.6, 1.0, 1.9, 2.5]]))
    weight, changed = truncated_importance(log_w, 2.0)
    torch.testing.assert_close(weight, torch.tensor([[0.4, 0.6, 1.0, 1.9, 2.0]]))
    assert changed.tolist() == [[False, False, False, False, True]]  # only the upper side
    weight, changed = masked_importance(log_w, 2.0)
    torch.testing.assert_close(weight, torch.tensor([[0.0, 0.6, 1.0, 1.9, 0.0]]))
    assert changed.tolist() == [[True, False, False, False, True]]  # both sides
    # on the band's edges a weight is kept, as truncation keeps a weight at the cap
    edges = torch.tensor([[exact_log(0.5), exact_log(2.0)]])
    weight, changed = masked_importance(edges, 2.0)
    torch.testing.assert_close(weight, torch.tensor([[0.5, 2.0]]))
    assert not changed.any()


def test_clip_behavior_hand_worked() -> None:
    # band [0.8, 1.28] on pi_theta / pi_behavior = r * w
    ratio = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.1, 1.0])
    imp = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.2, 1.25, 3.0])  # w = proximal / behavior
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, 1.0, 1.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    proximal = torch.full((7,), -2.0)
    behavior = proximal - imp.log()
    logp = (proximal + ratio.log()).requires_grad_()

    def run(on: bool | str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return decoupled_ppo_loss(
            logp[None], proximal[None], behavior[None], adv[None], mask[None],
            clip=0.2, clip_high=0.28, cap=2.0, clip_behavior=on,
        )  # fmt: skip

    per_token, metrics = run(True)
    #   rose to 1.5 and pushed up -> 0; rose, pushed down -> trains (1.5);
    #   fell to 0.5 and pushed down -> 0; fell, pushed up -> trains (-0.5);
    #   1.2 inside the band -> trains; 1.1 * 1.25 = 1.375 past it though r alone is
    #   inside the proximal band -> 0; masked -> 0
    expect = torch.tensor([0.0, 1.5, 0.0, -0.5, -1.2, 0.0, 0.0])
    torch.testing.assert_close(per_token[0], expect)
    per_token.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 1.5, 0.0, -0.5, -1.2, 0.0, 0.0]))
    assert metrics["behavior_clip_fraction"] == pytest.approx(3 / 6)
    assert metrics["clip_fraction"] == 0  # the proximal band binds nowhere
    off, off_metrics = run(False)
    torch.testing.assert_close(
        off[0].detach(), torch.tensor([-1.5, 1.5, 0.5, -0.5, -1.2, -1.375, 0.0])
    )
    assert off_metrics["behavior_clip_fraction"] == pytest.approx(3 / 6)
    # "negative" stops only the token that fell to 0.5 with a negative advantage; the two
    # that rose past 1.28 with a positive one (1.5 and 1.375) train
    down, down_metrics = run("negative")
    torch.testing.assert_close(
        down[0].detach(), torch.tensor([-1.5, 1.5, 0.0, -0.5, -1.2, -1.375, 0.0])
    )
    assert down_metrics["behavior_clip_fraction"] == pytest.approx(1 / 6)
    same, _ = run("both")
    torch.testing.assert_close(same[0].detach(), expect)


def test_a_sequence_weight_is_its_chains_product_truncated_at_the_cap() -> None:
    # row 0 holds chain 1 (log w 0.1, 0.2) and chain 2 (log w 0.5, 0.6, untrained 0);
    # row 1 holds chain 1 (log w -0.3, -0.4) and padding
    log_w = torch.tensor([[0.1, 0.2, 0.5, 0.6, 0.0], [-0.3, -0.4, 0.0, 0.0, 0.0]])
    segments = torch.tensor([[1, 1, 2, 2, 2], [1, 1, 0, 0, 0]])
    torch.testing.assert_close(
        chain_sums(log_w, segments),
        torch.tensor([[0.3, 0.3, 1.1, 1.1, 1.1], [-0.7, -0.7, 0.0, 0.0, 0.0]]),
    )
    weight, changed = sequence_importance(log_w, 2.0, segments)
    e3, e7 = math.exp(0.3), math.exp(-0.7)  # e^1.1 = 3.0 > 2: truncated
    torch.testing.assert_close(
        weight, torch.tensor([[e3, e3, 2.0, 2.0, 2.0], [e7, e7, 1.0, 1.0, 1.0]])
    )
    assert changed.tolist() == [[False, False, True, True, True], [False] * 5]
    with pytest.raises(ValueError, match="segments"):
        sequence_importance(log_w, 2.0)


def test_the_sequence_rule_weighs_a_chain_by_its_rollouts_likelihood_ratio() -> None:
    # one row, two chains of two trained tokens, A = 1, r = 1: per-token weights
    # 1.5 * 0.5 (chain 1, product 0.75) and 1.2 * 1.25 (chain 2, product 1.5)
    logp = torch.zeros(1, 4, requires_grad=True)
    behavior = -torch.log(torch.tensor([[1.5, 0.5, 1.2, 1.25]]))
    segments = torch.tensor([[1, 1, 2, 2]])
    per_token, metrics = decoupled_ppo_loss(
        logp, torch.zeros(1, 4), behavior, torch.ones(1, 4), torch.ones(1, 4),
        clip=0.2, clip_high=None, cap=2.0, importance="sequence", segments=segments,
    )  # fmt: skip
    torch.testing.assert_close(per_token, -torch.tensor([[0.75, 0.75, 1.5, 1.5]]))
    assert metrics["importance_capped_fraction"].item() == 0.0


def test_masked_tokens_train_nothing_and_are_counted_as_changed() -> None:
    # three trained tokens, A = 1 and r = 1 each, weights 0.25, 1.5 and 3 against cap 2
    logp = torch.zeros(1, 3, requires_grad=True)
    behavior = -torch.log(torch.tensor([[0.25, 1.5, 3.0]]))  # proximal 0: w = 1 / p_behavior
    args = (logp, torch.zeros(1, 3), behavior, torch.ones(1, 3), torch.ones(1, 3))
    per_token, metrics = decoupled_ppo_loss(
        *args, clip=0.2, clip_high=None, cap=2.0, importance="mask"
    )
    torch.testing.assert_close(per_token, torch.tensor([[0.0, -1.5, 0.0]]))
    assert metrics["importance_capped_fraction"].item() == pytest.approx(2 / 3)
    per_token.sum().backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1.5, 0.0]]))  # -w * A * r
    truncated, metrics = decoupled_ppo_loss(*args, clip=0.2, clip_high=None, cap=2.0)
    torch.testing.assert_close(truncated, torch.tensor([[-0.25, -1.5, -2.0]]))
    assert metrics["importance_capped_fraction"].item() == pytest.approx(1 / 3)


def test_mismatch_kl_of_a_single_trained_token_is_its_k3() -> None:
    proximal = torch.tensor([[0.0, 0.3, 9.0]])
    behavior = torch.zeros(1, 3)
    trained = torch.tensor([[False, True, False]])
    kl = mismatch_kl(proximal, behavior, trained)
    assert float(kl) == pytest.approx(math.exp(0.3) - 1 - 0.3, rel=1e-5)  # a mean over one


def test_tokens_on_a_bound_or_without_advantage_are_not_counted_as_clipped() -> None:
    """``clip_fraction`` counts tokens whose gradient the clip switched off. A ratio
    exactly on a bound is not clipped (both branches agree and the gradient flows), and a
    zero advantage has no gradient to switch off; nor does a positive advantage at a low
    ratio (the unclipped branch is the minimum). Likewise a weight exactly at the cap
    was not truncated."""
    up, down = exact_log(1.25), exact_log(0.75)
    # tokens:      A=0 r=2     A=0 r=0.5   A=0.5 r=0.5  A=1 r=1.25  A=-1 r=0.75  w = cap
    logp = torch.tensor([math.log(2.0), math.log(0.5), math.log(0.5), up, down, 0.0])
    proximal = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, exact_log(2.0)])
    logp = (logp + proximal).requires_grad_()
    behavior = torch.zeros(6)
    adv = torch.tensor([0.0, 0.0, 0.5, 1.0, -1.0, 1.0])
    per_token, metrics = decoupled_ppo_loss(
        logp[None], proximal[None], behavior[None], adv[None], torch.ones(1, 6),
        clip=0.25, clip_high=0.25, cap=2.0,
    )  # fmt: skip
    assert metrics["clip_fraction"] == 0.0
    assert metrics["importance_capped_fraction"] == 0.0
    assert metrics["importance_max"] == 2.0
    torch.testing.assert_close(per_token[0], torch.tensor([0.0, 0.0, -0.25, -1.25, 0.75, -2.0]))
    per_token.sum().backward()
    # -w * A * r everywhere: no token lost its gradient to the clip
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 0.0, -0.25, -1.25, 0.75, -2.0]))


def test_metrics_of_a_single_trained_token_are_its_own_values() -> None:
    logp = torch.tensor([[math.log(1.1), 5.0]])
    proximal = torch.zeros(1, 2)
    behavior = torch.tensor([[-math.log(1.5), -9.0]])  # weight 1.5 on the trained token
    _, metrics = decoupled_ppo_loss(
        logp, proximal, behavior, torch.tensor([[1.0, 1.0]]), torch.tensor([[1.0, 0.0]]),
        clip=0.2, clip_high=None, cap=2.0,
    )  # fmt: skip
    assert metrics["trained_tokens"] == 1.0
    assert float(metrics["importance_mean"]) == pytest.approx(1.5, rel=1e-6)
    assert float(metrics["ratio_mean"]) == pytest.approx(1.1, rel=1e-6)
    assert float(metrics["mismatch_kl"]) == pytest.approx(1.5 - 1 - math.log(1.5), rel=1e-5)
    # nothing trained: every metric is 0, not NaN
    _, empty = decoupled_ppo_loss(
        logp, proximal, behavior, torch.ones(1, 2), torch.zeros(1, 2),
        clip=0.2, clip_high=None, cap=2.0,
    )  # fmt: skip
    assert {k: float(v) for k, v in empty.items()} == dict.fromkeys(empty, 0.0)


@pytest.mark.parametrize(
    ("logp_dtype", "other_dtype"), [(torch.float32, torch.float64), (torch.float64, torch.float32)]
)
def test_decoupled_loss_computes_in_the_dtype_of_logp(
    logp_dtype: torch.dtype, other_dtype: torch.dtype
) -> None:
    # Inputs of another dtype (float64 advantages from numpy, a float32 rescoring under
    # a float64 check) are cast to logp's: the loss and every metric come out in it.
    gen = torch.Generator().manual_seed(0)
    logp = (-torch.rand(2, 5, generator=gen)).to(logp_dtype)
    proximal = (logp.double() + 0.3 * torch.randn(2, 5, generator=gen, dtype=torch.float64)).to(
        other_dtype
    )
    behavior = (proximal.double() - 0.4).to(other_dtype)
    adv = torch.tensor([[1.0, -1.0, 2.0, 0.5, -0.5]] * 2, dtype=other_dtype)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0, 1.0]], dtype=other_dtype)
    per_token, metrics = decoupled_ppo_loss(
        logp, proximal, behavior, adv, mask, clip=0.2, clip_high=None, cap=1.2
    )
    assert per_token.dtype == logp_dtype
    assert {k: v.dtype for k, v in metrics.items()} == dict.fromkeys(metrics, logp_dtype)
    assert metrics["trained_tokens"] == 8.0


def test_float64_metrics_are_exact_fractions() -> None:
    # In double precision the fractions are the float64 quotients, e.g. 2/7 exactly.
    ratio = torch.tensor([1.5, 0.5, 0.5, 1.5, 1.0, 1.0, 1.0], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    proximal = torch.full((7,), -2.0, dtype=torch.float64)
    behavior = proximal - torch.tensor([0.0] * 6 + [1.0], dtype=torch.float64)  # w = e once
    _, metrics = decoupled_ppo_loss(
        (proximal + ratio.log())[None], proximal[None], behavior[None], adv[None],
        torch.ones(1, 7, dtype=torch.float64), clip=0.2, clip_high=None, cap=2.0,
    )  # fmt: skip
    assert metrics["clip_fraction"].item() == 2 / 7  # tokens 0 and 2
    assert metrics["importance_capped_fraction"].item() == 1 / 7


# --------------------------------------------------------------------------- the objective


def test_defaults_and_the_cap_bounds() -> None:
    assert repr(GRPOObjective()) == (
        "GRPOObjective(clip=0.2, clip_high=None, importance_cap=2.0, importance='truncate', "
        "temperature=1.0, kl_coef=0.0, proximal='rescore', clip_behavior=False)"
    )
    assert GRPOObjective(importance_cap=1).importance_cap == 1.0  # no upweighting at all
    for cap in (float("inf"), float("nan"), 0.99, "2"):
        with pytest.raises(ValueError) as info:
            GRPOObjective(importance_cap=cap)  # type: ignore[arg-type]
        assert str(info.value) == f"importance_cap must be a finite number >= 1, got {cap!r}"
    with pytest.raises(ValueError) as info:
        GRPOObjective(importance="clip")  # type: ignore[arg-type]
    assert str(info.value) == "importance='clip' is not one of ['truncate', 'mask', 'sequence']"
    with pytest.raises(ValueError) as info:
        GRPOObjective(kl_coef=0.1)
    assert str(info.value) == "kl_coef > 0 needs a reference model (reference=...)"


def test_loss_messages_name_the_field_and_the_normalizer() -> None:
    model = sharp_model("qwen2")
    batch = loss_batch(model)
    objective = GRPOObjective()
    wrong = dict(batch, advantages=batch["advantages"][:, :-1])
    with pytest.raises(ValueError) as info:
        objective.loss(model, wrong)
    assert str(info.value) == "batch['advantages'] has shape (4, 15), expected (4, 16)"
    with pytest.raises(ValueError) as info:
        objective.loss(model, batch, normalizer=-1.0)
    assert str(info.value) == "normalizer must be a positive finite number, got -1.0"


def test_kl_to_a_reference_on_one_float64_masked_token() -> None:
    # One trained token: kl_reference is that token's KL (a mean over one), and a float64
    # loss_mask from the caller does not turn the float32 loss into float64.
    model = sharp_model("qwen2", seed=0)
    other = sharp_model("qwen2", seed=1)
    batch = loss_batch(model)
    mask = np.zeros(batch["loss_mask"].shape, np.float64)
    mask[1, 4] = 1.0
    batch["loss_mask"] = mask
    objective = GRPOObjective(kl_coef=0.5, reference=other)
    loss, metrics = objective.loss(model, batch)
    assert loss.dtype == torch.float32
    with torch.no_grad():
        logp = objective.packed_log_probs(model, batch)
        ref = objective.packed_log_probs(other, batch)
    kl = reference_kl(logp, ref, torch.from_numpy(mask).float())[1, 4].item()
    assert kl > 1e-3
    assert metrics["kl_reference"] == pytest.approx(kl, rel=1e-5)
    assert metrics["trained_tokens"] == 1.0
