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


CPU = torch.device("cpu")


def test_plain_batch_reports_each_rows_own_log_prob() -> None:
    """The fast path (no greedy, no filtered row): one token per row, its log-prob under
    that row's own tempered softmax, and no support."""
    logits = torch.tensor([[2.0, 0.0, -1.0, 0.5], [-3.0, 1.0, 1.0, 4.0], [0.0, 0.0, 0.0, 9.0]])
    temps = [1.0, 0.5, 2.0]
    rows = settings(temps, [None] * 3, [None] * 3, 4, CPU)
    assert not (rows.any_greedy or rows.any_filtered)
    draw = sample(logits, rows, torch.Generator().manual_seed(0))
    assert draw.support == [None, None, None]
    assert len(draw.tokens) == 3 and all(isinstance(t, int) for t in draw.tokens)
    for i, (tok, t) in enumerate(zip(draw.tokens, temps, strict=True)):
        want = torch.log_softmax(logits[i] / t, dim=0)[tok].item()  # over the vocabulary
        assert math.isclose(draw.log_probs[i], want, rel_tol=1e-6), (i, tok)


def test_greedy_rows_take_their_own_argmax() -> None:
    # Two greedy rows whose argmax differ (column 3, then column 1), around a plain row.
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0], [9.0, 9.0, 9.0, 9.0], [3.0, 7.0, 1.0, 2.0]])
    rows = settings([0.0, 1.0, 0.0], [None] * 3, [None] * 3, 4, CPU)
    draw = sample(logits, rows, torch.Generator().manual_seed(0))
    assert (draw.tokens[0], draw.tokens[2]) == (3, 1)
    assert (draw.log_probs[0], draw.log_probs[2]) == (0.0, 0.0)
    assert (draw.support[0], draw.support[1], draw.support[2]) == ([3], None, [1])
    assert math.isclose(draw.log_probs[1], math.log(1 / 4), rel_tol=1e-6)  # uniform row


def test_top_k_one_keeps_only_the_argmax() -> None:
    logits = torch.tensor([[0.5, -1.0, 2.5, 2.0, 0.0]] * 2)
    rows = settings([1.0, 3.0], [1, 1], [None, None], 5, CPU)
    assert rows.filtered.tolist() == [True, True]
    draw = sample(logits, rows, torch.Generator().manual_seed(0))
    # A set of one: the argmax, drawn with certainty at any temperature.
    assert draw.tokens == [2, 2] and draw.log_probs == [0.0, 0.0]
    assert draw.support == [[2], [2]]


def test_top_k_equal_to_the_vocabulary_is_no_filter() -> None:
    rows = settings([1.0, 1.0], [5, 4], [None, 1.0], 5, CPU)
    assert rows.top_k.tolist() == [0, 4] and rows.top_p.tolist() == [1.0, 1.0]
    assert rows.filtered.tolist() == [False, True]
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]] * 2)
    draw = sample(logits, rows, torch.Generator().manual_seed(0))
    assert draw.support[0] is None  # top_k=5 of 5 keeps everything: a plain row
    assert draw.support[1] == [4, 3, 2, 1]


def test_top_p_stops_where_the_kept_mass_reaches_it() -> None:
    """Uniform over 4: ranks hold exactly 0.25 each, so the mass above rank 2 equals 0.5.
    The nucleus is the smallest set with mass >= top_p: two tokens for 0.5, not three."""
    logits = torch.zeros(3, 4)
    rows = settings([1.0] * 3, [None] * 3, [0.5, 0.25, 0.6], 4, CPU)
    draw = sample(logits, rows, torch.Generator().manual_seed(0))
    assert [len(s or []) for s in draw.support] == [2, 1, 3]
    for s, tok in zip(draw.support, draw.tokens, strict=True):
        assert s is not None and tok in s
    assert draw.log_probs[1] == 0.0
    assert math.isclose(draw.log_probs[0], math.log(1 / 2), rel_tol=1e-6)
    assert math.isclose(draw.log_probs[2], math.log(1 / 3), rel_tol=1e-6)


def test_top_k_alone_keeps_k_tokens_however_small_their_mass() -> None:
    """After a dominant token the others hold ~2e-9 each, below float32 resolution of the
    cumulative mass (it rounds to 1.0). Top-k without top-p must still keep all k, as
    Hugging Face's top-k does; a top-p row does cut them. (The sampler used to drop them
    because "top-p off" was a cut at mass 1.0.)"""
    logits = torch.tensor([[20.0, 0.0, 0.0, -1.0, -2.0]] * 3)
    rows = settings([1.0] * 3, [3, 3, None], [None, 1.0, 0.9], 5, CPU)
    draw = sample(logits, rows, torch.Generator().manual_seed(0))
    assert draw.support[0] is not None and sorted(draw.support[0]) == [0, 1, 2]
    assert draw.support[1] is not None and sorted(draw.support[1]) == [0, 1, 2]
    assert draw.support[2] == [0]
    assert draw.tokens[2] == 0 and draw.log_probs[2] == 0.0
    # the top-k rows report the log-prob renormalized over the three, not over one
    want = torch.log_softmax(logits[0, :3], dim=0)
    for i in (0, 1):
        assert draw.log_probs[i] == pytest.approx(want[draw.tokens[i]].item(), rel=1e-6)


def test_mixed_batch_draws_come_from_the_generator() -> None:
    """In a batch with greedy, plain and filtered rows, every sampled row draws from the
    given generator: the same seed repeats the batch, another seed changes it."""
    n = 16
    logits = torch.zeros(1 + 2 * n, 50)  # uniform: every draw is a coin of 50 (or 20) sides
    temps = [0.0] + [1.0] * (2 * n)
    top_k: list[int | None] = [None] * (1 + n) + [20] * n
    rows = settings(temps, top_k, [None] * (1 + 2 * n), 50, CPU)
    a = sample(logits, rows, torch.Generator().manual_seed(11))
    b = sample(logits, rows, torch.Generator().manual_seed(11))
    c = sample(logits, rows, torch.Generator().manual_seed(12))
    assert a.tokens == b.tokens and a.log_probs == b.log_probs
    plain, filtered = slice(1, 1 + n), slice(1 + n, None)
    assert a.tokens[plain] != c.tokens[plain] and a.tokens[filtered] != c.tokens[filtered]


def test_sampler_tensors_follow_the_requested_and_logits_device() -> None:
    """Nothing is allocated on torch's default device: settings use ``device`` and sample
    uses the logits' device. On a GPU server the default device is the CPU; here the
    default is switched to "meta" to make a stray allocation fail on CPU-only machines."""
    temps, top_k, top_p = [0.0, 1.0, 0.7, 1.0], [None, None, 3, None], [None, None, None, 0.8]
    logits = torch.randn(4, 7, generator=torch.Generator().manual_seed(0))
    rows = settings(temps, top_k, top_p, 7, CPU)
    want = sample(logits, rows, torch.Generator().manual_seed(1))
    plain_rows = settings([1.0, 0.5], [None, None], [None, None], 7, CPU)
    want_plain = sample(logits[:2], plain_rows, torch.Generator().manual_seed(1))
    with torch.device("meta"):
        in_meta = settings(temps, top_k, top_p, 7, CPU)
        for t in (in_meta.temperature, in_meta.top_k, in_meta.top_p):
            assert t.device == CPU
        assert in_meta.greedy.device == CPU and in_meta.filtered.device == CPU
        assert sample(logits, rows, torch.Generator().manual_seed(1)) == want
        assert sample(logits[:2], plain_rows, torch.Generator().manual_seed(1)) == want_plain
    assert want.support[2] is not None and want.support[3] is not None  # filters ran


def test_settings_refuse_lists_of_different_lengths() -> None:
    # One value per row in each list: a short list must not silently drop rows.
    with pytest.raises(ValueError, match=r"zip\(\) argument 2 is longer than argument 1"):
        settings([1.0, 1.0], [None], [None, None], 5, CPU)  # top_k short
    with pytest.raises(ValueError, match=r"zip\(\) argument 2 is shorter than argument 1"):
        settings([1.0, 1.0], [None, None], [None], 5, CPU)  # top_p short
    with pytest.raises(ValueError, match=r"zip\(\) argument 3 is shorter than arguments 1-2"):
        settings([1.0], [None, None], [None, None], 5, CPU)  # temperature short


def test_greedy_rows_get_a_finite_divisor() -> None:
    # Temperature 0 is a greedy marker, not a divisor: scaling a batch by its row
    # temperatures must not produce inf or NaN on greedy rows.
    rows = settings([0.0, 0.7], [None, None], [None, None], 3, CPU)
    assert rows.greedy.tolist() == [True, False] and rows.any_greedy
    scaled = torch.tensor([[1.0, -2.0, 0.0]] * 2) / rows.temperature.unsqueeze(1)
    assert torch.isfinite(scaled).all()
    assert rows.temperature[1].item() == pytest.approx(0.7)


@pytest.mark.parametrize("mixed", [False, True])
def test_a_row_that_is_not_finite_is_named_and_the_others_draw_as_usual(mixed: bool) -> None:
    vocab = 40
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3))
    top_k = [None, 5 if mixed else None, None, None]
    temps = [1.0, 0.7, 1e-300, 0.9]  # row 2: finite logits, overflowed by its temperature
    bad = logits.clone()
    bad[3, 7] = float("nan")  # row 3: its logits themselves
    rows = settings(temps, top_k, [None] * 4, vocab, torch.device("cpu"))
    draw = sample(bad, rows, torch.Generator().manual_seed(0))
    assert (draw.overflowed, draw.broken) == ([2], [3])
    # The good rows' log-probs are those of their own distributions.
    for i in (0, 1):
        scaled = logits[i] / temps[i]
        if top_k[i] is not None:
            keep = scaled.topk(top_k[i]).indices
            scaled = torch.full_like(scaled, float("-inf")).index_copy(0, keep, scaled[keep])
        want = scaled.log_softmax(-1)[draw.tokens[i]].item()
        assert draw.log_probs[i] == pytest.approx(want, abs=1e-5)
    rows = settings(temps[:2], top_k[:2], [None] * 2, vocab, torch.device("cpu"))
    fine = sample(logits[:2], rows, torch.Generator())
    assert fine.broken == fine.overflowed == []
