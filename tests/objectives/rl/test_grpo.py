"""GRPOObjective: packed scoring on tiny Qwen2/Llama models and the decoupled PPO loss."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dew.demo.model import make_model
from dew.objectives.rl.grpo import (
    GRPOObjective,
    behavior_importance,
    chain_attention,
    decoupled_ppo_loss,
    mismatch_kl,
    reference_kl,
)

ARCHS = ["qwen2", "llama"]
VOCAB_LOW = 6  # ids below are special tokens; any id works, these keep chains "textual"


# --------------------------------------------------------------------------- helpers


def sharp_model(arch: str, *, attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    """A tiny model with larger weights than the default init.

    The default init (std 0.02) gives almost uniform logits, so cross-chain leaks would
    move log-probs by little; wider weights make the comparisons below sensitive.
    """
    model = make_model(arch, "tiny", seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    if attn != "sdpa":
        model.set_attn_implementation(attn)
    return model


def random_chains(lengths: list[int], vocab: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(VOCAB_LOW, vocab, size=n).astype(np.int64) for n in lengths]


def pack_by_hand(
    chains: list[np.ndarray], layout: list[list[int]], width: int, *, seed: int = 0
) -> dict[str, np.ndarray]:
    """A packed batch as pack() lays it out: chain ``layout[r]`` back to back in row r.

    Loss fields are random but plausible; the chain's first token is never trained.
    Padding carries junk token ids and positions to show they do not matter.
    """
    rng = np.random.default_rng(seed)
    rows = len(layout)
    batch = {
        "tokens": np.full((rows, width), 3, np.int64),
        "positions": np.full((rows, width), 7, np.int64),
        "segments": np.zeros((rows, width), np.int64),
        "loss_mask": np.zeros((rows, width), np.float32),
        "completion_mask": np.zeros((rows, width), bool),
        "advantages": np.zeros((rows, width), np.float32),
        "behavior_log_probs": np.zeros((rows, width), np.float32),
        "proximal_log_probs": np.zeros((rows, width), np.float32),
        "versions": np.full((rows, width), -1, np.int64),
        "rollout_index": np.full((rows, width), -1, np.int64),
    }
    k = 0
    for r, ids in enumerate(layout):
        col = 0
        for s, i in enumerate(ids, start=1):
            n = len(chains[i])
            sl = slice(col, col + n)
            batch["tokens"][r, sl] = chains[i]
            batch["positions"][r, sl] = np.arange(n)
            batch["segments"][r, sl] = s
            trained = np.arange(n) >= 2  # the first two tokens are "prompt"
            batch["completion_mask"][r, sl] = trained
            batch["loss_mask"][r, sl] = trained.astype(np.float32)
            batch["advantages"][r, sl] = np.where(trained, rng.normal(), 0.0)
            batch["versions"][r, sl] = 0
            batch["rollout_index"][r, sl] = k
            k += 1
            col += n
        assert col <= width
    return batch


def alone_log_probs(
    model: torch.nn.Module, chain: np.ndarray, temperature: float = 1.0
) -> torch.Tensor:
    """Reference: the chain on its own, plain forward, log_softmax, gather. [n - 1]"""
    ids = torch.from_numpy(chain)[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    return logits[:-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]


def layout_slices(chains: list[np.ndarray], layout: list[list[int]]):
    for r, ids in enumerate(layout):
        col = 0
        for i in ids:
            n = len(chains[i])
            yield r, col, n, i
            col += n


def vocab_size(model: torch.nn.Module) -> int:
    return int(model.config.vocab_size)


# --------------------------------------------------------------------------- packed scoring


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_log_probs_equal_each_chain_alone(arch: str, attn: str) -> None:
    model = sharp_model(arch, attn=attn)
    chains = random_chains([6, 9, 4, 7, 5, 8, 3], vocab_size(model), seed=1)
    # several chains per row, a partly padded row and a row of padding only
    layout = [[0, 1, 2], [3, 4], [5, 6], []]
    batch = pack_by_hand(chains, layout, width=20)
    logp = GRPOObjective().packed_log_probs(model, batch)

    assert logp.shape == (4, 20) and logp.dtype == torch.float32
    assert torch.isfinite(logp).all()
    covered = torch.zeros(4, 20, dtype=torch.bool)
    for r, col, n, i in layout_slices(chains, layout):
        ref = alone_log_probs(model, chains[i])
        torch.testing.assert_close(logp[r, col + 1 : col + n], ref, atol=1e-5, rtol=0)
        assert logp[r, col] == 0.0  # chain start: nothing to condition on
        covered[r, col : col + n] = True
    assert (logp[~covered] == 0).all()  # padding

    # Control: the same rows scored as plain causal sequences (attention across chains,
    # positions running on) differ clearly, so the equality above is not vacuous.
    with torch.no_grad():
        naive = model(input_ids=torch.from_numpy(batch["tokens"][:1])).logits[0].log_softmax(-1)
    r, col, n, i = next(s for s in layout_slices(chains, layout) if s[1] > 0)
    tok = torch.from_numpy(chains[i][1:])
    leaked = naive[col : col + n - 1].gather(-1, tok[:, None])[:, 0]
    assert (leaked - alone_log_probs(model, chains[i])).abs().max() > 1e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_log_probs_one_forward_and_differentiable(arch: str) -> None:
    model = sharp_model(arch)
    chains = random_chains([5, 6, 7], vocab_size(model), seed=2)
    batch = pack_by_hand(chains, [[0, 1], [2], []], width=14)
    calls: list[tuple[int, ...]] = []
    handle = model.register_forward_hook(
        lambda mod, args, out: calls.append(tuple(out.logits.shape))
    )
    try:
        logp = GRPOObjective().packed_log_probs(model, batch)
    finally:
        handle.remove()
    assert calls == [(2, 14, vocab_size(model))]  # the empty row is left out
    assert logp.requires_grad
    logp.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)  # padding row did not NaN
    assert any(g.abs().sum() > 0 for g in grads)


def test_chain_attention_mask_hand_worked() -> None:
    segments = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 1, 1, 0, 0, 0]])
    mask = chain_attention(segments)
    assert mask.shape == (2, 1, 6, 6) and mask.dtype == torch.bool
    expect0 = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],  # a new chain sees only itself
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],  # padding: itself only, never an empty row
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[0, 0], expect0)
    expect1 = torch.eye(6, dtype=torch.bool)
    expect1[:3, :3] = torch.tril(torch.ones(3, 3, dtype=torch.bool))
    assert torch.equal(mask[1, 0], expect1)


def test_model_gets_positions_from_the_batch() -> None:
    # RoPE scores depend on relative positions only, so a per-chain offset would not show
    # in the log-probs of Qwen2/Llama; check what reaches the model instead.
    model = sharp_model("qwen2")
    chains = random_chains([5, 6, 4], vocab_size(model), seed=3)
    batch = pack_by_hand(chains, [[0, 1], [2]], width=12)
    seen: dict[str, torch.Tensor] = {}

    def grab(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        seen.update(kwargs)

    handle = model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            GRPOObjective().packed_log_probs(model, batch)
    finally:
        handle.remove()
    real = batch["segments"] > 0
    expect = np.where(real, batch["positions"], 0)
    assert torch.equal(seen["position_ids"], torch.from_numpy(expect))
    assert seen["attention_mask"].shape == (2, 1, 12, 12)


def test_packed_log_probs_accept_tensors() -> None:
    model = sharp_model("qwen2")
    chains = random_chains([5, 6, 4], vocab_size(model), seed=3)
    batch = pack_by_hand(chains, [[0, 1], [2]], width=12)
    as_tensors = {k: torch.from_numpy(v) for k, v in batch.items()}
    objective = GRPOObjective()
    with torch.no_grad():
        torch.testing.assert_close(
            objective.packed_log_probs(model, as_tensors), objective.packed_log_probs(model, batch)
        )


@pytest.mark.parametrize("arch", ARCHS)
def test_temperature_scales_logits(arch: str) -> None:
    model = sharp_model(arch)
    chains = random_chains([7, 5, 6], vocab_size(model), seed=4)
    layout = [[0, 1], [2]]
    batch = pack_by_hand(chains, layout, width=12)
    with torch.no_grad():
        cold = GRPOObjective(temperature=0.6).packed_log_probs(model, batch)
        plain = GRPOObjective().packed_log_probs(model, batch)
    for r, col, n, i in layout_slices(chains, layout):
        ref = alone_log_probs(model, chains[i], temperature=0.6)
        torch.testing.assert_close(cold[r, col + 1 : col + n], ref, atol=1e-5, rtol=0)
    assert (cold - plain).abs().max() > 1e-2


def add_support(batch: dict[str, np.ndarray], sets: dict[tuple[int, int], list[int]]) -> None:
    """Attach support arrays: ``sets[(row, t)]`` lists token t's support ids."""
    rows, width = batch["tokens"].shape
    capacity = max(sum(len(v) for (r, _), v in sets.items() if r == row) for row in range(rows)) + 2
    support = np.full((rows, capacity), -1, np.int64)
    offsets = np.zeros((rows, width + 1), np.int64)
    for r in range(rows):
        fill = 0
        for t in range(width):
            offsets[r, t] = fill
            ids = sets.get((r, t), [])
            support[r, fill : fill + len(ids)] = ids
            fill += len(ids)
        offsets[r, width] = fill
    batch["support"] = support
    batch["support_offsets"] = offsets


@pytest.mark.parametrize("arch", ARCHS)
def test_support_renormalizes_to_one(arch: str) -> None:
    model = sharp_model(arch)
    prefix = random_chains([6], vocab_size(model), seed=5)[0]
    support_ids = [11, 23, 37, 52, 60]
    # one row per support member: same prefix, last token = that member, support = the set
    chains = [np.concatenate([prefix, [s]]) for s in support_ids]
    layout = [[i] for i in range(len(chains))]
    batch = pack_by_hand(chains, layout, width=9)
    t_last = len(prefix)
    add_support(batch, {(r, t_last): support_ids for r in range(len(chains))})
    objective = GRPOObjective(temperature=0.8)
    with torch.no_grad():
        logp = objective.packed_log_probs(model, batch)
    last = logp[:, t_last]
    assert torch.logsumexp(last, 0).abs() < 1e-5  # the filtered distribution sums to 1
    # and it is the full distribution restricted to the set and renormalized
    ids = torch.from_numpy(chains[0])[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, t_last - 1] / 0.8
    expect = logits[support_ids] - torch.logsumexp(logits[support_ids], 0)
    torch.testing.assert_close(last, expect, atol=1e-5, rtol=0)
    # tokens without support keep the full softmax
    del batch["support"], batch["support_offsets"]
    with torch.no_grad():
        full = objective.packed_log_probs(model, batch)
    torch.testing.assert_close(logp[:, :t_last], full[:, :t_last], atol=0, rtol=0)
    assert (full[:, t_last] < last).all()


def test_support_mixed_rows_and_chain_start() -> None:
    model = sharp_model("llama")
    vocab = vocab_size(model)
    chains = random_chains([5, 6, 4], vocab, seed=6)
    layout = [[0, 1], [2]]
    batch = pack_by_hand(chains, layout, width=12)
    # row 0: token 3 of chain 0 and token 2 of chain 1 (column 7); row 1: token 1.
    # A support listed on a chain start (row 0, column 5) must be ignored.
    sets = {
        (0, 3): sorted({int(chains[0][3]), 9, 10, 40}),
        (0, 5): [int(chains[1][0]), 8],
        (0, 7): sorted({int(chains[1][2]), 15}),
        (1, 1): sorted({int(chains[2][1]), 30, 31}),
    }
    add_support(batch, sets)
    with torch.no_grad():
        logp = GRPOObjective().packed_log_probs(model, batch)
    for r, col, n, i in layout_slices(chains, layout):
        ids = torch.from_numpy(chains[i])[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]
        for j in range(n):
            got = logp[r, col + j]
            if j == 0:
                assert got == 0.0
                continue
            norm_ids = sets.get((r, col + j))
            row = logits[j - 1]
            denom = torch.logsumexp(row[norm_ids] if norm_ids else row, 0)
            assert abs(float(got - (row[chains[i][j]] - denom))) < 1e-5, (r, col + j)


# --------------------------------------------------------------------------- pure loss math


def test_behavior_importance_is_truncated_at_cap() -> None:
    diff = torch.tensor([-1.0, 0.0, math.log(1.5), math.log(2.0), math.log(5.0)])
    w = behavior_importance(diff, torch.zeros(5), cap=2.0)
    torch.testing.assert_close(w, torch.tensor([math.exp(-1.0), 1.0, 1.5, 2.0, 2.0]))
    objective = GRPOObjective(importance_cap=3.0)
    torch.testing.assert_close(
        objective.behavior_importance(diff[None], torch.zeros(1, 5)),
        torch.tensor([[math.exp(-1.0), 1.0, 1.5, 2.0, 3.0]]),
    )


def test_decoupled_loss_hand_worked_asymmetric_clip() -> None:
    # clip range [0.8, 1.28]
    ratio = torch.tensor([1.5, 0.5, 0.5, 1.5, 1.25, 1.0, 1.0, 1.0])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0, 1.0, 1.0, 9.0])
    imp = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.5, 3.0, 1.0])  # proximal / behavior
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    proximal = torch.full((8,), -2.0)
    behavior = proximal - imp.log()
    logp = (proximal + ratio.log()).requires_grad_()

    per_token, metrics = decoupled_ppo_loss(
        logp[None], proximal[None], behavior[None], adv[None], mask[None],
        clip=0.2, clip_high=0.28, cap=2.0,
    )  # fmt: skip
    #   A>0 r above 1.28 -> 1.28; A>0 r low -> r; A<0 r low -> 0.8 (clipped);
    #   A<0 r high -> r; A>0 r=1.25 inside the wider upper bound (0.2 alone would clip);
    #   importance 1.5 and 3 -> capped 2; masked token -> 0.
    expect = torch.tensor([-1.28, -0.5, 0.8, 1.5, -2.5, -1.5, -2.0, 0.0])
    torch.testing.assert_close(per_token[0], expect)
    per_token.sum().backward()
    # d/dlogp = -w * A * r where the unclipped branch is taken, 0 where the clip binds
    torch.testing.assert_close(
        logp.grad, torch.tensor([0.0, -0.5, 0.0, 1.5, -2.5, -1.5, -2.0, 0.0])
    )
    assert metrics["trained_tokens"] == 7
    assert metrics["clip_fraction"] == pytest.approx(2 / 7)
    assert metrics["importance_max"] == pytest.approx(3.0)
    assert metrics["importance_mean"] == pytest.approx((5 + 1.5 + 3.0) / 7)
    assert metrics["importance_capped_fraction"] == pytest.approx(1 / 7)
    assert metrics["ratio_mean"] == pytest.approx(float(ratio[:7].mean()))

    # symmetric clip: token 4 (r=1.25, A=2) is now clipped at 1.2
    sym, sym_metrics = decoupled_ppo_loss(
        logp[None].detach(), proximal[None], behavior[None], adv[None], mask[None],
        clip=0.2, clip_high=None, cap=2.0,
    )  # fmt: skip
    assert sym[0, 4] == pytest.approx(-2.4)
    assert sym_metrics["clip_fraction"] == pytest.approx(3 / 7)


def test_mismatch_kl_zero_iff_equal() -> None:
    gen = torch.Generator().manual_seed(0)
    proximal = -torch.rand(3, 10, generator=gen) * 3
    trained = torch.rand(3, 10, generator=gen) > 0.3
    assert mismatch_kl(proximal, proximal.clone(), trained) == 0.0
    behavior = proximal + 0.2 * torch.randn(3, 10, generator=gen)
    kl = mismatch_kl(proximal, behavior, trained)
    d = (proximal - behavior)[trained]
    assert float(kl) == pytest.approx(float((d.exp() - 1 - d).mean()), rel=1e-6)
    assert kl > 0
    # untrained tokens do not count, however far apart
    far = torch.where(trained, proximal, proximal - 50.0)
    assert mismatch_kl(proximal, far, trained) == 0.0


def test_reference_kl_zero_iff_equal_and_masked() -> None:
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 10, generator=gen) * 3
    mask = (torch.rand(3, 10, generator=gen) > 0.3).float()
    assert torch.equal(reference_kl(logp, logp.clone(), mask), torch.zeros(3, 10))
    ref = logp + 0.3 * torch.randn(3, 10, generator=gen)
    kl = reference_kl(logp, ref, mask)
    d = ref - logp
    expected = torch.where(mask > 0, d.exp() - d - 1, torch.zeros_like(d))
    assert torch.allclose(kl, expected) and bool((kl[mask > 0] > 0).all())


def test_kl_to_a_reference_adds_its_term_and_pulls_toward_it() -> None:
    with pytest.raises(ValueError, match=r"kl_coef > 0 needs a reference model"):
        GRPOObjective(kl_coef=0.1)
    model = sharp_model("qwen2", seed=0)
    other = sharp_model("qwen2", seed=1)
    batch = loss_batch(model)
    plain = GRPOObjective()
    loss0, m0 = plain.loss(model, batch)
    # The reference is the model itself: the term and its metric are 0.
    same = GRPOObjective(kl_coef=0.5, reference=sharp_model("qwen2", seed=0))
    loss1, m1 = same.loss(model, batch)
    assert float(loss1.detach()) == pytest.approx(float(loss0.detach()))
    assert m1["kl_reference"] == 0.0
    # Another reference: the loss grows by kl_coef x the masked KL over the batch area.
    far = GRPOObjective(kl_coef=0.5, reference=other)
    loss2, m2 = far.loss(model, batch)
    with torch.no_grad():
        logp = plain.packed_log_probs(model, batch)
        ref = plain.packed_log_probs(other, batch)
    mask = torch.from_numpy(batch["loss_mask"]).float()
    kl = reference_kl(logp, ref, mask) * mask
    expected = float(loss0.detach()) + 0.5 * float(kl.sum()) / mask.numel()
    assert float(loss2.detach()) == pytest.approx(expected, rel=1e-5)
    assert m2["kl_reference"] == pytest.approx(float(kl.sum() / (mask > 0).sum()), rel=1e-5)
    assert "kl_reference" not in m0 and "kl_coef=0.5" in repr(far)
    # A gradient step on the KL term alone lowers it: it pulls toward the reference.
    model.zero_grad()
    (loss2 - loss0.detach()).backward()
    with torch.no_grad():  # a small step along the normalized gradient: first order holds
        norm = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters() if p.grad is not None))
        for p in model.parameters():
            if p.grad is not None:
                p -= 1e-3 * p.grad / norm
        after = reference_kl(plain.packed_log_probs(model, batch), ref, mask) * mask
    assert float(after.sum()) < float(kl.sum())
    assert all(p.grad is None for p in other.parameters())  # the reference stays frozen


# --------------------------------------------------------------------------- loss on a model


def loss_batch(model: torch.nn.Module, *, seed: int = 0) -> dict[str, np.ndarray]:
    chains = random_chains([6, 8, 5, 7, 4], vocab_size(model), seed=seed)
    return pack_by_hand(chains, [[0, 1], [2, 3], [4], []], width=16, seed=seed)


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [
        p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()
    ]


@pytest.mark.parametrize("arch", ARCHS)
def test_on_policy_gradient_equals_reinforce(arch: str) -> None:
    model = sharp_model(arch)
    batch = loss_batch(model, seed=7)
    objective = GRPOObjective(clip=0.1, clip_high=0.3)
    with torch.no_grad():
        current = objective.packed_log_probs(model, batch).numpy()
    batch["proximal_log_probs"] = current.copy()
    batch["behavior_log_probs"] = current.copy()
    normalizer = 37.0

    model.zero_grad()
    loss, metrics = objective.loss(model, batch, normalizer=normalizer)
    loss.backward()
    ppo = grads(model)

    model.zero_grad()
    logp = objective.packed_log_probs(model, batch)
    mask = torch.from_numpy(batch["loss_mask"])
    adv = torch.from_numpy(batch["advantages"])
    reinforce = -(mask * adv * logp).sum() / normalizer
    reinforce.backward()
    ref = grads(model)

    assert any(g.abs().max() > 1e-4 for g in ref)
    for a, b in zip(ppo, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)
    # at ratio 1 and weight 1 the loss value is -sum(mask * adv) / normalizer
    assert loss.item() == pytest.approx(float(-(mask * adv).sum() / normalizer), abs=1e-6)
    assert metrics["mismatch_kl"] == 0.0
    assert metrics["importance_mean"] == pytest.approx(1.0)
    assert metrics["importance_max"] == pytest.approx(1.0)
    assert metrics["clip_fraction"] == 0.0
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["trained_tokens"] == float((mask > 0).sum())


def test_masked_tokens_contribute_no_gradient() -> None:
    model = sharp_model("qwen2")
    batch = loss_batch(model, seed=8)
    rng = np.random.default_rng(8)
    objective = GRPOObjective()
    with torch.no_grad():
        current = objective.packed_log_probs(model, batch).numpy()
    batch["proximal_log_probs"] = current + rng.normal(0, 0.1, current.shape).astype(np.float32)
    batch["behavior_log_probs"] = current + rng.normal(0, 0.3, current.shape).astype(np.float32)

    model.zero_grad()
    loss, metrics = objective.loss(model, batch)
    loss.backward()
    before = grads(model)

    # junk on every untrained token: advantages, behavior and proximal log-probs
    untrained = batch["loss_mask"] == 0
    assert untrained.any() and (~untrained).any()
    perturbed = {k: v.copy() for k, v in batch.items()}
    perturbed["advantages"][untrained] = 1e30
    perturbed["behavior_log_probs"][untrained] = -80.0
    perturbed["proximal_log_probs"][untrained] = 60.0
    model.zero_grad()
    loss2, metrics2 = objective.loss(model, perturbed)
    loss2.backward()
    after = grads(model)

    assert loss2.item() == loss.item()
    assert metrics2 == metrics
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)
    assert all(torch.isfinite(g).all() for g in after)


def test_default_normalizer_is_the_batch_area() -> None:
    model = sharp_model("llama")
    batch = loss_batch(model, seed=9)
    batch["advantages"] *= 3
    objective = GRPOObjective()
    with torch.no_grad():
        default, _ = objective.loss(model, batch)
        explicit, _ = objective.loss(model, batch, normalizer=4 * 16)
        halved, _ = objective.loss(model, batch, normalizer=2 * 4 * 16)
    assert float(default) == float(explicit) != 0.0
    assert float(halved) == pytest.approx(float(default) / 2)
    with pytest.raises(ValueError, match="normalizer"):
        objective.loss(model, batch, normalizer=0.0)


def test_metrics_report_mismatch_importance_and_clipping() -> None:
    model = sharp_model("qwen2")
    batch = loss_batch(model, seed=10)
    objective = GRPOObjective(clip=0.2, importance_cap=2.0)
    with torch.no_grad():
        current = objective.packed_log_probs(model, batch).numpy()
    trained = batch["loss_mask"] > 0
    shift = np.where(np.arange(current.size).reshape(current.shape) % 2 == 0, 1.0, -0.5)
    batch["proximal_log_probs"] = current.copy()
    batch["behavior_log_probs"] = (current - shift).astype(np.float32)  # w = e or e^-0.5
    with torch.no_grad():
        _, metrics = objective.loss(model, batch)
    d = shift[trained]
    assert metrics["mismatch_kl"] == pytest.approx(float(np.mean(np.exp(d) - 1 - d)), rel=1e-5)
    assert metrics["mismatch_kl"] > 0
    assert metrics["importance_max"] == pytest.approx(math.e, rel=1e-5)
    assert metrics["importance_mean"] == pytest.approx(float(np.mean(np.exp(d))), rel=1e-5)
    assert metrics["importance_capped_fraction"] == pytest.approx(float(np.mean(d > 0)))
    assert metrics["clip_fraction"] == 0.0  # current == proximal: ratio 1

    # move the proximal policy so the current one sits outside the trust region
    batch["proximal_log_probs"] = (current - 0.5).astype(np.float32)  # ratio e^0.5 > 1.2
    with torch.no_grad():
        _, metrics = objective.loss(model, batch)
    adv = batch["advantages"][trained]
    assert metrics["clip_fraction"] == pytest.approx(float(np.mean(adv > 0)), rel=1e-6)
    assert metrics["ratio_mean"] == pytest.approx(math.exp(0.5), rel=1e-5)


@pytest.mark.parametrize(
    "knobs", [{"clip": 0.05}, {"clip_high": 0.6}, {"importance_cap": 1.2}, {"temperature": 0.7}]
)
def test_each_knob_of_the_objective_changes_its_loss_as_the_formula_says(knobs: dict) -> None:
    # The ratios and behavior weights straddle every bound: a knob the objective did
    # not pass on to decoupled_ppo_loss (or the log-probs) would leave its loss at the
    # default's value.
    model = sharp_model("qwen2")
    batch = loss_batch(model, seed=11)
    with torch.no_grad():
        current = GRPOObjective().packed_log_probs(model, batch).numpy()
    cells = np.arange(current.size).reshape(current.shape)
    batch["proximal_log_probs"] = (current - np.where(cells % 3 == 0, 0.4, -0.3)).astype(
        np.float32
    )  # ratios e^0.4 (beyond 1 + 0.2, within 1 + 0.6) and e^-0.3
    log_w = np.where(cells % 2 == 0, 0.5, -0.2)  # weights e^0.5 (above 1.2, under 2) and below 1
    batch["behavior_log_probs"] = (batch["proximal_log_probs"] - log_w).astype(np.float32)
    batch["advantages"] = np.where(cells % 5 < 2, -1.5, 1.0).astype(np.float32)
    default = GRPOObjective()
    changed = GRPOObjective(**knobs)
    with torch.no_grad():
        base, _ = default.loss(model, batch)
        loss, _ = changed.loss(model, batch)
        per_token, _ = decoupled_ppo_loss(
            changed.packed_log_probs(model, batch),
            torch.from_numpy(batch["proximal_log_probs"]),
            torch.from_numpy(batch["behavior_log_probs"]),
            torch.from_numpy(batch["advantages"]),
            torch.from_numpy(batch["loss_mask"]),
            clip=changed.clip,
            clip_high=changed.clip_high,
            cap=changed.importance_cap,
        )
    rows, width = batch["tokens"].shape
    assert float(loss) == pytest.approx(float(per_token.sum()) / (rows * width), rel=1e-6)
    assert abs(float(loss) - float(base)) > 1e-4, (knobs, float(loss), float(base))


def _at_current_weights(seed: int) -> tuple[torch.nn.Module, dict, np.ndarray, np.ndarray]:
    """(model, a loss batch whose proximal log-probs are the model's own, so r = 1, those
    log-probs [rows, width], each cell's flat index [rows, width])."""
    model = sharp_model("qwen2")
    batch = loss_batch(model, seed=seed)
    with torch.no_grad():
        current = GRPOObjective().packed_log_probs(model, batch).numpy()
    batch["proximal_log_probs"] = current.astype(np.float32)
    return model, batch, current, np.arange(current.size).reshape(current.shape)


def test_importance_mask_drops_the_tokens_outside_the_band_from_the_objectives_loss() -> None:
    model, batch, current, cells = _at_current_weights(seed=12)
    log_w = np.select([cells % 3 == 0, cells % 3 == 1], [1.0, -1.0], 0.3)  # e, 1/e, in band
    batch["behavior_log_probs"] = (current - log_w).astype(np.float32)
    batch["advantages"] = np.where(cells % 4 == 0, -1.0, 0.5).astype(np.float32)
    with torch.no_grad():
        masked, stats = GRPOObjective(importance="mask").loss(model, batch)
        truncated, _ = GRPOObjective().loss(model, batch)
    trained = batch["loss_mask"] > 0
    # r = 1 (the proximal policy is the current one), so a token's term is -w * A
    kept = (cells % 3 == 2) & trained
    rows, width = current.shape
    want = -(math.exp(0.3) * batch["advantages"][kept].astype(np.float64)).sum() / (rows * width)
    assert float(masked) == pytest.approx(want, rel=1e-5)
    assert abs(float(masked) - float(truncated)) > 1e-4
    share = float(np.mean((cells % 3 != 2)[trained]))
    assert stats["importance_capped_fraction"] == pytest.approx(share, rel=1e-6)


def test_importance_sequence_weighs_each_packed_chain_by_its_product() -> None:
    model, batch, current, cells = _at_current_weights(seed=13)
    log_w = np.where(cells % 2 == 0, 0.3, -0.1)
    batch["behavior_log_probs"] = (current - log_w).astype(np.float32)
    batch["advantages"] = np.where(cells % 3 == 0, -1.0, 0.5).astype(np.float32)
    with torch.no_grad():
        got, _ = GRPOObjective(importance="sequence").loss(model, batch)
        truncated, _ = GRPOObjective().loss(model, batch)
    # by hand: each chain's trained log w summed, e^sum truncated at 2, times -A (r = 1)
    trained = batch["loss_mask"] > 0
    segments, rows_width = batch["segments"], current.shape
    want = 0.0
    for row in range(rows_width[0]):
        for chain in set(segments[row][segments[row] > 0].tolist()):
            mine = (segments[row] == chain) & trained[row]
            weight = min(math.exp(float(log_w[row][mine].sum())), 2.0)
            want -= weight * float(batch["advantages"][row][mine].astype(np.float64).sum())
    assert float(got) == pytest.approx(want / (rows_width[0] * rows_width[1]), rel=1e-4)
    assert abs(float(got) - float(truncated)) > 1e-4


@pytest.mark.parametrize("rule", [True, "both", "negative"])
def test_clip_behavior_stops_the_tokens_that_moved_past_the_band_since_sampling(
    rule: bool | str,
) -> None:
    model, batch, current, cells = _at_current_weights(seed=14)
    # r = 1, so pi_theta / pi_behavior is the behavior weight w: e^0.4 (past 1 + 0.28),
    # e^-0.4 (under 1 - 0.2) and e^0.1 (inside the band)
    log_w = np.select([cells % 3 == 0, cells % 3 == 1], [0.4, -0.4], 0.1)
    batch["behavior_log_probs"] = (current - log_w).astype(np.float32)
    batch["advantages"] = np.where(cells % 4 < 2, -1.0, 0.5).astype(np.float32)
    with torch.no_grad():
        got, stats = GRPOObjective(clip_high=0.28, clip_behavior=rule).loss(model, batch)
        plain, plain_stats = GRPOObjective(clip_high=0.28).loss(model, batch)
    trained = batch["loss_mask"] > 0
    adv = batch["advantages"].astype(np.float64)
    # by hand: a token whose probability rose past the band and whose advantage pushes
    # it up (or fell under it, pushed down) adds nothing; the rest add -w * A.
    # "negative" stops only the second kind.
    up = trained & (cells % 3 == 0) & (adv > 0)
    down = trained & (cells % 3 == 1) & (adv < 0)
    both = up | down
    past = down if rule == "negative" else both
    assert up.any() and down.any()
    kept = trained & ~past
    rows, width = current.shape
    want = -(np.exp(log_w[kept]) * adv[kept]).sum() / (rows * width)
    assert float(got) == pytest.approx(want, rel=1e-5)
    assert abs(float(got) - float(plain)) > 1e-4
    share = float(past.sum() / trained.sum())
    assert 0 < share < 1
    # the metric counts the tokens the rule stops; off, the ones the two-sided rule would
    assert stats["behavior_clip_fraction"] == pytest.approx(share, rel=1e-6)
    both_share = float(both.sum() / trained.sum())
    assert plain_stats["behavior_clip_fraction"] == pytest.approx(both_share, rel=1e-6)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"clip": 0.0}, "clip"),
        ({"clip": -0.1}, "clip"),
        ({"clip": float("nan")}, "clip"),
        ({"clip_high": 0.0}, "clip_high"),
        ({"clip_high": float("inf")}, "clip_high"),
        ({"importance_cap": 0.5}, "importance_cap"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"kl_coef": -0.1}, "kl_coef"),
        ({"kl_coef": float("nan")}, "kl_coef"),
        ({"clip_behavior": 1}, "clip_behavior"),
        ({"clip_behavior": "positive"}, "clip_behavior"),
    ],
)
def test_constructor_rejects_bad_parameters(kwargs: dict[str, float], name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must"):
        GRPOObjective(**kwargs)


def test_bad_batches_name_the_field() -> None:
    model = sharp_model("qwen2")
    batch = loss_batch(model)
    objective = GRPOObjective()
    missing = {k: v for k, v in batch.items() if k != "segments"}
    with pytest.raises(ValueError, match="'segments'"):
        objective.packed_log_probs(model, missing)
    wrong = dict(batch, positions=batch["positions"][:, :-1])
    with pytest.raises(ValueError, match="'positions'"):
        objective.packed_log_probs(model, wrong)
    no_adv = {k: v for k, v in batch.items() if k != "advantages"}
    with pytest.raises(ValueError, match="'advantages'"):
        objective.loss(model, no_adv)
    add_support(batch, {(0, 3): [7, 8]})
    bad_offsets = dict(batch, support_offsets=batch["support_offsets"][:, :-1])
    with pytest.raises(ValueError, match="'support_offsets'"):
        objective.packed_log_probs(model, bad_offsets)


def test_refuses_attention_without_dense_masks() -> None:
    model = sharp_model("llama")
    model.config._attn_implementation = "flash_attention_2"  # never run; refused before
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2'"):
        GRPOObjective().packed_log_probs(model, loss_batch(model))
