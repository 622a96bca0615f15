"""pack against the reference implementation it replaced (``_pack_reference``): on
hypothesis-drawn groups (single- and multi-turn rollouts, chains that extend or restart,
truncations under every policy, every estimator, tokens as lists or numpy arrays,
support as lists or ``[n, k]`` arrays, batches tight enough to cut groups) both give
the same arrays, dtypes and stats, or refuse with the same message."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dew.core import Call, Rollout, RolloutKey, Status
from dew.objectives.rl.pack import ESTIMATORS, pack

from . import _pack_reference
from .test_pack import TASK


@st.composite
def rollout_st(draw, group: int, sample: int, support: bool, unscored: bool) -> Rollout:
    tok = st.integers(1, 50)
    as_array = draw(st.booleans())
    calls, history = [], []
    for i in range(draw(st.integers(1, 3))):
        extend = i > 0 and draw(st.booleans())
        fresh = draw(st.lists(tok, min_size=0 if extend else 1, max_size=5))
        prompt = history + fresh if extend else fresh
        completion = draw(st.lists(tok, min_size=1, max_size=6))
        log_probs = [-draw(st.integers(0, 999)) / 37 for _ in completion]
        rows = None
        if support:
            k = draw(st.integers(1, 3))
            rows = [[t, *draw(st.lists(tok, min_size=k - 1, max_size=k - 1))] for t in completion]
            if draw(st.booleans()):
                rows = np.array(rows, dtype=np.int64)  # [n, k] top-k
        history = prompt + completion
        if as_array:
            prompt, completion = np.array(prompt), np.array(completion)
            log_probs = np.array(log_probs, dtype=draw(st.sampled_from([np.float32, np.float64])))
        calls.append(
            Call(prompt, completion, log_probs, version=draw(st.integers(0, 5)), support=rows)
        )
    status = draw(st.sampled_from([Status.COMPLETED, Status.AGENT_ERROR, Status.TRUNCATED]))
    reward = None if unscored and draw(st.booleans()) else float(draw(st.integers(-3, 3))) / 2
    return Rollout(
        RolloutKey(group, sample, 0),
        TASK,
        status,
        tuple(calls),
        reward=reward,
        truncation="length" if status is Status.TRUNCATED else None,
    )


@st.composite
def case_st(draw):
    support = draw(st.booleans())
    unscored = draw(st.integers(0, 9)) == 0  # some rollouts lack a reward: refusals
    groups = [
        [draw(rollout_st(g, s, support, unscored)) for s in range(draw(st.integers(0, 4)))]
        for g in range(draw(st.integers(0, 6)))
    ]
    kwargs = {
        "rows": draw(st.integers(1, 8)),
        "width": draw(st.integers(4, 64)),
        "estimator": draw(st.sampled_from(sorted(ESTIMATORS))),
        "truncation": draw(st.sampled_from(["mask", "score", "zero"])),
    }
    if support:
        kwargs["support_capacity"] = draw(st.integers(1, 120))
    if draw(
        st.sampled_from([True, True, True, False])
    ):  # mostly: leave out the groups that could never fit
        groups = [
            g for g in groups if not isinstance(outcome(_pack_reference.pack, [g], kwargs), str)
        ]
    return groups, kwargs


def outcome(fn, groups, kwargs):
    try:
        return fn(groups, **kwargs)
    except ValueError as exc:
        return str(exc)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case_st())
def test_pack_equals_the_reference(case):
    groups, kwargs = case
    got = outcome(pack, groups, kwargs)
    want = outcome(_pack_reference.pack, groups, kwargs)
    if isinstance(want, str) or isinstance(got, str):
        assert got == want
        return
    (batch, stats), (ref, ref_stats) = got, want
    assert dataclasses.astuple(stats) == dataclasses.astuple(ref_stats)
    assert list(batch) == list(ref)
    for name, arr in ref.items():
        assert batch[name].dtype == arr.dtype, name
        np.testing.assert_array_equal(batch[name], arr, err_msg=name)


@pytest.mark.parametrize("top_k", [None, 3])
def test_a_large_batch_equals_the_reference(top_k):
    # Thousands of chains over dozens of rows, some groups cut: first fit among many
    # partly filled rows; with top-k support, its own room per row as well.
    rng = np.random.default_rng(0)
    groups = []
    for g in range(96):
        members = []
        for s in range(8):
            calls = []
            for n in rng.integers(1, 120, rng.integers(1, 3)):
                completion = rng.integers(0, 1000, n)
                support = None
                if top_k is not None:
                    support = np.concatenate(
                        [completion[:, None], rng.integers(0, 1000, (n, top_k - 1))], axis=1
                    )  # [n, top_k]
                calls.append(
                    Call(
                        rng.integers(0, 1000, rng.integers(1, 40)),
                        completion,
                        -rng.exponential(size=n),
                        version=int(rng.integers(0, 3)),
                        support=support,
                    )
                )
            members.append(
                Rollout(RolloutKey(g, s, 0), TASK, Status.COMPLETED, tuple(calls), 1.0 * s)
            )
        groups.append(members)
    kwargs = {"rows": 60, "width": 512}
    if top_k is not None:
        kwargs["support_capacity"] = 400 * top_k
    (batch, stats), (ref, ref_stats) = (
        pack(groups, **kwargs),
        _pack_reference.pack(groups, **kwargs),
    )
    assert dataclasses.astuple(stats) == dataclasses.astuple(ref_stats)
    assert stats.cut  # tight enough that some groups are cut
    assert list(batch) == list(ref)
    for name, arr in ref.items():
        np.testing.assert_array_equal(batch[name], arr, err_msg=name)
