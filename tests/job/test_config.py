"""dew train's config: every field checked and named, overrides typed, TOML round trip."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dew.core import SamplingParams
from dew.job.config import (
    JOB_ROLLOUT_TIMEOUT,
    JOB_TRUNCATION,
    ConfigError,
    JobConfig,
    load_config,
    parse_overrides,
)
from dew.objectives.rl.config import SchedulerConfig

BASE = """
[model]
path = "m"
[data]
path = "d.jsonl"
[[rewards]]
function = "pkg.mod:fn"
[sampling]
max_tokens = 8
[training]
steps = 10
[output]
run_dir = "r"
"""


def write(tmp_path: Path, text: str = BASE) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_defaults_are_the_librarys_own(tmp_path: Path) -> None:
    config = load_config(write(tmp_path))
    assert config.sampling_params() == SamplingParams(max_tokens=8)
    # The library's, except that a job bounds every rollout attempt and scores a
    # completion cut at max_tokens (its single-turn source's verdict stands).
    knobs = SchedulerConfig(timeout=JOB_ROLLOUT_TIMEOUT, truncation=JOB_TRUNCATION)
    assert config.scheduler_config() == knobs
    assert SchedulerConfig().timeout is None and JOB_ROLLOUT_TIMEOUT > 0
    assert SchedulerConfig().truncation == "mask" and JOB_TRUNCATION == "score"
    assert 'truncation = "score"' in config.to_toml()  # --print-config says so
    # Every field is printed; an unset one as a comment (TOML has no null).
    assert "\n# top_k = none\n" in config.to_toml() and "\n# admit = none\n" in config.to_toml()
    objective = config.grpo_objective()
    assert (objective.clip, objective.clip_high, objective.importance_cap) == (0.2, None, 2.0)
    assert config.data.column == "prompt" and not config.data.chat
    assert config.engine.kind == "in-process"


def test_non_default_values_take_effect(tmp_path: Path) -> None:
    text = (
        BASE
        + """
[scheduler]
groups = 16
ahead = 2
max_lag = 2
estimator = "group_std"
[objective]
clip_high = 0.28
"""
    )
    text = text.replace('path = "d.jsonl"', 'path = "d.jsonl"\nmessages_column = "msgs"')
    config = load_config(
        write(tmp_path, text), ["--sampling.temperature", "0.5", "--training.micro_batches", "4"]
    )
    assert config.training.micro_batches == 4
    assert config.grpo_objective(reference=object()).kl_coef == 0.0
    kl = load_config(write(tmp_path, text), ["--objective.kl_coef", "0.1"])
    assert kl.grpo_objective(reference=object()).kl_coef == 0.1
    # a rule's name, from the file or the command line, and a plain true
    for value, rule in (("negative", "negative"), ("true", "both")):
        side = load_config(write(tmp_path, text), ["--objective.clip_behavior", value])
        assert side.grpo_objective().clip_behavior == rule
    assert config.scheduler_config() == SchedulerConfig(
        groups=16,
        ahead=2,
        max_lag=2,
        estimator="group_std",
        timeout=JOB_ROLLOUT_TIMEOUT,
        truncation=JOB_TRUNCATION,
    )
    # The job's own defaults take other values.
    other = load_config(
        write(tmp_path, text), ["--scheduler.timeout", "30", "--scheduler.truncation", "mask"]
    )
    assert other.scheduler_config().timeout == 30.0
    assert other.scheduler_config().truncation == "mask"
    assert config.grpo_objective().clip_high == 0.28
    assert config.grpo_objective().temperature == 0.5  # the sampling temperature
    assert config.data.column == "msgs" and config.data.chat
    # The pool's bounds reach init_pool by name (dew train passes the section whole).
    assert config.parallel.hang_timeout == 30.0
    hang = load_config(write(tmp_path, text), ["--parallel.hang_timeout", "5"])
    assert hang.parallel.model_dump()["hang_timeout"] == 5.0


def test_a_vllm_engine_section_keeps_its_fields(tmp_path: Path) -> None:
    overrides = ["--engine.kind", "vllm", "--engine.python", sys.executable]
    overrides += ["--engine.args", '["--dtype", "float32"]', "--engine.on_load", "keep"]
    engine = load_config(write(tmp_path), overrides).engine
    assert (engine.kind, engine.python, engine.on_load) == ("vllm", sys.executable, "keep")
    assert engine.args == ("--dtype", "float32")
    urls = ["--engine.kind", "vllm", "--engine.urls", '["http://127.0.0.1:9"]']
    urls += ["--engine.weights_dir", "/dev/shm/w"]
    engine = load_config(write(tmp_path), urls).engine
    assert (engine.urls, engine.weights_dir) == (("http://127.0.0.1:9",), "/dev/shm/w")
    with pytest.raises(ConfigError, match="weights_dir is for engine processes"):
        load_config(write(tmp_path), ["--engine.weights_dir", "/dev/shm/w"])
    fleet = ["--engine.kind", "fleet", "--engine.router", "cache_aware"]
    assert load_config(write(tmp_path), fleet).engine.router == "cache_aware"
    with pytest.raises(ConfigError, match=r'router puts a launched fleet .*kind = "fleet"'):
        load_config(write(tmp_path), ["--engine.router", "cache_aware"])


def test_a_ray_engine_section_keeps_its_fields_and_refuses_strays(tmp_path: Path) -> None:
    ray = ["--engine.kind", "ray", "--engine.engines", "3", "--engine.address", "10.0.0.1:6379"]
    ray += ["--engine.resources", "{ GPU = 1, big_memory = 0.5 }"]
    engine = load_config(write(tmp_path), ray).engine
    assert (engine.kind, engine.engines, engine.address) == ("ray", 3, "10.0.0.1:6379")
    assert engine.resources == {"GPU": 1.0, "big_memory": 0.5}
    with pytest.raises(ConfigError, match=r'engine.*address and resources .*kind = "ray"'):
        load_config(write(tmp_path), ["--engine.address", "10.0.0.1:6379"])
    with pytest.raises(ConfigError, match=r"engine.*resources: every amount must be"):
        load_config(write(tmp_path), [*ray[:2], "--engine.resources", "{ GPU = -1 }"])
    with pytest.raises(ConfigError, match="devices: Ray places the engines"):
        load_config(write(tmp_path), [*ray[:4], "--engine.devices", '["cpu", "cpu", "cpu"]'])


def test_a_ray_engine_without_ray_installed_is_one_line_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # how Python blocks an import
    with pytest.raises(ConfigError, match=r"engine.*needs Ray: pip install 'dew\[ray\]'"):
        load_config(write(tmp_path), ["--engine.kind", "ray"])


def test_the_api_key_comes_from_a_file_or_the_environment_and_is_never_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    urls = ["--engine.kind", "urls", "--engine.urls", '["http://127.0.0.1:9"]']
    monkeypatch.delenv("DEW_API_KEY", raising=False)
    assert load_config(write(tmp_path), urls).engine.api_key() is None
    monkeypatch.setenv("DEW_API_KEY", "from-env")
    assert load_config(write(tmp_path), urls).engine.api_key() == "from-env"
    keyfile = tmp_path / "key"
    keyfile.write_text("from-file\n")
    config = load_config(write(tmp_path), [*urls, "--engine.api_key_file", str(keyfile)])
    assert config.engine.api_key() == "from-file"
    assert "from-file" not in config.to_toml() and "from-env" not in config.to_toml()
    for content, why in (
        (None, "cannot be read"),
        ("", "the key alone"),
        ("a\nb", "the key alone"),
    ):
        if content is None:
            keyfile.unlink()
        else:
            keyfile.write_text(content)
        with pytest.raises(ConfigError, match=f"api_key_file: .*{why}"):
            load_config(write(tmp_path), [*urls, "--engine.api_key_file", str(keyfile)])
    with pytest.raises(ConfigError, match="api_key_file is for servers at urls"):
        load_config(write(tmp_path), ["--engine.api_key_file", str(keyfile)])


def test_overrides_keep_their_types_and_reach_any_field(tmp_path: Path) -> None:
    assert parse_overrides(["--a.b", "2", "--a.c=0.5", "--a.d", "true", "--a.e", "[1, 2]"]) == [
        ("a.b", 2),
        ("a.c", 0.5),
        ("a.d", True),
        ("a.e", [1, 2]),
    ]
    assert parse_overrides(["--a.b", "some/path", "--a.c", "none"]) == [
        ("a.b", "some/path"),
        ("a.c", None),
    ]
    config = load_config(
        write(tmp_path),
        ["--rewards.0.weight", "2", "--sampling.stop_ids", "[3]", "--engine.kind", "fleet"],
    )
    assert config.rewards[0].weight == 2.0
    assert config.sampling_params().stop_ids == (3,)
    assert config.engine.kind == "fleet"
    with pytest.raises(ConfigError, match=r"overrides are --section\.field VALUE"):
        parse_overrides(["--steps", "3"])
    with pytest.raises(ConfigError, match="missing its value"):
        parse_overrides(["--training.steps"])
    with pytest.raises(ConfigError, match=r"rewards\.3 is not an entry"):
        load_config(write(tmp_path), ["--rewards.3.weight", "2"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("[training]", "[trainig]"), r"trainig: unknown key \(did you mean training\?\)"),
        (
            ("steps = 10", "steps = 10\nstep = 3"),
            r"training.step: unknown key \(did you mean training.steps\?\)",
        ),
        (("steps = 10", 'steps = "10"'), r"training.steps: .*integer.*\(got '10'\)"),
        (("steps = 10", "steps = 0"), r"training.steps: must be >= 1"),
        (("steps = 10", "lr = 0.1"), r"training.steps: required, but missing"),
        (("max_tokens = 8", "max_tokens = 0"), r"sampling.max_tokens: max_tokens must be >= 1"),
        (("max_tokens = 8", "max_tokens = 8\ntop_p = 2.0"), r"sampling.top_p: top_p must be in"),
        (('function = "pkg.mod:fn"', 'function = "fn"'), r"rewards.0.function: must be"),
        (("[output]", '[engine]\nkind = "urls"\n[output]'), r"engine: .*needs urls"),
        (("[output]", '[engine]\nkind = "gpu"\n[output]'), r"engine.kind: "),
        (("[output]", '[engine]\non_load = "keep"\n[output]'), r'on_load apply to kind = "vllm"'),
        (
            ("[output]", '[engine]\nkind = "vllm"\npython = "/no/python"\n[output]'),
            r"/no/python is not an executable Python interpreter",
        ),
        (
            ("[output]", '[engine]\nkind = "vllm"\nurls = ["http://h:1"]\nargs = ["-x"]\n[output]'),
            r"with urls none is launched",
        ),
        (("[output]", "[scheduler]\nahead = 3\n[output]"), r"scheduler.max_lag: max_lag=1 < ahead"),
        (("steps = 10", 'steps = 10\ndevice = "gpu0"'), r"training.device: 'gpu0' is not a device"),
        (
            ("[output]", '[engine]\nkind = "fleet"\ndevices = ["cuda:1"]\n[output]'),
            r"engine: devices: 1 given, one per engine: 2 \(engines\)",
        ),
        (
            (
                "[output]",
                '[engine]\nkind = "urls"\nurls = ["http://h:1"]\ndevices = ["cpu"]\n[output]',
            ),
            r"servers at urls place themselves",
        ),
        (("[output]", '[engine]\ndevices = ["tpu"]\n[output]'), r"'tpu' is not a device name"),
        (("[output]", "[engine]\ntakeover = true\n[output]"), r"takeover is for servers at urls"),
        (("[output]", '[scheduler]\nestimator = "best"\n[output]'), r"scheduler.estimator: "),
        (("[output]", "[objective]\nclip = -1.0\n[output]"), r"objective.clip: "),
        (
            ("[output]", '[objective]\nclip_behavior = "positive"\n[output]'),
            r"objective.clip_behavior: Input should be a valid boolean, or input should be "
            r"'both' or 'negative' \(got 'positive'\)$",
        ),
    ],
)
def test_every_problem_names_its_field(
    tmp_path: Path, change: tuple[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, BASE.replace(*change, 1)))


def test_devices_this_machine_lacks_are_one_line_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.chdir(tmp_path)  # where run_dir = "r" would be made
    from dew.job.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for override in (
        ["--training.device", "cuda"],
        ["--engine.kind", "fleet", "--engine.devices", "cpu,cuda:1"],
    ):
        assert main([str(write(tmp_path)), "--no-progress", *override]) == 2
        err = capsys.readouterr().err
        field = override[-2].lstrip("-")
        assert err == (
            f"dew train: error: {field}: {override[-1].split(',')[-1]}: CUDA is not "
            "available on this machine\n"
        )
        assert not (tmp_path / "r").exists()


@pytest.mark.timeout(120)
def test_the_engine_options_reach_the_engines_of_servers_at_urls(tmp_path: Path) -> None:
    from contextlib import ExitStack

    from dew.job._engines import make_engine
    from tests.serving._launch import serve

    with serve("--demo", "tiny") as server, ExitStack() as stack:
        argv = ["--engine.kind", "urls", "--engine.urls", server.url]
        plain = load_config(write(tmp_path), argv)
        config = load_config(write(tmp_path), [*argv, "--engine.batch_groups", "true"])
        for conf, batched in ((plain, False), (config, True)):
            fleet = make_engine(
                conf.engine, model=None, model_path="m", seed=0, max_batch=8, stack=stack,
                run=tmp_path / "run",
            )  # fmt: skip
            (member,) = fleet._members
            assert member.engine._batch_groups is batched
            assert member.engine.run.endswith(str((tmp_path / "run").resolve()))


def test_a_missing_or_broken_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[model\n"))
    with pytest.raises(ConfigError, match=r"rewards: .*at least one"):
        no_rewards = "rewards = []\n" + BASE.replace('[[rewards]]\nfunction = "pkg.mod:fn"', "")
        load_config(write(tmp_path, no_rewards))


def test_the_resolved_config_round_trips_through_toml(tmp_path: Path) -> None:
    config = load_config(write(tmp_path), ["--scheduler.oversample", "2", "--sampling.top_k", "5"])
    again = load_config(write(tmp_path, config.to_toml()))
    assert again == config
    assert isinstance(again, JobConfig)


def test_a_list_field_takes_a_plain_value_on_the_command_line(tmp_path: Path) -> None:
    config = load_config(
        write(tmp_path),
        [
            "--engine.kind",
            "urls",
            "--engine.urls",
            "http://127.0.0.1:1,http://127.0.0.1:2",
            "--model.lora_targets=q_proj",
            "--sampling.stop_ids",
            "7",
        ],
    )
    assert config.engine.urls == ("http://127.0.0.1:1", "http://127.0.0.1:2")
    assert config.model.lora_targets == ("q_proj",)
    assert config.sampling_params().stop_ids == (7,)
    listed = load_config(write(tmp_path), ["--sampling.stop_ids", "[7, 8]"])
    assert listed.sampling_params().stop_ids == (7, 8)  # TOML lists as before


def test_fields_lists_every_field_with_its_type_default_and_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import typing

    from dew.job.cli import main

    assert main(["--fields"]) == 0
    text = capsys.readouterr().out
    listed = [line.strip() for line in text.splitlines() if line.startswith("  ")]
    want = []
    for name, info in JobConfig.model_fields.items():
        section = info.annotation
        if typing.get_origin(section) is tuple:
            section = typing.get_args(section)[0]
        want += [f"{name}.{f}" for f in section.model_fields]
    assert len(listed) == len(want)
    # Each has its help: a field added without a word on what it does fails here.
    assert all("  # " in line and line.split("  # ")[1] for line in listed), [
        line for line in listed if "  # " not in line
    ]
    assert '  truncation: str = "score"  # ' in text and "timeout: float = 60.0" in text
