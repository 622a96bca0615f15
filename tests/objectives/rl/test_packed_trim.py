"""The packed forward runs only over the rows and columns that hold tokens.

A fixed-shape batch of short chains is mostly padding; the forward trims it and must
give exactly what the whole batch gives: the same log-probs, zeros in the padding, the
same gradients, with and without support sets.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dew.objectives.rl.grpo import GRPOObjective

from .test_grpo import add_support, pack_by_hand, random_chains, sharp_model, vocab_size


def widened(batch: dict[str, np.ndarray], rows: int, width: int) -> dict[str, np.ndarray]:
    """``batch`` inside a larger one: ``rows`` padding rows on top, padding columns right."""
    old_rows, old_width = batch["tokens"].shape
    out: dict[str, np.ndarray] = {}
    for key, value in batch.items():
        if key == "support":
            out[key] = np.concatenate([np.full((rows, value.shape[1]), -1, value.dtype), value])
            continue
        if key == "support_offsets":  # no ids for the new columns: repeat each row's end
            ends = np.repeat(value[:, -1:], width - old_width, axis=1)
            grown = np.concatenate([value, ends], axis=1)
            out[key] = np.concatenate([np.zeros((rows, width + 1), value.dtype), grown])
            continue
        fill = 0 if key == "segments" else 9  # junk ids and positions in the padding
        big = np.full((rows + old_rows, width), fill, value.dtype)
        big[rows:, :old_width] = value
        out[key] = big
    return out


def forward_shapes(model: torch.nn.Module) -> tuple[list[tuple[int, ...]], object]:
    calls: list[tuple[int, ...]] = []
    handle = model.register_forward_hook(lambda m, a, out: calls.append(tuple(out.logits.shape)))
    return calls, handle


@pytest.mark.parametrize("support", [False, True])
def test_padding_rows_and_columns_change_nothing_and_cost_nothing(support: bool) -> None:
    model = sharp_model("qwen2")
    chains = random_chains([5, 9, 4, 7], vocab_size(model), seed=3)
    small = pack_by_hand(chains, [[0, 1], [2], [3]], width=20)
    if support:
        add_support(small, {(0, 3): [11, 23, 37], (1, 2): [5, 6], (2, 6): [40, 41, 42]})
    big = widened(small, rows=5, width=100)
    objective = GRPOObjective()
    calls, handle = forward_shapes(model)
    try:
        want = objective.packed_log_probs(model, small)  # [3, 20]
        want.sum().backward()
        want_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        got = objective.packed_log_probs(model, big)  # [8, 100]
        got.sum().backward()
        got_grads = [p.grad.clone() for p in model.parameters()]
    finally:
        handle.remove()
    vocab = vocab_size(model)
    # 14 columns used, rounded up to 16 but never past the batch: the small batch runs
    # whole, the big one as its 3 rows with tokens x 16 columns
    assert calls == [(3, 16, vocab), (3, 16, vocab)]
    assert got.shape == (8, 100)
    torch.testing.assert_close(got[5:, :20], want, atol=1e-5, rtol=0)
    assert (got[:5] == 0).all() and (got[:, 20:] == 0).all()
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def test_a_batch_without_tokens_runs_the_smallest_forward() -> None:
    """Every process of a sharded model must join the forward, tokens or not, and the
    loss needs a graph to call backward on."""
    model = sharp_model("llama")
    empty = pack_by_hand([], [[], []], width=40)
    calls, handle = forward_shapes(model)
    try:
        logp = GRPOObjective().packed_log_probs(model, empty)
    finally:
        handle.remove()
    assert calls == [(1, 16, vocab_size(model))]
    assert logp.shape == (2, 40) and (logp == 0).all() and logp.requires_grad
    logp.sum().backward()


def test_the_trimmed_width_never_exceeds_the_batch() -> None:
    model = sharp_model("qwen2")
    chains = random_chains([10, 13], vocab_size(model), seed=1)
    batch = pack_by_hand(chains, [[0], [1]], width=13)  # 13 used of 13: no rounding up
    calls, handle = forward_shapes(model)
    try:
        GRPOObjective().packed_log_probs(model, batch)
        GRPOObjective().packed_log_probs(model, widened(batch, rows=0, width=40))
    finally:
        handle.remove()
    assert calls == [(2, 13, vocab_size(model)), (2, 16, vocab_size(model))]
