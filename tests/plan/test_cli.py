import pytest

from dew.objectives.rl.config import SchedulerConfig
from dew.plan.cli import main, parse_policy


def test_plan_prints_a_row_per_policy(capsys):
    argv = ["--preset", "dapo", "--tasks", "8", "--group", "4", "--T", "0.5x"]
    assert main([*argv, "--steps", "4", "--warmup", "1", "--policies", "0; 1; 1,os=50%"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("dapo: 8 tasks x 4")
    rows = [line for line in out if line.startswith(("sync", "ahead"))]
    names = [r[:28].strip() for r in rows]
    assert names == ["sync", "ahead 1", "ahead 1 + oversample 2"]
    figures = [[float(v) for v in r[28:].split()] for r in rows]
    fraction, bias = [f[0] for f in figures], [f[6] for f in figures]
    assert fraction[0] < fraction[1] <= 1.0
    assert bias[0] == bias[1] == 1.0 and bias[2] < 1.0


def test_parse_policy():
    assert parse_policy("2,os=25%,admit=50%,lag=3", 64, 8) == SchedulerConfig(
        ahead=2, oversample=2, admit=32, max_lag=3
    )
    assert parse_policy("0", 64, 8) == SchedulerConfig.tight(ahead=0)
    with pytest.raises(ValueError, match="unknown option 'x'"):
        parse_policy("1,x=2", 64, 8)
    with pytest.raises(ValueError, match="must start with ahead"):
        parse_policy("a", 64, 8)


def test_plan_names_the_recommended_policy_and_max_bias_takes_effect(capsys):
    argv = ["--preset", "dapo", "--tasks", "8", "--group", "8", "--T", "0.5x", "--steps", "6"]
    argv += ["--warmup", "2", "--policies", "1; 1,admit=50%"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("recommended: ahead 1 (") and "within 0.02" in out[-1]
    assert main([*argv, "--max-bias", "0.9"]) == 0  # admitting half the tasks is now allowed
    assert capsys.readouterr().out.splitlines()[-1].startswith("recommended: ahead 1 + admit 4")


def test_plan_latency_flags_take_effect(capsys):
    argv = ["--preset", "tail", "--tasks", "8", "--group", "8", "--T", "1x", "--steps", "8"]
    argv += ["--warmup", "2", "--policies", "0"]

    def sync_fraction(*extra: str) -> float:
        assert main([*argv, *extra]) == 0
        out = capsys.readouterr().out.splitlines()
        return float(next(line for line in out if line.startswith("sync"))[28:].split()[0])

    instant = sync_fraction()
    fixed = sync_fraction("--latency", "0.05")
    drawn = sync_fraction("--latency", "0.05", "--latency-sigma", "0.6")
    assert instant > fixed > drawn
