"""dew train's dataset: local files and folders, every row checked before the run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dew.demo.model import make_tokenizer
from dew.job.config import ConfigError
from dew.job.data import load_rows

TOKENIZER = make_tokenizer()


def jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def rows_of(path: str, **kw: Any) -> Any:
    args = {"column": "prompt", "chat": False, "tokenizer": TOKENIZER, "max_len": 16}
    return load_rows(path, max_tokens=4, **(args | kw))


def test_unusable_rows_are_skipped_and_reported_by_index(tmp_path: Path) -> None:
    path = jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": "12=", "answer": "12"},
            {"prompt": "", "answer": "1"},
            {"prompt": "1" * 13, "answer": "1"},  # 13 + 4 new tokens > 16
            {"prompt": "1" * 12, "answer": "1"},  # exactly fits
            {"prompt": "   ", "answer": "1"},
        ],
    )
    rows = rows_of(path)
    assert rows.usable == [0, 3] and len(rows) == 2
    assert rows.skipped == {
        1: "empty prompt",
        2: "prompt of 13 tokens + 4 new ones exceeds the context",
        4: "empty prompt",
    }
    assert rows.prompt_tokens == 12
    assert rows[1] == {"prompt": "1" * 12, "answer": "1"}
    assert list(rows.prompts()) == ["12=", "1" * 12]


def test_chat_rows_are_checked_as_messages(tmp_path: Path) -> None:
    path = jsonl(
        tmp_path / "d.jsonl",
        [
            {"m": [{"role": "user", "content": "12"}]},
            {"m": [{"role": "user"}]},
            {"m": []},
        ],
    )
    rows = rows_of(path, column="m", chat=True, max_len=64)
    assert rows.usable == [0]
    assert rows.skipped == {
        1: "each message must have a role and a content",
        2: "messages must be a non-empty list",
    }


def test_formats_and_folders(tmp_path: Path) -> None:
    import datasets

    table = datasets.Dataset.from_dict({"prompt": ["12=", "34="], "answer": ["12", "34"]})
    table.to_parquet(tmp_path / "d.parquet")
    table.to_csv(tmp_path / "d.csv", index=False)
    datasets.DatasetDict({"train": table}).save_to_disk(tmp_path / "saved")
    for where in ("d.parquet", "d.csv", "saved"):
        rows = rows_of(str(tmp_path / where))
        assert [str(r["answer"]) for r in rows] == ["12", "34"], where  # csv: ints


def test_problems_name_the_field(tmp_path: Path) -> None:
    path = jsonl(tmp_path / "d.jsonl", [{"question": "12="}])
    with pytest.raises(
        ConfigError, match=r"data.prompt_column: 'prompt' is not a column .*question"
    ):
        rows_of(path)
    with pytest.raises(ConfigError, match=r"data.messages_column: 'prompt' is not a column"):
        rows_of(path, chat=True)
    with pytest.raises(ConfigError, match=r"data.path: .*nope.jsonl: no such file"):
        rows_of(str(tmp_path / "nope.jsonl"))
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"data.path: .*expected one of"):
        rows_of(str(tmp_path / "d.txt"))
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ConfigError, match=r"data.path: .*bad.jsonl cannot be loaded"):
        rows_of(str(tmp_path / "bad.jsonl"))
    empty = jsonl(tmp_path / "e.jsonl", [{"prompt": ""}])
    with pytest.raises(ConfigError, match=r"no usable row .*row 0: empty prompt"):
        rows_of(empty)
