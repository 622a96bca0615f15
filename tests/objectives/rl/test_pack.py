from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dew.core import Call, Rollout, RolloutKey, Status, Task
from dew.objectives.rl.chains import chains
from dew.objectives.rl.pack import ESTIMATORS, PackStats, advantage_estimator, pack

TASK = Task("t")
EPS = 1e-6
F32 = np.float32


def call(prompt, completion, log_probs=None, version=0, support=None) -> Call:
    if log_probs is None:
        log_probs = [-0.5] * len(completion)
    return Call(
        prompt=prompt, completion=completion, log_probs=log_probs, version=version, support=support
    )


def rollout(group, sample, calls, reward=1.0, status=Status.COMPLETED, **kw) -> Rollout:
    if status is Status.TRUNCATED:
        kw.setdefault("truncation", "length")
    return Rollout(RolloutKey(group, sample, 0), TASK, status, calls, reward=reward, **kw)


def arr(x, dtype) -> np.ndarray:
    return np.asarray(x, dtype=dtype)


# --------------------------------------------------------------------------- estimators


def test_estimator_registry_names():
    assert sorted(ESTIMATORS) == ["group", "group_std", "rloo"]
    for name, fn in ESTIMATORS.items():
        assert advantage_estimator(name) is fn
    with pytest.raises(ValueError, match="estimator"):
        advantage_estimator("ppo")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # rewards [3, 1, 3, 1]: mean 2, population std 1, mean of the others 5/3 or 7/3
        ("group", [1.0, -1.0, 1.0, -1.0]),
        ("group_std", [1 / (1 + EPS), -1 / (1 + EPS), 1 / (1 + EPS), -1 / (1 + EPS)]),
        ("rloo", [3 - 5 / 3, 1 - 7 / 3, 3 - 5 / 3, 1 - 7 / 3]),
    ],
)
def test_estimators_all_trained(name, expected):
    out = ESTIMATORS[name](np.array([3.0, 1.0, 3.0, 1.0]), np.ones(4, bool))
    np.testing.assert_allclose(out, expected, rtol=1e-12)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # trained rewards [3, 1] (the 100 is out of the baseline): mean 2, std 1
        ("group", [1.0, 0.0, -1.0]),
        ("group_std", [1 / (1 + EPS), 0.0, -1 / (1 + EPS)]),
        ("rloo", [2.0, 0.0, -2.0]),
    ],
)
def test_estimators_ignore_untrained(name, expected):
    out = ESTIMATORS[name](np.array([3.0, 100.0, 1.0]), np.array([True, False, True]))
    np.testing.assert_allclose(out, expected, rtol=1e-12)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_estimators_degenerate_groups(name):
    fn = ESTIMATORS[name]
    np.testing.assert_array_equal(fn(np.array([5.0, 2.0]), np.array([True, False])), [0.0, 0.0])
    np.testing.assert_array_equal(fn(np.array([5.0, 2.0]), np.zeros(2, bool)), [0.0, 0.0])
    np.testing.assert_array_equal(fn(np.zeros(0), np.zeros(0, bool)), np.zeros(0))


# --------------------------------------------------------------------------- hand-worked batches


def three_rollouts() -> list[Rollout]:
    return [
        rollout(0, 0, [call([5, 6], [7, 8], [-0.5, -0.25], version=3)], reward=3.0),
        rollout(0, 1, [call([5], [9], [-1.0], version=4)], reward=1.0),
        rollout(0, 2, [call([5, 6, 7], [1], [-0.125], version=3)], reward=2.0),
    ]


@pytest.mark.parametrize(
    ("estimator", "adv"),
    [
        # rewards [3, 1, 2]: mean 2, population std sqrt(2/3); others' means 1.5, 2.5, 2
        ("group", (1.0, -1.0, 0.0)),
        ("group_std", (1 / (np.sqrt(2 / 3) + EPS), -1 / (np.sqrt(2 / 3) + EPS), 0.0)),
        ("rloo", (1.5, -1.5, 0.0)),
    ],
)
def test_pack_hand_worked(estimator, adv):
    batch, stats = pack([three_rollouts()], rows=2, width=6, estimator=estimator)
    a, b, c = adv
    # r0 (4 tokens) fills row 0 up to 4; r1 (2 tokens) takes the rest of row 0; r2 goes to row 1.
    expected = {
        "tokens": arr([[5, 6, 7, 8, 5, 9], [5, 6, 7, 1, 0, 0]], np.int64),
        "positions": arr([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 0]], np.int64),
        "segments": arr([[1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 0, 0]], np.int64),
        "loss_mask": arr([[0, 0, 1, 1, 0, 1], [0, 0, 0, 1, 0, 0]], np.float32),
        "completion_mask": arr([[0, 0, 1, 1, 0, 1], [0, 0, 0, 1, 0, 0]], bool),
        "advantages": arr([[0, 0, a, a, 0, b], [0, 0, 0, c, 0, 0]], np.float32),
        "behavior_log_probs": arr(
            [[0, 0, -0.5, -0.25, 0, -1.0], [0, 0, 0, -0.125, 0, 0]], np.float32
        ),
        "proximal_log_probs": np.zeros((2, 6), np.float32),
        "versions": arr([[3, 3, 3, 3, 4, 4], [3, 3, 3, 3, -1, -1]], np.int64),
        "rollout_index": arr([[0, 0, 0, 0, 1, 1], [2, 2, 2, 2, -1, -1]], np.int64),
    }
    assert set(batch) == set(expected)
    for name, want in expected.items():
        assert batch[name].dtype == want.dtype, name
        assert batch[name].shape == (2, 6), name
        np.testing.assert_array_equal(batch[name], want, err_msg=name)
    assert stats == PackStats(
        packed=(0,), cut=(), trained_tokens=4, tokens=10, padding_share=2 / 12
    )
    assert (stats.groups_packed, stats.groups_cut) == (1, 0)


def truncation_group(truncated_reward: float | None) -> list[Rollout]:
    return [
        rollout(0, 0, [call([1], [2, 3])], reward=1.0),
        rollout(0, 1, [call([1], [4, 5])], reward=truncated_reward, status=Status.TRUNCATED),
        rollout(0, 2, [call([1], [6, 7])], reward=0.0),
    ]


@pytest.mark.parametrize(
    ("truncation", "adv", "trained"),
    [
        # mask: baseline over [1, 0] only; the truncated rollout trains nothing
        ("mask", (0.5, 0.0, -0.5), (1, 0, 1)),
        # score: trained on its reward 1 -> rewards [1, 1, 0], mean 2/3
        ("score", (1 / 3, 1 / 3, -2 / 3), (1, 1, 1)),
        # zero: its reward becomes 0 -> rewards [1, 0, 0], mean 1/3
        ("zero", (2 / 3, -1 / 3, -1 / 3), (1, 1, 1)),
    ],
)
def test_pack_truncation_policies(truncation, adv, trained):
    batch, stats = pack([truncation_group(1.0)], rows=1, width=10, truncation=truncation)
    a, b, c = adv
    ta, tb, tc = trained
    np.testing.assert_array_equal(batch["tokens"], [[1, 2, 3, 1, 4, 5, 1, 6, 7, 0]])
    np.testing.assert_array_equal(batch["completion_mask"], [[0, 1, 1, 0, 1, 1, 0, 1, 1, 0]])
    np.testing.assert_array_equal(
        batch["loss_mask"], arr([[0, ta, ta, 0, tb, tb, 0, tc, tc, 0]], np.float32)
    )
    np.testing.assert_array_equal(
        batch["advantages"], arr([[0, a, a, 0, b, b, 0, c, c, 0]], np.float32)
    )
    # Behavior log-probs are kept on every sampled token, trained or not.
    np.testing.assert_array_equal(
        batch["behavior_log_probs"], arr([[0, -0.5, -0.5, 0, -0.5, -0.5, 0, -0.5, -0.5, 0]], F32)
    )
    assert stats.trained_tokens == 2 * sum(trained)
    assert stats.tokens == 9


def test_masked_truncation_needs_no_reward():
    batch, _ = pack([truncation_group(None)], rows=1, width=10, truncation="mask")
    np.testing.assert_array_equal(batch["loss_mask"][0, 3:6], [0, 0, 0])
    np.testing.assert_array_equal(batch["completion_mask"][0, 3:6], [0, 1, 1])


# --------------------------------------------------------------------------- chains


def test_multi_turn_extending_prompt_is_one_chain():
    calls = [
        call([1, 2], [3, 4], [-0.1, -0.2], version=0),
        call([1, 2, 3, 4, 10, 11], [5, 6], [-0.3, -0.4], version=1),  # observation 10, 11
    ]
    batch, stats = pack([[rollout(0, 0, calls)]], rows=1, width=10)
    np.testing.assert_array_equal(batch["tokens"], [[1, 2, 3, 4, 10, 11, 5, 6, 0, 0]])
    np.testing.assert_array_equal(batch["positions"], [[0, 1, 2, 3, 4, 5, 6, 7, 0, 0]])
    np.testing.assert_array_equal(batch["segments"], [[1, 1, 1, 1, 1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(batch["loss_mask"], [[0, 0, 1, 1, 0, 0, 1, 1, 0, 0]])
    np.testing.assert_array_equal(batch["completion_mask"], [[0, 0, 1, 1, 0, 0, 1, 1, 0, 0]])
    np.testing.assert_array_equal(
        batch["behavior_log_probs"], arr([[0, 0, -0.1, -0.2, 0, 0, -0.3, -0.4, 0, 0]], F32)
    )
    np.testing.assert_array_equal(batch["versions"], [[0, 0, 0, 0, 1, 1, 1, 1, -1, -1]])
    np.testing.assert_array_equal(batch["rollout_index"], [[0] * 8 + [-1, -1]])
    assert stats.tokens == 8 and stats.trained_tokens == 4


def test_non_extending_call_opens_a_new_chain():
    calls = [
        call([1, 2], [3, 4], [-0.1, -0.2], version=0),
        call([1, 2, 9], [5], [-0.3], version=1),  # drops the first completion: not an extension
    ]
    batch, _ = pack([[rollout(0, 0, calls)]], rows=1, width=10)
    np.testing.assert_array_equal(batch["tokens"], [[1, 2, 3, 4, 1, 2, 9, 5, 0, 0]])
    np.testing.assert_array_equal(batch["positions"], [[0, 1, 2, 3, 0, 1, 2, 3, 0, 0]])
    np.testing.assert_array_equal(batch["segments"], [[1, 1, 1, 1, 2, 2, 2, 2, 0, 0]])
    np.testing.assert_array_equal(batch["loss_mask"], [[0, 0, 1, 1, 0, 0, 0, 1, 0, 0]])
    np.testing.assert_array_equal(batch["rollout_index"], [[0] * 8 + [-1, -1]])
    # Chains of one rollout may land in different rows; each stays whole.
    batch, _ = pack([[rollout(0, 0, calls)]], rows=2, width=5)
    np.testing.assert_array_equal(batch["tokens"], [[1, 2, 3, 4, 0], [1, 2, 9, 5, 0]])
    np.testing.assert_array_equal(batch["segments"], [[1, 1, 1, 1, 0], [1, 1, 1, 1, 0]])
    np.testing.assert_array_equal(batch["positions"], [[0, 1, 2, 3, 0], [0, 1, 2, 3, 0]])


# --------------------------------------------------------------------------- cuts


def test_group_that_does_not_fit_is_cut_and_a_later_one_still_fits():
    a = [rollout(0, 0, [call([1, 2], [3, 4])]), rollout(0, 1, [call([1, 2], [5, 6])])]
    b = [rollout(1, 0, [call([1, 2], [3])]), rollout(1, 1, [call([1, 2], [4])])]
    c = [rollout(2, 0, [call([1], [7])], reward=0.0)]
    batch, stats = pack([a, b, c], rows=1, width=10)
    assert stats.packed == (0, 2) and stats.cut == (1,)
    assert (stats.groups_packed, stats.groups_cut) == (2, 1)
    np.testing.assert_array_equal(batch["tokens"], [[1, 2, 3, 4, 1, 2, 5, 6, 1, 7]])
    # rollout_index counts the cut group's members too: c's rollout is the fifth.
    np.testing.assert_array_equal(batch["rollout_index"], [[0, 0, 0, 0, 1, 1, 1, 1, 4, 4]])
    np.testing.assert_array_equal(batch["segments"], [[1, 1, 1, 1, 2, 2, 2, 2, 3, 3]])
    assert stats.padding_share == 0.0


def test_cut_group_leaves_no_partial_placement():
    a = [rollout(0, 0, [call([1, 2], [3, 4])])]
    # b's first chain fits row 1 but its second does not fit anywhere: b goes out whole.
    b = [rollout(1, 0, [call([1, 2], [3, 4])]), rollout(1, 1, [call([1, 2], [5, 6])])]
    c = [rollout(2, 0, [call([1, 2, 3], [8, 9])])]  # needs all 5 slots of row 1
    batch, stats = pack([a, b, c], rows=2, width=5)
    assert stats.packed == (0, 2) and stats.cut == (1,)
    np.testing.assert_array_equal(batch["tokens"], [[1, 2, 3, 4, 0], [1, 2, 3, 8, 9]])
    np.testing.assert_array_equal(batch["segments"], [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(batch["rollout_index"], [[0, 0, 0, 0, -1], [3, 3, 3, 3, 3]])


def test_a_group_that_can_never_fit_is_a_configuration_error():
    # A chain wider than a row: every step would cut it, training on padding alone.
    long = [[rollout(0, 0, [call([1, 2, 3], [4, 5, 6])])]]
    with pytest.raises(ValueError, match=r"its group can never be packed \(rows=4, width=5\)"):
        pack(long, rows=4, width=5)
    with pytest.raises(ValueError, match=r"chains are \[6\] tokens long"):
        pack(long, rows=4, width=5)
    # Chains that fit one by one, but a whole group that needs more rows than there are.
    group = [rollout(0, i, [call([1, 2], [3, 4])]) for i in range(3)]
    with pytest.raises(ValueError, match=r"rows=2, width=4\).*3 rollouts need 12 tokens"):
        pack([group], rows=2, width=4)
    # Beside other groups it is only cut (it could fit alone): the reference's rule.
    first = [rollout(1, 0, [call([1, 2], [3, 4])])]
    _, stats = pack([first, group[:2]], rows=2, width=4)
    assert stats.packed == (0,) and stats.cut == (1,)


def test_empty_input():
    batch, stats = pack([], rows=2, width=3)
    assert stats == PackStats(packed=(), cut=(), trained_tokens=0, tokens=0, padding_share=1.0)
    assert batch["tokens"].shape == (2, 3)


# --------------------------------------------------------------------------- support


def support_group() -> list[Rollout]:
    return [
        rollout(0, 0, [call([1], [2, 3], support=[[2, 5], [3]])], reward=1.0),
        # masked truncation: packed, but untrained, so its support is not stored
        rollout(0, 1, [call([1], [4], support=[[4, 6]])], reward=None, status=Status.TRUNCATED),
        rollout(0, 2, [call([1], [7], support=[(7, 8, 9)])], reward=0.0),
    ]


def test_support_layout():
    batch, stats = pack([support_group()], rows=1, width=8, support_capacity=6)
    np.testing.assert_array_equal(batch["tokens"], [[1, 2, 3, 1, 4, 1, 7, 0]])
    assert batch["support"].dtype == np.int64 and batch["support"].shape == (1, 6)
    assert batch["support_offsets"].dtype == np.int64
    assert batch["support_offsets"].shape == (1, 9)
    np.testing.assert_array_equal(batch["support"], [[2, 5, 3, 7, 8, 9]])
    np.testing.assert_array_equal(batch["support_offsets"], [[0, 0, 2, 3, 3, 3, 3, 6, 6]])
    off, sup = batch["support_offsets"][0], batch["support"][0]
    per_token = [sup[off[t] : off[t + 1]].tolist() for t in range(8)]
    assert per_token == [[], [2, 5], [3], [], [], [], [7, 8, 9], []]
    assert stats.packed == (0,)


def test_support_padding_and_rows():
    # group 0 takes row 0 and all of its support room; group 1's chain has token room in
    # row 0 but no support room there, so it goes to row 1.
    g0 = [rollout(0, 0, [call([1], [2], support=[[2, 3, 4]])])]
    g1 = [rollout(1, 0, [call([1], [5], support=np.array([[5]]))])]
    batch, _ = pack([g0, g1], rows=2, width=8, support_capacity=3)
    np.testing.assert_array_equal(batch["tokens"], [[1, 2, 0, 0, 0, 0, 0, 0], [1, 5] + [0] * 6])
    np.testing.assert_array_equal(batch["support"], [[2, 3, 4], [5, -1, -1]])
    np.testing.assert_array_equal(batch["support_offsets"][0], [0, 0, 3, 3, 3, 3, 3, 3, 3])
    np.testing.assert_array_equal(batch["support_offsets"][1], [0, 0, 1, 1, 1, 1, 1, 1, 1])


def test_group_whose_support_can_never_fit_is_a_configuration_error():
    # Its trained tokens carry 6 support ids; one row holds 5.
    plain = [rollout(1, 0, [call([1], [2])])]
    with pytest.raises(ValueError, match=r"never be packed \(rows=1, width=16, support_capacity=5"):
        pack([support_group(), plain], rows=1, width=16, support_capacity=5)


def test_group_whose_support_does_not_fit_beside_another_is_cut():
    heavy = [rollout(1, 0, [call([1], [2, 3], support=[[2, 5, 6, 7], [3]])], reward=1.0)]
    batch, stats = pack([heavy, support_group()], rows=1, width=16, support_capacity=6)
    assert stats.packed == (0,) and stats.cut == (1,)
    np.testing.assert_array_equal(batch["tokens"][0, :4], [1, 2, 3, 0])


def test_support_without_capacity_is_refused():
    with pytest.raises(ValueError, match=r"rollout\(group=0, sample=0.*support_capacity"):
        pack([support_group()], rows=1, width=8)


@pytest.mark.parametrize(
    "second",
    [call([1, 2, 9], [4]), call([7], [4])],  # extends the chain / opens a new one
)
def test_rollout_mixing_support_and_none_is_refused(second):
    calls = [call([1], [2], support=[[2, 3]]), second]
    with pytest.raises(ValueError, match=r"rollout\(group=0, sample=0.*calls\[1\].*support"):
        pack([[rollout(0, 0, calls)]], rows=1, width=8, support_capacity=4)


def test_support_as_2d_arrays_across_chains():
    # Two chains, top-2 support as [n, 2] arrays: each chain reads its own run of rows.
    calls = [
        call([1], [2, 3], support=np.array([[2, 9], [3, 8]])),
        call([5], [6], support=np.array([[6, 7]])),  # new chain
        call([5, 6, 4], [2], support=np.array([[1, 2]])),  # extends the second chain
    ]
    batch, _ = pack([[rollout(0, 0, calls)]], rows=2, width=4, support_capacity=6)
    np.testing.assert_array_equal(batch["tokens"], [[1, 2, 3, 0], [5, 6, 4, 2]])
    np.testing.assert_array_equal(batch["support"], [[2, 9, 3, 8, -1, -1], [6, 7, 1, 2, -1, -1]])
    np.testing.assert_array_equal(batch["support_offsets"], [[0, 0, 2, 4, 4], [0, 0, 2, 2, 4]])


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"estimator": "ppo"}, "estimator"),
        ({"truncation": "drop"}, "truncation"),
        ({"rows": 0}, "rows"),
        ({"width": 0}, "width"),
        ({"rows": -3}, "rows"),
        ({"support_capacity": 0}, "support_capacity"),
    ],
)
def test_bad_parameters(kwargs, name):
    args = {"rows": 2, "width": 8} | kwargs
    with pytest.raises(ValueError, match=name):
        pack([three_rollouts()], **args)


@pytest.mark.parametrize("status", [Status.COMPLETED, Status.AGENT_ERROR])
def test_scored_status_without_reward(status):
    bad = rollout(3, 1, [call([1], [2])], reward=None, status=status)
    with pytest.raises(ValueError, match=r"rollout\(group=3, sample=1, attempt=0\).*reward"):
        pack([[bad]], rows=1, width=8)


@pytest.mark.parametrize("status", [Status.INFRA_ERROR, Status.CANCELLED])
def test_unscored_status_is_refused(status):
    bad = Rollout(RolloutKey(2, 5, 1), TASK, status, error="boom")
    with pytest.raises(
        ValueError, match=rf"rollout\(group=2, sample=5, attempt=1\).*{status.name}"
    ):
        pack([[rollout(2, 0, [call([1], [2])]), bad]], rows=1, width=8)


def test_score_policy_resubmit_is_refused():
    with pytest.raises(ValueError, match=r"rollout\(group=0, sample=1.*truncation='score'"):
        pack([truncation_group(None)], rows=1, width=10, truncation="score")


def test_bad_rollout_in_a_group_that_would_be_cut_is_still_refused():
    big = [rollout(0, 0, [call([1] * 20, [2])]), rollout(0, 1, [call([1], [2])], reward=None)]
    with pytest.raises(ValueError, match=r"sample=1.*reward"):
        pack([big], rows=1, width=4)


# --------------------------------------------------------------------------- properties


@st.composite
def rollouts_st(draw, group: int, sample: int) -> Rollout:
    tok = st.integers(1, 40)
    calls = []
    history: list[int] = []
    for i in range(draw(st.integers(1, 3))):
        extend = i > 0 and draw(st.booleans())
        fresh = draw(st.lists(tok, min_size=0 if extend else 1, max_size=4))
        prompt = history + fresh if extend else fresh
        completion = draw(st.lists(tok, min_size=1, max_size=5))
        log_probs = [-float(draw(st.integers(0, 1000))) / 64 for _ in completion]
        calls.append(call(prompt, completion, log_probs, version=draw(st.integers(0, 3))))
        history = prompt + completion
    status = draw(st.sampled_from([Status.COMPLETED, Status.AGENT_ERROR, Status.TRUNCATED]))
    reward = float(draw(st.integers(-3, 3)))
    return rollout(group, sample, calls, reward=reward, status=status)


@st.composite
def batches_st(draw):
    n_groups = draw(st.integers(0, 4))
    groups = [
        [draw(rollouts_st(g, s)) for s in range(draw(st.integers(1, 4)))] for g in range(n_groups)
    ]
    return (
        groups,
        draw(st.integers(1, 4)),
        draw(st.integers(1, 40)),
        draw(st.sampled_from(sorted(ESTIMATORS))),
        draw(st.sampled_from(["mask", "score", "zero"])),
    )


def _segments(batch) -> dict[tuple[int, int], np.ndarray]:
    """(row, segment id) -> slot indices of that segment in the row."""
    out = {}
    for r, row in enumerate(batch["segments"]):
        for s in np.unique(row[row > 0]):
            out[(r, int(s))] = np.flatnonzero(row == s)
    return out


def _chain_key(tokens, trained, log_probs, versions) -> tuple:
    return (
        tuple(int(t) for t in tokens),
        tuple(bool(t) for t in trained),
        tuple(float(x) for x in np.where(trained, log_probs, 0).astype(np.float32)),
        tuple(int(v) for v in versions),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches_st())
def test_pack_properties(args):
    groups, rows, width, estimator, truncation = args

    def alone(group: list[Rollout]) -> bool:  # fits into empty rows
        try:
            return pack([group], rows=rows, width=width)[1].packed == (0,)
        except ValueError:
            return False

    # A group that cannot fit even into empty rows is refused, naming it; the others pack.
    never = [g for g in groups if not alone(g)]
    if never:
        with pytest.raises(ValueError, match="can never be packed"):
            pack(groups, rows=rows, width=width, estimator=estimator, truncation=truncation)
        groups = [g for g in groups if alone(g)]
    batch, stats = pack(groups, rows=rows, width=width, estimator=estimator, truncation=truncation)
    for v in batch.values():
        assert v.shape == (rows, width)
    flat = [r for g in groups for r in g]
    first = np.cumsum([0] + [len(g) for g in groups])
    assert sorted(stats.packed + stats.cut) == list(range(len(groups)))
    assert list(stats.packed) == sorted(stats.packed) and list(stats.cut) == sorted(stats.cut)

    seg, loss, comp = batch["segments"], batch["loss_mask"], batch["completion_mask"]
    pad = seg == 0
    # Padding carries nothing, and sits at the end of each row (rows fill from the left).
    assert (batch["tokens"][pad] == 0).all() and (loss[pad] == 0).all() and not comp[pad].any()
    assert (batch["versions"][pad] == -1).all() and (batch["rollout_index"][pad] == -1).all()
    assert (batch["advantages"][pad] == 0).all() and (batch["positions"][pad] == 0).all()
    assert (np.diff(pad.astype(int), axis=1) >= 0).all()
    assert (batch["proximal_log_probs"] == 0).all()
    # Segment ids count 1, 2, ... along a row and positions restart at 0 with each one.
    for row_seg, row_pos in zip(seg, batch["positions"], strict=True):
        real = row_seg[row_seg > 0]
        assert (np.diff(real) >= 0).all() and (np.diff(real) <= 1).all()
        if len(real):
            assert real[0] == 1
        for s in np.unique(real):
            np.testing.assert_array_equal(row_pos[row_seg == s], np.arange((row_seg == s).sum()))
    assert stats.tokens == int((~pad).sum())
    assert stats.trained_tokens == int(loss.sum())
    assert stats.padding_share == pytest.approx(pad.sum() / (rows * width))
    assert ((loss > 0) <= comp).all()

    # Each segment is one whole chain of one rollout: the chains in the batch are exactly
    # those of the packed groups' rollouts, each once, in one row.
    found: dict[int, Counter] = {}
    for (r, _), idx in _segments(batch).items():
        owners = np.unique(batch["rollout_index"][r, idx])
        assert len(owners) == 1
        key = _chain_key(
            batch["tokens"][r, idx],
            comp[r, idx],
            batch["behavior_log_probs"][r, idx],
            batch["versions"][r, idx],
        )
        found.setdefault(int(owners[0]), Counter())[key] += 1
    packed_rollouts = {i for g in stats.packed for i in range(first[g], first[g + 1])}
    assert set(found) == packed_rollouts
    for i in packed_rollouts:
        want = Counter(
            _chain_key(c.tokens, c.trained, c.log_probs, c.versions) for c in chains(flat[i].calls)
        )
        assert found[i] == want

    # Independently of chains(): every sampled token of a packed rollout is there once,
    # with its own log-prob.
    for i in packed_rollouts:
        mine = (batch["rollout_index"] == i) & comp
        got = Counter(
            zip(
                batch["tokens"][mine].tolist(),
                batch["behavior_log_probs"][mine].tolist(),
                strict=True,
            )
        )
        want = Counter(
            (int(t), float(np.float32(lp)))
            for c in flat[i].calls
            for t, lp in zip(c.completion, c.log_probs, strict=True)
        )
        assert got == want

    # Advantages: constant over each rollout's trained tokens, equal to the estimator's
    # value for that rollout from its group's trained members.
    for g in stats.packed:
        members = groups[g]
        trained = np.array([_trains(r, truncation) for r in members])
        rewards = np.array([_reward(r, truncation) for r in members])
        adv = ESTIMATORS[estimator](rewards, trained)
        for j in range(len(members)):
            mine = batch["rollout_index"] == first[g] + j
            assert (loss[mine] == (comp[mine] & trained[j])).all()
            values = batch["advantages"][mine & (loss > 0)]
            assert (values == np.float32(adv[j])).all()
            assert (batch["advantages"][mine & (loss == 0)] == 0).all()


def _trains(r: Rollout, truncation: str) -> bool:
    return r.status is not Status.TRUNCATED or truncation != "mask"


def _reward(r: Rollout, truncation: str) -> float:
    if r.status is Status.TRUNCATED:
        return {"mask": 0.0, "score": r.reward, "zero": 0.0}[truncation]
    return r.reward


@st.composite
def supported_st(draw):
    groups = []
    for g in range(draw(st.integers(1, 3))):
        members = []
        for s in range(draw(st.integers(1, 3))):
            calls, history = [], []
            for i in range(draw(st.integers(1, 2))):
                extend = i > 0 and draw(st.booleans())
                fresh = draw(st.lists(st.integers(1, 9), min_size=0 if extend else 1, max_size=3))
                prompt = history + fresh if extend else fresh
                completion = draw(st.lists(st.integers(1, 9), min_size=1, max_size=3))
                support = [
                    sorted({t, *draw(st.lists(st.integers(1, 9), max_size=3))}) for t in completion
                ]
                calls.append(call(prompt, completion, support=support))
                history = prompt + completion
            members.append(rollout(g, s, calls, reward=float(draw(st.integers(0, 1)))))
        groups.append(members)
    return groups, draw(st.integers(1, 3)), draw(st.integers(2, 16)), draw(st.integers(1, 24))


@settings(max_examples=100, deadline=None)
@given(supported_st())
def test_support_properties(args):
    groups, rows, width, cap = args

    def alone(group: list[Rollout]) -> bool:  # fits into empty rows
        try:
            return pack([group], rows=rows, width=width, support_capacity=cap)[1].packed == (0,)
        except ValueError:
            return False

    groups = [g for g in groups if alone(g)]  # the others are refused (see above)
    batch, stats = pack(groups, rows=rows, width=width, support_capacity=cap)
    sup, off, loss = batch["support"], batch["support_offsets"], batch["loss_mask"]
    assert sup.shape == (rows, cap) and off.shape == (rows, width + 1)
    flat = [r for g in groups for r in g]
    for r in range(rows):
        assert off[r, 0] == 0 and (np.diff(off[r]) >= 0).all() and off[r, -1] <= cap
        assert (sup[r, off[r, -1] :] == -1).all() and (sup[r, : off[r, -1]] >= 0).all()
        for t in range(width):
            row = sup[r, off[r, t] : off[r, t + 1]]
            if loss[r, t] > 0:
                assert batch["tokens"][r, t] in row  # the sampled token is in its own support
            else:
                assert len(row) == 0
    # Each packed rollout's support rows, read back in slot order per chain, are its calls'.
    for i in {int(x) for x in np.unique(batch["rollout_index"]) if x >= 0}:
        got = Counter()
        for (r, _), idx in _segments(batch).items():
            if batch["rollout_index"][r, idx[0]] == i:
                rows_here = tuple(
                    tuple(sup[r, off[r, t] : off[r, t + 1]].tolist()) for t in idx if loss[r, t]
                )
                got[rows_here] += 1
        want = Counter(tuple(tuple(row) for row in ch.support) for ch in chains(flat[i].calls))
        assert got == want
    assert stats.trained_tokens == int(loss.sum())
