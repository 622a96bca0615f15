"""Support given as numpy arrays: pack reads a 2-D ``[n, k]`` array (top-k) with one
reshape, and anything else (lists, or a ragged top-p support held as a 1-D object
array) row by row. Both paths must give the same layout as plain lists."""

from __future__ import annotations

import numpy as np

from dew.objectives.rl.pack import pack

from .test_pack import call, rollout


def test_2d_support_with_more_tokens_than_k_across_chains() -> None:
    # Call 0: 3 tokens, top-2 (a [3, 2] array); call 1 opens a new chain: 1 token, top-3.
    # The per-token counts are [2, 2, 2] then [3]: counting k rows of n ids instead of n
    # rows of k ids would shift the second chain's ids into the first.
    calls = [
        call([1], [2, 3, 4], support=np.array([[2, 9], [3, 8], [4, 7]])),
        call([5], [6], support=np.array([[6, 1, 2]])),
    ]
    batch, stats = pack([[rollout(0, 0, calls)]], rows=2, width=4, support_capacity=6)
    assert stats.packed == (0,)
    np.testing.assert_array_equal(batch["tokens"], [[1, 2, 3, 4], [5, 6, 0, 0]])
    np.testing.assert_array_equal(batch["support"], [[2, 9, 3, 8, 4, 7], [6, 1, 2, -1, -1, -1]])
    np.testing.assert_array_equal(batch["support_offsets"], [[0, 0, 2, 4, 6], [0, 0, 3, 3, 3]])


def test_ragged_support_as_a_1d_object_array() -> None:
    # Top-p supports differ in size per token; an engine may hand them over as a 1-D
    # object array of lists. It is not [n, k]: it must be read row by row.
    ragged = np.empty(3, dtype=object)
    ragged[0], ragged[1], ragged[2] = [2, 5, 6], [3], [4, 9]
    calls = [call([1], [2, 3, 4], support=ragged)]
    batch, _ = pack([[rollout(0, 0, calls)]], rows=1, width=5, support_capacity=8)
    np.testing.assert_array_equal(batch["tokens"], [[1, 2, 3, 4, 0]])
    np.testing.assert_array_equal(batch["support"], [[2, 5, 6, 3, 4, 9, -1, -1]])
    np.testing.assert_array_equal(batch["support_offsets"], [[0, 0, 3, 4, 6, 6]])
