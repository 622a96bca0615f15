"""The chain layout plan: finding the chains of packed rows and bucketing them by length.

Pure numpy, no model: the plan is exhaustively checked here, and the forward that
carries it out in test_packed_layouts.py.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dew.objectives.rl._chain_layout import Costs, chain_buckets, find_chains

COSTS = Costs(token=1000.0, cell=10.0, call=50_000.0)


def packed(rows: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Segments and positions of rows holding chains of the given lengths back to back."""
    segments = np.zeros((len(rows), width), np.int64)
    positions = np.full((len(rows), width), 5, np.int64)  # junk in the padding
    for r, lengths in enumerate(rows):
        col = 0
        for s, n in enumerate(lengths, start=1):
            segments[r, col : col + n] = s
            positions[r, col : col + n] = np.arange(n)
            col += n
    return segments, positions


def test_find_chains_hand_worked() -> None:
    segments, positions = packed([[3, 2], [4], [], [1, 1, 1]], width=6)
    starts, lengths = find_chains(segments, positions)
    assert starts.tolist() == [0, 3, 6, 18, 19, 20]  # flat slots of [4, 6]
    assert lengths.tolist() == [3, 2, 4, 1, 1, 1]


def test_a_row_that_ends_on_a_chain_and_a_row_that_starts_one_are_two_chains() -> None:
    segments, positions = packed([[4], [4]], width=4)  # segment 1 at the end and the start
    starts, lengths = find_chains(segments, positions)
    assert starts.tolist() == [0, 4] and lengths.tolist() == [4, 4]


def test_nothing_to_find_and_what_only_the_rows_can_score() -> None:
    segments, positions = packed([[], []], width=4)
    assert find_chains(segments, positions) is None  # no chain at all
    segments, positions = packed([[3, 2]], width=6)
    gap = segments.copy()
    gap[0, 3:5] = 1  # segment 1 again after segment 2: one chain with a gap
    assert find_chains(gap, positions) is None
    shifted = positions.copy()
    shifted[0, :3] += 4  # positions that do not count up from 0
    assert find_chains(segments, shifted) is None
    skipping = positions.copy()
    skipping[0, 2] = 5  # a position skipped inside a chain
    assert find_chains(segments, skipping) is None


def brute_force(lengths: list[int], costs: Costs) -> float:
    """The cheapest split of the sorted distinct lengths into contiguous buckets."""
    values = sorted(set(lengths))
    counts = [lengths.count(v) for v in values]
    best = float("inf")
    for cuts in itertools.product([False, True], repeat=len(values) - 1):
        total, count = 0.0, 0
        for i, v in enumerate(values):
            count += counts[i]
            if i == len(values) - 1 or cuts[i]:
                total += costs.block(count, v)
                count = 0
        best = min(best, total)
    return best


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 60), min_size=1, max_size=14),
    st.sampled_from([COSTS, Costs(token=10.0, cell=50.0, call=100.0), Costs(1.0, 0.0, 1e9)]),
)
def test_buckets_cover_every_chain_once_in_length_order_at_the_least_cost(
    lengths: list[int], costs: Costs
) -> None:
    array = np.array(lengths)
    buckets, cost = chain_buckets(array, costs)
    members = np.concatenate([b.chains for b in buckets])
    assert sorted(members.tolist()) == list(range(len(lengths)))  # each chain once
    for b in buckets:
        assert b.width == array[b.chains].max()  # as wide as its longest chain
    for a, b in itertools.pairwise(buckets):  # no shorter chain waits in a wider bucket
        assert array[a.chains].max() < array[b.chains].min()
    assert cost == pytest.approx(sum(costs.block(len(b.chains), b.width) for b in buckets))
    assert cost == pytest.approx(brute_force(lengths, costs))


def test_expensive_calls_make_one_bucket_and_expensive_attention_many() -> None:
    lengths = np.array([10, 11, 12, 200, 210, 220])
    one, _ = chain_buckets(lengths, Costs(token=1.0, cell=0.0, call=1e9))
    assert [b.width for b in one] == [220]
    many, _ = chain_buckets(lengths, Costs(token=1.0, cell=1.0, call=10.0))
    assert [b.width for b in many] == [10, 11, 12, 200, 210, 220]


def test_costs_of_a_config_count_layers_heads_and_vocabulary() -> None:
    config = SimpleNamespace(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=100,
    )
    costs = Costs.of(config)
    assert costs is not None
    # q, o: 64 x 64 each; k, v: 64 x 32 each; MLP 3 x 64 x 128; the LM head 64 x 100
    per_layer = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128)
    assert costs.token == 2 * per_layer + 2 * 64 * 100
    deeper = Costs.of(SimpleNamespace(**{**vars(config), "num_hidden_layers": 4}))
    assert deeper is not None and deeper.cell == 2 * costs.cell and deeper.call > costs.call
    assert Costs.of(SimpleNamespace(hidden_size=64)) is None  # not a transformer config
    assert Costs.of(None) is None
