"""bench/_results.py keeps RESULTS.md's other sections and summary rows as they were."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from ._tiny import bench_module


def results_module() -> ModuleType:
    return bench_module("_results")


def test_sections_and_summary_rows_replace_only_their_own(tmp_path: Path) -> None:
    r = results_module()
    path = tmp_path / "RESULTS.md"
    r.write_section("## pack\n\nfirst\n", path)
    r.write_section("## engine\n\nengine text\n", path)
    r.write_summary_row("pack", "1 tok/s", "2 tok/s", "NOT met", path)
    r.write_summary_row("engine", "1.1x", "1x", "met", path)
    r.write_section("## pack\n\nsecond\n", path)
    r.write_summary_row("pack", "3 tok/s", "2 tok/s", "met", path)
    text = path.read_text()
    assert text.startswith("# Benchmark results\n\n## summary\n")
    assert "| pack | 3 tok/s | 2 tok/s | met |" in text
    assert "| engine | 1.1x | 1x | met |" in text
    assert "1 tok/s" not in text and "first" not in text
    assert "second" in text and "engine text" in text
    assert text.index("## summary") < text.index("## pack") < text.index("## engine")


def test_the_command_line_is_one_that_can_be_pasted_back(monkeypatch) -> None:
    import shlex

    argv = ["async_steps.py", "--variant", "ahead 3:ahead=3,max_lag=3", "--seeds", "1,2"]
    monkeypatch.setattr("sys.argv", argv)
    line = results_module().command_line("async_steps.py")
    assert line == (
        ".venv/bin/python bench/async_steps.py --variant 'ahead 3:ahead=3,max_lag=3' --seeds 1,2"
    )
    assert shlex.split(line)[2:] == argv[1:]


def test_a_section_needs_a_header(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="## name"):
        results_module().write_section("no header\n", tmp_path / "R.md")


def test_provenance_of_one_command_and_of_several() -> None:
    r = results_module()
    one = {"command": "a --x", "machine": "m", "date": "d", "seconds": 12.4, "load": 0.31}
    assert r.provenance_lines(one) == (
        "- command: `a --x`\n- machine: m\n"
        "- date: d, wall time 12 s, 1-minute load average at the end 0.3\n"
    )
    several = {"command": ["a", "b"], "machine": "m", "date": "d", "note": " (one by one)"}
    assert (
        r.provenance_lines(several)
        == "- commands: `a`; `b` (one by one)\n- machine: m\n- date: d\n"
    )


def test_a_folder_saved_into_twice_keeps_every_command() -> None:
    r = results_module()
    first = {"command": "a", "machine": "m", "date": "d1", "seconds": 10.0, "load": 0.5}
    second = {"command": "b", "machine": "m", "date": "d2", "seconds": 5.0, "load": 0.2}
    joined = r.joined_provenance(first, second)
    assert joined == {
        "command": ["a", "b"], "machine": "m", "date": "d1; d2", "seconds": 15.0, "load": 0.2
    }  # fmt: skip
    third = {**second, "command": "c", "seconds": None}
    again = r.joined_provenance(joined, third)
    assert again["command"] == ["a", "b", "c"]
    assert again["date"] == "d1; d2"  # a date already listed is not listed twice
    assert again["seconds"] is None
    assert r.provenance_lines(again).startswith("- commands: `a`; `b`; `c`\n")
