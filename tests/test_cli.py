"""The dew command: fast help, no heavy imports while parsing, clear usage errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "transformers", "matplotlib", "numpy", "tqdm")


def python(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


@pytest.mark.timeout(120)
def test_help_imports_nothing_heavy() -> None:
    out = python("-m", "dew.cli", "--help")
    assert out.returncode == 0, out.stderr
    assert "demo" in out.stdout and "plot" in out.stdout and "plan" in out.stdout
    # Parse every command line as the entry point would; nothing heavy may load.
    probe = (
        "import sys\n"
        "from dew.cli import parser\n"
        "for argv in (['demo'], ['demo', '--task', 'guess', '--steps', '3'], ['plot', 'x']):\n"
        "    parser().parse_args(argv)\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = python("-c", probe)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.timeout(120)
def test_plan_runs_without_torch() -> None:
    # The planner uses the scheduler's bookkeeping but no model: `dew plan` must not
    # pay for importing torch or transformers.
    probe = (
        "import sys\n"
        "from dew.cli import main\n"
        "main(['plan', '--preset', 'dapo', '--tasks', '8', '--group', '4', '--steps', '6'])\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = python("-c", probe)
    assert out.returncode == 0, out.stderr
    assert "ahead 1" in out.stdout, out.stdout
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.timeout(120)
def test_help_import_time_is_small() -> None:
    # What keeps `dew --help` instant: no heavy import behind `import dew.cli`. Then a
    # time bound, generous for a loaded machine (measured ~12 ms here; torch alone
    # takes seconds): -X importtime reports microseconds per module.
    probe = (
        "import sys, dew.cli\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    heavy = python("-c", probe)
    assert heavy.returncode == 0 and heavy.stdout.strip() == "[]", heavy.stdout + heavy.stderr
    out = python("-X", "importtime", "-c", "import dew.cli")
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stderr.splitlines() if x.rstrip().endswith("| dew.cli"))
    cumulative_us = int(line.split("|")[1])
    assert cumulative_us < 1_000_000, line


@pytest.mark.timeout(120)
def test_usage_errors_are_one_clear_line(tmp_path: Path) -> None:
    out = python("-m", "dew.cli", "demo", "--task", "nope")
    assert out.returncode != 0
    assert "task='nope' is not one of" in out.stderr and "Traceback" not in out.stderr
    out = python("-m", "dew.cli", "demo", "--steps", "0")
    assert "steps=0 must be an int >= 1" in out.stderr and "Traceback" not in out.stderr
    out = python("-m", "dew.cli", "plot", str(tmp_path / "missing"))
    assert out.returncode != 0
    assert "no records to plot" in out.stderr and "Traceback" not in out.stderr
    out = python("-m", "dew.cli", "demo", "--resume", str(tmp_path))
    assert out.returncode != 0
    assert "not a dew demo run folder" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.timeout(120)
def test_plan_command_prints_each_policy() -> None:
    out = python(
        "-m",
        "dew.cli",
        "plan",
        "--preset",
        "dapo-moments",
        "--tasks",
        "8",
        "--group",
        "4",
        "--T",
        "1x",
        "--policies",
        "0;1",
        "--steps",
        "3",
        "--warmup",
        "1",
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("sync") for line in lines)
    assert any(line.startswith("ahead 1") for line in lines)
    help_out = python("-m", "dew.cli", "plan", "--help")
    assert help_out.returncode == 0 and "--preset" in help_out.stdout


@pytest.mark.timeout(120)
def test_serve_refuses_a_public_bind_without_a_key_before_loading_anything() -> None:
    out = python("-m", "dew.cli", "serve", "--help")
    assert out.returncode == 0 and "--api-key" in out.stdout, out.stderr
    probe = (
        "import sys\n"
        "from dew.cli import main\n"
        "code = main(['serve', '--demo', 'tiny', '--host', '0.0.0.0'])\n"
        "print(code, sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    env_free = python("-c", probe)
    assert env_free.stdout.strip() == "2 []", env_free.stderr
    assert "api key" in env_free.stderr.lower() and "0.0.0.0" in env_free.stderr


@pytest.mark.timeout(180)
def test_demo_errors_are_one_line_exit_2_and_leave_nothing(tmp_path: Path) -> None:
    def refused(*args: str) -> str:
        out = python("-m", "dew.cli", "demo", "--no-progress", *args, cwd=tmp_path)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2, out.stderr
        assert len(lines) == 1 and lines[0].startswith("dew demo: error: "), out.stderr
        return lines[0]

    run = tmp_path / "run"
    assert "size='huge' is not one of" in refused("--size", "huge", "--run-dir", str(run))
    assert "groups=1: estimator" in refused("--group-size", "1", "--run-dir", str(run))
    assert not run.exists()  # nothing half-made
    run.mkdir()
    (run / "config.json").write_text('{"task": "single", "steps": ')  # garbled
    assert "config.json: not a readable demo config" in refused("--resume", str(run))
    (run / "config.json").write_text('{"task": "single", "steps": 2}')
    (run / "checkpoints").mkdir()  # a resume that finds nothing to resume
    assert "no checkpoint to resume (the folder is empty)" in refused("--resume", str(run))
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.json"]


@pytest.mark.timeout(120)
def test_demo_scheduling_flags_reach_the_scheduler(tmp_path: Path) -> None:
    import json

    from dew.cli import main

    run = tmp_path / "run"
    flags = ["--ahead", "2", "--max-lag", "3", "--oversample", "1", "--admit", "1"]
    argv = ["demo", "--steps", "2", "--batch-size", "2", "--no-progress", "--run-dir", str(run)]
    assert main([*argv, *flags]) == 0
    config = json.loads((run / "config.json").read_text())
    assert [config[k] for k in ("ahead", "max_lag", "oversample", "admit")] == [2, 3, 1, 1]
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    policy = records[-1]["profile"]["policy"]
    assert [policy[k] for k in ("ahead", "max_lag", "oversample", "admit")] == [2, 3, 1, 1]
    assert records[-1]["scheduler"]["groups"] == 1  # admit 1 of the batch's 2 tasks
