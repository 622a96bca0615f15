"""Record sinks: JSONL rewriting on resume, flattening, TensorBoard only when installed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from dew._sinks import JsonlSink, flatten, tensorboard_sink


def test_jsonl_sink_starts_from_the_restored_history(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"ste')  # 3 and a torn line
    sink = JsonlSink(path, [{"step": 1}, {"step": 2}])  # the checkpoint knew two
    sink({"step": 3, "loss": 0.5})
    sink.close()
    assert [json.loads(x) for x in path.read_text().splitlines()] == [
        {"step": 1},
        {"step": 2},
        {"step": 3, "loss": 0.5},
    ]
    assert not list(tmp_path.glob(".*tmp*"))


def test_flatten_keeps_numeric_leaves_with_path_names() -> None:
    record = {
        "step": 4,
        "loss": 0.25,
        "ok": True,
        "tasks": {"trained": ["1", "2"]},
        "scheduler": {"lag": 1, "resubmitted": {"stale": 2}, "metrics": {"reward/mean": 0.5}},
    }
    assert flatten(record) == {
        "step": 4.0,
        "loss": 0.25,
        "scheduler/lag": 1.0,
        "scheduler/resubmitted/stale": 2.0,
        "scheduler/metrics/reward/mean": 0.5,
    }


def test_tensorboard_sink_only_when_installed(tmp_path: Path) -> None:
    sink = tensorboard_sink(tmp_path / "tb")
    if importlib.util.find_spec("tensorboard") is None:
        assert sink is None
        return
    assert sink is not None
    sink({"step": 1, "loss": 0.5, "scheduler": {"lag": 0}})
    sink.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
