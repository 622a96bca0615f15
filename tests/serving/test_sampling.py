"""The engine's batched sampler: per-row settings, exact log-probs, supports, frequencies."""

from __future__ import annotations

import math

import pytest
import torch

from dew.serving._sampling import sample, settings


def test_mixed_rows_in_one_batch() -> None:
    logits = torch.tensor(
        [
            [2.0, 1.0, 0.5, -1.0, 0.0],  # greedy
            [2.0, 1.0, 0.5, -1.0, 0.0],  # plain sampling, T=0.5
            [2.0, 1.0, 0.5, -1.0, 0.0],  # top-k 2
            [0.0, 3.0, 2.9, -5.0, 1.0],  # top-p 0.5 at T=1
            [1.0, 1.0, 1.0, 1.0, 1.0],  # top-k larger than the vocabulary: not a filter
        ]
    )
    rows = settings(
        [0.0, 0.5, 1.0, 1.0, 1.0],
        [None, None, 2, None, 50],
        [None, None, None, 0.5, None],
        5,
        torch.device("cpu"),
    )
    draw = sample(logits, rows, torch.Generator().manual_seed(0))
    assert draw.tokens[0] == 0 and draw.log_probs[0] == 0.0 and draw.support[0] == [0]
    assert draw.support[1] is None and draw.support[4] is None
    assert draw.log_probs[1] == torch.log_softmax(logits[1] / 0.5, 0)[draw.tokens[1]].item()
    assert sorted(draw.support[2] or []) == [0, 1]
    assert draw.tokens[2] in (0, 1)
    p2 = torch.log_softmax(logits[2, :2], 0)
    assert math.isclose(draw.log_probs[2], p2[draw.tokens[2]].item(), rel_tol=1e-6)
    # softmax([0, 3, 2.9, -5, 1]): token 1 alone holds < 0.5, so 1 and 2 are kept.
    assert draw.support[3] == [1, 2]
    p3 = torch.log_softmax(logits[3, [1, 2]], 0)
    assert math.isclose(draw.log_probs[3], p3[[1, 2].index(draw.tokens[3])].item(), rel_tol=1e-6)
    assert math.isclose(draw.log_probs[4], math.log(1 / 5), rel_tol=1e-6)


def test_draw_frequencies_follow_the_reported_log_probs() -> None:
    """Many draws from one row: the empirical frequencies match exp(log_prob), and
    nothing is drawn outside the support."""
    n = 20_000
    row = torch.tensor([1.5, 1.0, 0.7, 0.2, -0.3, -2.0])
    logits = row.repeat(n, 1)  # [n, 6]
    rows = settings([0.8] * n, [4] * n, [0.9] * n, 6, torch.device("cpu"))
    draw = sample(logits, rows, torch.Generator().manual_seed(1))
    support = draw.support[0]
    assert support is not None and all(s == support for s in draw.support)
    assert set(draw.tokens) <= set(support)
    for tok in support:
        freq = draw.tokens.count(tok) / n
        prob = math.exp(draw.log_probs[draw.tokens.index(tok)])
        assert abs(freq - prob) < 0.015, (tok, freq, prob)
    assert math.isclose(
        sum(math.exp(draw.log_probs[draw.tokens.index(t)]) for t in support), 1.0, rel_tol=1e-5
    )


def test_same_seed_same_draws() -> None:
    logits = torch.randn(8, 30, generator=torch.Generator().manual_seed(3))
    rows = settings([1.0] * 8, [None] * 8, [None] * 8, 30, torch.device("cpu"))
    a = sample(logits, rows, torch.Generator().manual_seed(7))
    b = sample(logits, rows, torch.Generator().manual_seed(7))
    assert a.tokens == b.tokens and a.log_probs == b.log_probs


def test_top_k_alone_keeps_k_tokens_however_small_their_mass() -> None:
    """After a dominant token the others hold ~2e-9 each, below float32 resolution of the
    cumulative mass (it rounds to 1.0). Top-k without top-p must still keep all k, as
    Hugging Face's top-k does; a top-p row does cut them. (The sampler used to drop them
    because "top-p off" was a cut at mass 1.0.)"""
    logits = torch.tensor([[20.0, 0.0, 0.0, -1.0, -2.0]] * 3)
    rows = settings([1.0] * 3, [3, 3, None], [None, 1.0, 0.9], 5, torch.device("cpu"))
    draw = sample(logits, rows, torch.Generator().manual_seed(0))
    assert draw.support[0] is not None and sorted(draw.support[0]) == [0, 1, 2]
    assert draw.support[1] is not None and sorted(draw.support[1]) == [0, 1, 2]
    assert draw.support[2] == [0]
    assert draw.tokens[2] == 0 and draw.log_probs[2] == 0.0
    # the top-k rows report the log-prob renormalized over the three, not over one
    want = torch.log_softmax(logits[0, :3], dim=0)
    for i in (0, 1):
        assert draw.log_probs[i] == pytest.approx(want[draw.tokens[i]].item(), rel=1e-6)
