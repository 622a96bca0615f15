"""``dew train`` end to end: a subprocess on a saved model folder, a generated jsonl
dataset and a reward file in TRL's signature; config errors as one line and exit 2."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from dew.job.cli import main
from dew.job.run import lr_factor

# TRL's signature. A random model scores 0 on the copy task itself, which gives no
# update to check; this reward varies within every group from the first step. It notes
# how many completions each call is given, in a file beside it.
TRL_REWARD = """
from pathlib import Path

def copy_reward(prompts, completions, completion_ids, answer, **kwargs):
    with open(Path(__file__).with_name("sizes"), "a") as f:
        f.write(f"{len(completions)} ")
    assert all(m[-1]["role"] == "user" for m in prompts), prompts
    assert all(c[0]["role"] == "assistant" for c in completions), completions
    rows = zip(completion_ids, completions, answer)
    return [ids[0] / 100 + (c[0]["content"][:3] == a) for ids, c, a in rows]
"""


def make_model_dir(folder: Path) -> Path:
    """A tiny random model and the demo tokenizer, saved as a user's model folder."""
    from dew.demo.model import make_model, make_tokenizer

    make_model("qwen2", "tiny", seed=0, max_positions=64).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("model"))


def config(tmp_path: Path, model_dir: Path, **extra: str) -> Path:
    reward = tmp_path / "copy_reward.py"
    reward.write_text(TRL_REWARD)
    data = tmp_path / "copy-chat.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": d}], "answer": d}
        for d in ("123", "456", "789", "")
    ]
    rows[3]["messages"] = []  # unusable: reported, not trained
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    text = f"""
[model]
path = "{model_dir}"
[data]
path = "{data}"
messages_column = "messages"
eval_path = "{held_out}"
[[rewards]]
function = "{reward}:copy_reward"
[sampling]
max_tokens = 3
[scheduler]
groups = 4
truncation = "score"
[objective]
kl_coef = 0.05
[training]
steps = 3
tasks = 2
lr = 0.01
warmup_steps = 2
micro_batches = 2
eval_every = 2
eval_samples = 2
eval_temperature = 1.0
[output]
run_dir = "{tmp_path / "run"}"
checkpoint_every = 3
export_every = 2
tensorboard = false
wandb = true
"""
    for key, value in extra.items():
        text = text.replace(key, value)
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def dew_train(*args: str, api_key: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DEW_API_KEY"}
    env["OMP_NUM_THREADS"] = "1"
    if api_key is not None:
        env["DEW_API_KEY"] = api_key
    return subprocess.run(
        [sys.executable, "-m", "dew.cli", "train", *args, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dew_train_exports_a_model_transformers_loads(tmp_path: Path, model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    samples = {"export_every = 2": "export_every = 2\nsamples_every = 1\nsamples = 3"}
    done = dew_train(str(config(tmp_path, model_dir, **samples)))
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    # Samples: 3 of each step's trained rollouts, decoded, with reward and advantage.
    logged = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in logged] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    first = logged[0]
    assert set(first) == {"step", "task", "sample", "prompt", "completion", "reward", "advantage"}
    digits = {"0": "123", "1": "456", "2": "789"}  # each task's row, as config() writes it
    assert all(digits[s["task"]] in s["prompt"] for s in logged)  # the prompt, as text
    assert all(isinstance(s["completion"], str) and s["reward"] > 0 for s in logged)
    assert any(s["advantage"] != 0 for s in logged)
    # What the screen says: the skipped rows, then the end of the run in a few lines.
    said = [line for line in done.stderr.splitlines() if line.startswith("dew train: ")]
    assert said[0] == (
        "dew train: 1 of 4 data rows skipped (empty, or too long for the context with "
        f"sampling.max_tokens): listed in {run / 'skipped_rows.json'}"
    )
    assert said[-4].startswith("dew train: 3 steps in ")
    assert said[-3].startswith("dew train: mean reward ") and "over the last 1" in said[-3]
    assert said[-2].startswith("dew train: evaluation at step 3: mean reward ")
    assert said[-1] == f"dew train: done; exported to {run / 'export'}; plot in {run / 'plot.png'}"
    assert (run / "plot.png").stat().st_size > 0
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["metrics"]["kl_reference"] >= 0 for r in records)  # objective.kl_coef
    assert records[-1]["metrics"]["kl_reference"] > 0  # it moved away from the start
    assert json.loads((run / "skipped_rows.json").read_text()) == {
        "3": "messages must be a non-empty list"
    }
    assert (run / "config.toml").read_text().startswith("[model]")
    assert (run / "exports" / "step-2" / "config.json").is_file()  # export_every = 2

    start = AutoModelForCausalLM.from_pretrained(model_dir)
    trained = AutoModelForCausalLM.from_pretrained(run / "export")
    changed = [
        name
        for name, p in trained.state_dict().items()
        if not torch.equal(p, start.state_dict()[name])
    ]
    assert len(changed) > len(start.state_dict()) // 2, changed
    original, exported = (
        AutoTokenizer.from_pretrained(model_dir),
        AutoTokenizer.from_pretrained(run / "export"),
    )
    chat = [{"role": "user", "content": "123"}, {"role": "assistant", "content": "123"}]
    assert exported.apply_chat_template(chat, tokenize=False) == original.apply_chat_template(
        chat, tokenize=False
    )
    text = exported.apply_chat_template(chat, tokenize=False)
    assert exported(text)["input_ids"] == original(text)["input_ids"]

    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [(e["step"], e["rows"], e["samples"], e["errors"]) for e in evals] == [
        (2, 2, 2, 0),
        (3, 2, 2, 0),
    ]
    assert all(0 <= e["pass@2"] <= 1 and e["reward/mean"] > 0 for e in evals)  # ids[0] / 100 > 0
    # The reward is called once per group with the group's completions, as TRL calls it:
    # the probe's 3 rows one each, then 3 steps x 2 tasks of groups = 4 (a few more may
    # run ahead), and the evaluations' 2 rows x eval_samples = 2, twice.
    sizes = [int(n) for n in (tmp_path / "sizes").read_text().split()]
    assert sizes[:3] == [1, 1, 1] and sizes.count(2) == 4, sizes
    assert sizes.count(4) >= 6 and set(sizes) <= {1, 2, 3, 4}, sizes
    # A resume cannot change what its checkpoint and records depend on: one line.
    first_config = (run / "config.toml").read_text()
    odd = dew_train(str(tmp_path / "run.toml"), "--resume", "--scheduler.groups", "2")
    assert odd.returncode == 2 and odd.stderr.count("\n") == 1, odd.stderr[-3000:]
    assert odd.stderr.startswith("dew train: error: --resume: scheduler.groups (4 -> 2) cannot")
    assert not list(run.glob("config-resume-*"))
    # Resume: on to step 5 from the checkpoint of step 3, at another learning rate; the
    # change is said, and kept beside the first start's config.
    more = dew_train(
        str(tmp_path / "run.toml"), "--resume", "--training.steps", "5", "--training.lr", "0.005"
    )
    assert more.returncode == 0, more.stderr[-3000:]
    said = "resuming with changed settings: training.steps 3 -> 5, training.lr 0.01 -> 0.005"
    assert f"dew train: {said}\n" in more.stderr
    assert (run / "config.toml").read_text() == first_config
    assert "lr = 0.005" in (run / "config-resume-1.toml").read_text()
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    # W&B (offline): the resumed run's own W&B run holds every step once, as recorded.
    logged = wandb_history(run, (run / "wandb_id").read_text())
    assert [h["_step"] for h in logged] == [1, 2, 3, 4, 5]
    assert [h["loss"] for h in logged] == pytest.approx([r["loss"] for r in records])
    tables = [(h["samples/_type"], h["samples/nrows"]) for h in logged[3:]]
    assert tables == [("table-file", 3)] * 2  # each new step's samples, a W&B table
    steps = [json.loads(line)["step"] for line in (run / "samples.jsonl").read_text().splitlines()]
    assert steps == [s for s in range(1, 6) for _ in range(3)]  # none twice after the resume
    assert len({p.name.rsplit("-", 1)[1] for p in (run / "wandb").glob("offline-run-*")}) == 2


def wandb_history(run: Path, run_id: str = "*") -> list[dict[str, Any]]:
    """The history rows of a run folder's offline W&B runs (of ``run_id``), oldest first.
    The ``.wandb`` file is a LevelDB-style log (32 KiB blocks; records of a 4-byte
    checksum, a 2-byte length, a 1-byte type; after a 7-byte ``:W&B`` header) of
    protobuf ``Record``s."""
    from wandb.proto import wandb_internal_pb2 as pb2

    rows = []
    for path in sorted((run / "wandb").glob(f"offline-run-*-{run_id}/run-*.wandb")):
        data = path.read_bytes()
        assert data[:4] == b":W&B"
        pos, chunks = 7, b""
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            length, kind = struct.unpack_from("<HB", data, pos + 4)
            if left < 7 or (length == 0 and kind == 0):
                pos += left  # the rest of the block is padding
                continue
            chunks += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # a whole record, or the last part of one
                record = pb2.Record()
                record.ParseFromString(chunks)
                chunks = b""
                if record.WhichOneof("record_type") == "history":
                    rows.append(
                        {
                            (i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                            for i in record.history.item
                        }
                    )
    return rows


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("[training]", "[training]\nbatch = 3"), "training.batch: unknown key"),
        (("steps = 3", 'steps = "3"'), "training.steps: "),
        (
            ("copy_reward.py:copy_reward", "copy_reward.py:nope"),
            "rewards.0.function: .*has no 'nope'",
        ),
        (("copy_reward.py:", "missing.py:"), "rewards.0.function: .*missing.py: no such file"),
        (
            ('messages_column = "messages"', 'messages_column = "chat"'),
            "data.messages_column: 'chat' is not a column",
        ),
        (
            ("[model]\npath = ", "[model]\npath = 'nowhere' #"),
            "model.path: nowhere is not a model folder",
        ),
    ],
)
def test_config_errors_are_one_line_exit_2_and_leave_no_run_folder(
    tmp_path: Path,
    model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    change: tuple[str, str],
    message: str,
) -> None:
    path = config(tmp_path, model_dir, **{change[0]: change[1]})
    assert main([str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dew train: error: "), err
    import re

    assert re.search(message, err[0]), err[0]
    assert not (tmp_path / "run").exists()


def test_a_reward_file_that_fails_to_import(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no GPU here')\n")
    path = config(tmp_path, model_dir, **{"copy_reward.py:": "broken.py:"})
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert "rewards.0.function: " in err and "RuntimeError: no GPU here" in err
    assert not (tmp_path / "run").exists()


def test_lr_schedule() -> None:
    warm = [lr_factor(s, steps=10, warmup=4, schedule="constant") for s in range(6)]
    assert warm == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    linear = [lr_factor(s, steps=6, warmup=2, schedule="linear") for s in range(6)]
    assert linear == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    cosine = [lr_factor(s, steps=4, warmup=0, schedule="cosine") for s in range(4)]
    assert cosine == pytest.approx([1.0, 0.8535534, 0.5, 0.1464466])


@pytest.mark.timeout(300)
# peft 0.21 asks transformers 5 a deprecated question when loading the adapter back.
@pytest.mark.filterwarnings("ignore:.is_gradient_checkpointing. is deprecated:FutureWarning")
def test_lora_trains_only_the_adapter_and_exports_merged_and_adapter(
    tmp_path: Path, model_dir: Path
) -> None:
    import peft
    from transformers import AutoModelForCausalLM

    path = config(
        tmp_path,
        model_dir,
        **{"[model]\n": "[model]\nlora_rank = 4\nlora_alpha = 8.0\n", "lr = 0.01": "lr = 0.05"},
    )
    done = dew_train(str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    export = tmp_path / "run" / "export"
    start = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    merged = AutoModelForCausalLM.from_pretrained(export).state_dict()
    assert merged.keys() == start.keys()
    changed = {k for k in start if not torch.equal(start[k], merged[k])}
    # Only the adapted projections moved (the default targets: q, k, v, o).
    assert changed and all(
        k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))
        for k in changed
    ), changed
    assert not any("mlp" in k or "embed" in k or "norm" in k for k in changed)
    # The adapter alone, loaded onto the base model, gives the merged weights.
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    adapted = peft.PeftModel.from_pretrained(base, export / "adapter").merge_and_unload()
    again = adapted.state_dict()
    assert all(torch.allclose(again[k], merged[k], atol=1e-6) for k in merged)


def dew_train_torchrun(n: int, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
    return subprocess.run(
        [*cmd, "-m", "dew.cli", "train", *args, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
        check=False,
    )


def _torchrun_train(tmp_path: Path, model_dir: Path, n: int, tensor: int) -> None:
    from transformers import AutoModelForCausalLM

    path = config(tmp_path, model_dir, **{"wandb = true": "wandb = false"})
    path.write_text(path.read_text() + f"[parallel]\ntensor = {tensor}\n")
    done = dew_train_torchrun(n, str(path))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    run = tmp_path / "run"
    for folder in [run] + [run / f"rank{r}" for r in range(1, n)]:
        records = [json.loads(x) for x in (folder / "records.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2, 3]
    manifest = json.loads((run / "checkpoints" / "step-00000003" / "manifest.json").read_text())
    assert manifest["mesh"] == {"world": n, "data": n // tensor, "tensor": tensor}
    # The export is the whole model, gathered: transformers loads it, and it trained.
    start = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    trained = AutoModelForCausalLM.from_pretrained(run / "export").state_dict()
    changed = [n for n, p in trained.items() if not torch.equal(p, start[n])]
    assert len(changed) > len(start) // 2, changed
    assert (run / "exports" / "step-2" / "config.json").is_file()
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [2, 3]
    more = dew_train_torchrun(n, str(path), "--resume", "--training.steps", "4")
    assert more.returncode == 0, (more.stdout + more.stderr)[-4000:]
    records = [json.loads(x) for x in (run / "records.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]


@pytest.mark.slow  # multi-process: the slow step (keeps `make test` in its budget)
@pytest.mark.timeout(600)
def test_dew_train_under_torchrun_shards_the_model(tmp_path: Path, model_dir: Path) -> None:
    _torchrun_train(tmp_path, model_dir, 2, 1)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dew_train_under_torchrun_on_data_and_tensor_axes(tmp_path: Path, model_dir: Path) -> None:
    _torchrun_train(tmp_path, model_dir, 4, 2)


def test_dew_train_refuses_a_mesh_without_torchrun(tmp_path: Path, model_dir: Path) -> None:
    path = config(tmp_path, model_dir)
    done = dew_train(str(path), "--parallel.tensor", "2")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "parallel: data=None, tensor=2 needs that many processes" in done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # multi-process: the slow step (keeps `make test` in its budget)
@pytest.mark.timeout(300)
def test_dew_train_on_a_keyed_server_sends_its_key_and_never_writes_it(
    tmp_path: Path, model_dir: Path
) -> None:
    from ..serving._launch import serve

    key = "k3y-" + os.urandom(8).hex()
    keyfile = tmp_path / "key"
    keyfile.write_text(key + "\n")
    with serve("--model", str(model_dir), api_key=key) as server:
        path = config(tmp_path, model_dir)
        urls = ("--engine.kind", "urls", "--engine.urls", f'["{server.url}"]')
        for env_key, why in ((None, "missing API key"), ("wrong", "invalid API key")):
            done = dew_train(str(path), *urls, "--output.wandb", "false", api_key=env_key)
            assert done.returncode == 2, done.stderr[-2000:]
            lines = done.stderr.strip().splitlines()
            assert len(lines) == 1 and "engine.urls: " in lines[0] and why in lines[0], lines
            assert "DEW_API_KEY" in lines[0] and key not in done.stderr
            assert not (tmp_path / "run").exists()  # nothing left behind
        done = dew_train(
            str(path), *urls, "--engine.api_key_file", str(keyfile), "--output.wandb", "false",
            api_key="wrong",  # the file wins over the environment
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        run = tmp_path / "run"
        assert len((run / "records.jsonl").read_text().splitlines()) == 3
        for file in run.rglob("*"):
            if file.is_file() and file.stat().st_size < 1 << 20:
                assert key.encode() not in file.read_bytes(), file
        assert key not in done.stderr + done.stdout


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_one_dew_serve_serves_run_after_run_and_a_held_one_only_by_takeover(
    tmp_path: Path, model_dir: Path
) -> None:
    from dew.serving.http_engine import HTTPEngine

    from ..serving._launch import serve

    path = config(tmp_path, model_dir)
    with serve("--model", str(model_dir)) as server:
        urls = ("--engine.kind", "urls", "--engine.urls", server.url, "--output.wandb", "false")
        for name in ("first", "second"):  # the second counts from 0 after the first's 3
            batch = ["--engine.batch_groups", "true"] if name == "second" else []
            done = dew_train(str(path), *urls, "--output.run_dir", str(tmp_path / name), *batch)
            assert done.returncode == 0, done.stderr[-3000:]
        # A run still holding the server (killed before it released it, say).
        holder = HTTPEngine(server.url, run="elsewhere:/runs/old")
        try:
            holder.load(load_model(model_dir), 7)
            third = tmp_path / "third"
            refused = dew_train(str(path), *urls, "--output.run_dir", str(third))
            assert refused.returncode == 2, refused.stderr[-3000:]
            assert refused.stderr == (
                f"dew train: error: engine.urls: {server.url} is held by run "
                "'elsewhere:/runs/old', which has not released it: stop that trainer, or "
                "set engine.takeover = true to take the server over\n"
            )
            assert not third.exists()
            took = dew_train(
                str(path), *urls, "--output.run_dir", str(third), "--engine.takeover", "true"
            )
            assert took.returncode == 0, took.stderr[-3000:]
            with server.client() as client:  # the run ended: it let the server go
                assert client.get("/health").json()["dew_run"] is None
        finally:
            holder._pushed = False  # taken over: nothing of its own to release
            holder.close()
    steps = [
        [
            json.loads(line)["step"]
            for line in (tmp_path / n / "records.jsonl").read_text().splitlines()
        ]
        for n in ("first", "second", "third")
    ]
    assert steps == [[1, 2, 3]] * 3


def load_model(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_second_trainer_on_a_running_folder_is_refused_in_one_line(
    tmp_path: Path, model_dir: Path
) -> None:
    path = config(tmp_path, model_dir)
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "dew.cli", "train", str(path), "--no-progress"]
    argv += ["--training.steps", "500", "--output.wandb", "false"]
    first = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _await_records(first, run, 1, within=200, poll=0.1)
        for extra in ((), ("--resume",)):
            done = dew_train(str(path), "--output.wandb", "false", *extra)
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
            assert "in use by another process" in lines[0]
        assert first.poll() is None  # the first trains on, its folder untouched
    finally:
        first.kill()
        first.wait()


def _await_records(
    trainer: subprocess.Popen[Any], run: Path, lines: int, *, within: float, poll: float
) -> None:
    """Wait until ``run``'s records hold ``lines`` steps, ``trainer`` still running."""
    records = run / "records.jsonl"
    deadline = time.monotonic() + within
    while not records.is_file() or len(records.read_text().splitlines()) < lines:
        assert trainer.poll() is None, "the trainer exited before it recorded a step"
        assert time.monotonic() < deadline, f"{lines} steps not recorded in {within} s"
        time.sleep(poll)


def _children(pid: int) -> dict[int, str]:
    """The processes whose parent is ``pid``: their command lines."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found[int(entry.name)] = cmdline
    return found


def _gone(pids: Iterable[int], within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{p}").exists() for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_chaos_a_trainer_killed_takes_its_engines_and_weights_with_it(
    tmp_path: Path, model_dir: Path, sig: signal.Signals
) -> None:
    from dew.serving._folders import private_folder, release_folder, weights_root

    path = config(tmp_path, model_dir)
    before = set(weights_root().iterdir())
    argv = [sys.executable, "-m", "dew.cli", "train", str(path), "--no-progress"]
    argv += ["--training.steps", "500", "--output.wandb", "false"]
    argv += ["--engine.kind", "fleet", "--engine.engines", "2"]
    trainer = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        run = tmp_path / "run"
        _await_records(trainer, run, 1, within=300, poll=0.1)
        servers = {p for p, cmd in _children(trainer.pid).items() if "dew.serve" in cmd}
        dogs = {p for p, cmd in _children(trainer.pid).items() if "dew._watchdog" in cmd}
        assert len(servers) == 2 and len(dogs) == 2, _children(trainer.pid)
        ours = [p for p in set(weights_root().iterdir()) - before if p.is_dir()]
        assert len(ours) == 1 and ours[0].name.startswith("fleet-"), ours
        trainer.send_signal(sig)
        code = trainer.wait(timeout=60)
        err = trainer.stderr.read()  # type: ignore[union-attr]
        # Whatever ended it, its engines and their watchdogs end too, promptly.
        assert _gone(servers | dogs, within=30), _children(1)
        if sig == signal.SIGTERM:  # handled as Ctrl-C: cleaned up on the way out
            assert code == 130 and err.strip().splitlines()[-1].startswith(
                "dew train: interrupted; continue from the last checkpoint with --resume"
            ), err[-2000:]
            assert not ours[0].exists()
        else:  # no cleanup ran: the next folder made sweeps the dead run's away
            assert code == -signal.SIGKILL and ours[0].exists()
            time.sleep(5.5)  # the sweep leaves folders younger than 5 s (being made)
            mine = private_folder("test-")
            try:
                assert not ours[0].exists()
            finally:
                release_folder(mine)
            assert not mine.exists()
    finally:
        if trainer.poll() is None:
            trainer.kill()
        trainer.wait()
        trainer.stderr.close()  # type: ignore[union-attr]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_fleet_behind_sglang_router_from_the_config(tmp_path: Path, model_dir: Path) -> None:
    path = config(tmp_path, model_dir)
    argv = [sys.executable, "-m", "dew.cli", "train", str(path), "--no-progress"]
    argv += ["--training.steps", "6", "--output.wandb", "false"]
    argv += ["--engine.kind", "fleet", "--engine.engines", "2", "--engine.router", "round_robin"]
    trainer = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _await_records(trainer, tmp_path / "run", 1, within=300, poll=0.1)
        children = _children(trainer.pid)
        routers = {p for p, cmd in children.items() if cmd.startswith("sglang")}  # retitled
        servers = {p for p, cmd in children.items() if "dew.serve" in cmd}
        assert len(routers) == 1 and len(servers) == 2, children
        assert trainer.wait(timeout=300) == 0, trainer.stderr.read()[-3000:]  # type: ignore[union-attr]
        assert _gone(routers | servers, within=30)
        records = (tmp_path / "run" / "records.jsonl").read_text().splitlines()
        assert [json.loads(r)["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    finally:
        if trainer.poll() is None:
            trainer.kill()
        trainer.wait()
        trainer.stderr.close()  # type: ignore[union-attr]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chaos_a_run_killed_before_its_first_whole_checkpoint_resumes_from_step_0(
    tmp_path: Path, model_dir: Path
) -> None:
    path = config(tmp_path, model_dir)  # checkpoints every 3 steps of 3
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "dew.cli", "train", str(path), "--no-progress"]
    argv += ["--output.wandb", "false", "--output.checkpoint_every", "2", "--training.steps", "4"]
    trainer = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # SIGKILL once a step is recorded, and before the first checkpoint (step 2) is whole.
        _await_records(trainer, run, 1, within=200, poll=0.01)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    checkpoints = run / "checkpoints"
    if checkpoints.is_dir() and any(p.name.startswith("step-") for p in checkpoints.iterdir()):
        pytest.skip("the first checkpoint was whole before the kill landed")  # rare timing
    fresh = dew_train(str(path), "--output.wandb", "false")
    assert fresh.returncode == 2 and "add --resume" in fresh.stderr, fresh.stderr[-2000:]
    done = dew_train(
        str(path), "--resume", "--output.wandb", "false", "--output.checkpoint_every", "2",
        "--training.steps", "4",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "no complete checkpoint yet: starting from step 0" in done.stderr
    steps = [json.loads(line)["step"] for line in (run / "records.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


EXPORTER = """
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from dew.demo.model import make_model, make_tokenizer
from dew.job.run import export

folder, config = Path(sys.argv[1]), SimpleNamespace(model=SimpleNamespace(lora_rank=0))


class Stalling:
    # The tokenizer, whose second save says so and then waits to be killed: the kill
    # lands inside the export, its weights written and its tokenizer not.

    def __init__(self):
        self.tokenizer, self.saves = make_tokenizer(), 0

    def save_pretrained(self, path):
        self.saves += 1
        if self.saves == 2:
            print("inside", flush=True)
            time.sleep(600)
        return self.tokenizer.save_pretrained(path)


tokenizer = Stalling()
for i in range(2):
    export(make_model("qwen2", "tiny", seed=i), tokenizer, folder, config)
    print("done", i, flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chaos_an_export_killed_inside_leaves_the_previous_whole_one(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dew.demo.model import make_model

    folder = tmp_path / "export"
    partial = tmp_path / ".tmp-export"
    proc = subprocess.Popen(
        [sys.executable, "-c", EXPORTER, str(folder)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "done 0\n"
        assert proc.stdout.readline() == "inside\n"  # the second export, half written
        assert (partial / "model.safetensors").is_file()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    # export/ is the first export, whole: transformers loads it, with its tokenizer.
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    AutoTokenizer.from_pretrained(folder)
    first = make_model("qwen2", "tiny", seed=0).state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, first[name]), name


@pytest.mark.timeout(300)
def test_a_reward_that_fails_on_every_probe_is_a_config_error(
    tmp_path: Path, model_dir: Path
) -> None:
    """Before the first step the rewards are tried on the model's own completions of
    the first rows; failing on all of them, the run would train nothing: one line."""
    path = config(tmp_path, model_dir)
    (tmp_path / "copy_reward.py").write_text(
        "def copy_reward(prompts, completions, completion_ids, answer, **kwargs):\n"
        "    return [a.strip() + 1 for a in answer]  # str + int: a TypeError on every row\n"
    )
    done = dew_train(str(path), "--output.wandb", "false")
    assert done.returncode == 2, done.stderr[-3000:]
    line = done.stderr.strip()
    assert "\n" not in line and line.startswith("dew train: error: rewards: tried on the ")
    assert "failed on every one" in line and "raised TypeError" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(300)
def test_a_reward_that_fails_after_the_probe_stops_the_run_in_a_short_block_exit_3(
    tmp_path: Path, model_dir: Path
) -> None:
    path = config(tmp_path, model_dir)
    calls = tmp_path / "calls"
    (tmp_path / "copy_reward.py").write_text(
        "from pathlib import Path\n"
        "def copy_reward(prompts, completions, completion_ids, answer, **kwargs):\n"
        f"    with open({str(calls)!r}, 'a') as f:\n"
        "        f.write('.')\n"
        f"    if len(Path({str(calls)!r}).read_text()) > 3:  # the 3 probe calls pass\n"
        "        return [1 / int(c[0]['content'] == 'x') for c in completions]\n"
        "    return [0.5]\n"
    )
    done = dew_train(str(path), "--output.wandb", "false", "--training.steps", "20")
    assert done.returncode == 3, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("dew train: ")]
    assert "raised ZeroDivisionError: division by zero" in said[-2]  # shown once
    assert said[-1].startswith("dew train: stopped: 5 steps in a row (1..5) trained no token")
    assert "ZeroDivisionError" in said[-1]


@pytest.mark.timeout(300)
def test_masking_most_samples_early_is_a_warning_naming_the_knobs(
    tmp_path: Path, model_dir: Path
) -> None:
    path = config(tmp_path, model_dir, **{'truncation = "score"': 'truncation = "mask"'})
    done = dew_train(str(path), "--output.wandb", "false", "--sampling.max_tokens", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    warned = [line for line in done.stderr.splitlines() if "were masked" in line]
    assert len(warned) == 1 and warned[0].startswith("dew train: step 1: 100% of the samples")
    assert "sampling.max_tokens" in warned[0] and "scheduler.truncation = 'score'" in warned[0]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("non-utf8", r"data.path: .*copy-chat.jsonl is not UTF-8 text \(row 0: byte 0xff"),
        ("empty", r"data.path: .*copy-chat.jsonl is empty$"),
        ("few rows", r"training.tasks: 8 tasks a step, but data.path has 3 usable rows"),
        ("run_dir a file", r"output.run_dir: .*run is a file, not a run folder"),
        ("resume nothing", r"output.run_dir: .*run holds no run to resume .*leave out --resume"),
    ],
)
def test_data_and_folder_mistakes_are_one_line_exit_2_and_leave_nothing(
    tmp_path: Path,
    model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    case: str,
    message: str,
) -> None:
    import re

    path = config(tmp_path, model_dir)
    data = tmp_path / "copy-chat.jsonl"
    extra: list[str] = []
    if case == "non-utf8":
        data.write_bytes(b'{"messages": [{"role": "user", "content": "\xff"}], "answer": "1"}\n')
    elif case == "empty":
        data.write_bytes(b"")
    elif case == "few rows":
        extra = ["--training.tasks", "8"]
    elif case == "resume nothing":
        extra = ["--resume"]
    else:
        (tmp_path / "run").write_text("not a folder")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main([str(path), "--no-progress", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing left behind


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chaos_a_resume_after_a_kill_logs_each_step_to_wandb_once(
    tmp_path: Path, model_dir: Path
) -> None:
    path = config(tmp_path, model_dir)
    run = tmp_path / "run"
    settings = ["--output.checkpoint_every", "2", "--training.steps", "6"]
    argv = [sys.executable, "-m", "dew.cli", "train", str(path), "--no-progress", *settings]
    trainer = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # Killed once step 3 is recorded: the checkpoint of step 2 is the last whole one.
        _await_records(trainer, run, 3, within=200, poll=0.005)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    done = dew_train(str(path), "--resume", *settings)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    # The newest W&B run of the folder holds every step once, as recorded; the killed
    # one is a run of its own (same group).
    newest = (run / "wandb_id").read_text()
    logged = wandb_history(run, newest)
    assert [h["_step"] for h in logged] == [1, 2, 3, 4, 5, 6]
    assert [h["loss"] for h in logged] == pytest.approx([r["loss"] for r in records])
