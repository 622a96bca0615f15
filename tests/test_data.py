"""Dataset streams are a pure function of (seed, position); Prefetch reads ahead by depth."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dew.data import Dataset, Prefetch


def ids(batches: list[dict[str, np.ndarray]]) -> list[list[int]]:
    return [b["task_id"].tolist() for b in batches]


def test_stream_is_deterministic_and_resumable() -> None:
    ds = Dataset({"task_id": np.arange(10), "x": np.arange(10) * 2}, batch_size=3, seed=7)
    first = list(itertools.islice(ds.stream(), 9))
    again = list(itertools.islice(ds.stream(), 9))
    assert ids(first) == ids(again)
    resumed = list(itertools.islice(ds.stream(4), 5))
    assert ids(resumed) == ids(first[4:])
    for b in first:
        np.testing.assert_array_equal(b["x"], b["task_id"] * 2)


def test_epochs_cover_each_row_once_and_reshuffle() -> None:
    ds = Dataset({"task_id": np.arange(12)}, batch_size=4, seed=1)
    assert ds.batches_per_epoch == 3
    batches = ids(list(itertools.islice(ds.stream(), 6)))
    epoch0 = sorted(itertools.chain.from_iterable(batches[:3]))
    epoch1 = sorted(itertools.chain.from_iterable(batches[3:]))
    assert epoch0 == epoch1 == list(range(12))
    assert batches[:3] != batches[3:]  # a new shuffle per epoch


def test_no_shuffle_and_drop_remainder() -> None:
    ds = Dataset({"task_id": np.arange(5)}, batch_size=2, shuffle=False)
    assert ids(list(itertools.islice(ds.stream(), 3))) == [[0, 1], [2, 3], [0, 1]]


def test_shares_partition_each_global_batch() -> None:
    ds = Dataset({"task_id": np.arange(16)}, batch_size=4, seed=3)
    whole = ids(list(itertools.islice(ds.stream(), 4)))
    parts = [ids(list(itertools.islice(ds.share(i, 2).stream(), 4))) for i in range(2)]
    for p in range(4):
        assert sorted(parts[0][p] + parts[1][p]) == sorted(whole[p])
        assert parts[0][p] == whole[p][0::2]


def test_observed_stream_calls_hooks_when_read() -> None:
    seen: list[list[int]] = []
    opened: list[int] = []
    ds = Dataset({"task_id": np.arange(8)}, batch_size=2, shuffle=False)
    obs = ds.observed(lambda b: seen.append(b["task_id"].tolist()), lambda: opened.append(1))
    stream = obs.stream()
    assert opened == [1] and seen == []
    reader = Prefetch(stream, depth=2)
    first = next(reader)
    # Handing out batch 0 has read batches 0..2.
    assert first["task_id"].tolist() == [0, 1]
    assert seen == [[0, 1], [2, 3], [4, 5]]
    next(reader)
    assert seen[-1] == [6, 7]
    assert ds._on_read is None  # the original is untouched


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 11}, "exceeds"),
    ],
)
def test_bad_parameters(kw: dict[str, int], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        Dataset({"task_id": np.arange(10)}, **kw)


def test_bad_columns_and_positions() -> None:
    with pytest.raises(ValueError, match="equal lengths"):
        Dataset({"a": np.arange(3), "b": np.arange(4)}, batch_size=1)
    with pytest.raises(ValueError, match="non-empty"):
        Dataset({}, batch_size=1)
    ds = Dataset({"task_id": np.arange(4)}, batch_size=2)
    with pytest.raises(ValueError, match="position"):
        ds.stream(-1)
    with pytest.raises(ValueError, match="divisible"):
        Dataset({"task_id": np.arange(6)}, batch_size=3).share(0, 2)
    with pytest.raises(ValueError, match="share index"):
        ds.share(2, 2)
    with pytest.raises(ValueError, match="depth"):
        Prefetch(ds.stream(), depth=-1)


def test_hugging_face_dataset_columns() -> None:
    import datasets

    table = datasets.Dataset.from_dict({"task_id": list(range(6)), "prompt": list("abcdef")})
    ds = Dataset(table, batch_size=2, shuffle=False)
    first = next(ds.stream())
    assert first["task_id"].tolist() == [0, 1]
    assert first["prompt"].tolist() == ["a", "b"]
