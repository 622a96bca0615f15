"""``dew train`` with ``[engine] kind = "vllm"``: on a running vLLM server given by URL,
and on servers it launches from the vLLM environment (vLLM's CPU build, 127.0.0.1)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from dew.demo.model import make_model, make_tokenizer

from ..serving._vllm import ARGS, ENV, python, vllm_server
from .test_train_cli import config, dew_train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("model")
    make_model("qwen2", "tiny64", seed=0, max_positions=256).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]


def test_dew_train_on_a_vllm_server_by_url(tmp_path: Path, model_dir: Path, monkeypatch) -> None:
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    weights = tmp_path / "weights"
    with vllm_server(model_dir, weights) as server:
        url = server.url  # type: ignore[attr-defined]
        path = config(tmp_path, model_dir)
        done = dew_train(
            str(path), "--engine.kind", "vllm", "--engine.urls", f'["{url}"]',
            "--engine.on_load", "keep", "--engine.weights_dir", str(weights),
            "--output.wandb", "false",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        records = _records(tmp_path / "run")
        assert [r["step"] for r in records] == [1, 2, 3]
        assert all(r["tasks"]["trained"] for r in records)
        # The server serves the weights of the last push (updates before step 3).
        assert httpx.get(f"{url}/weight_info").json()["weight_version"] == "2"


def test_dew_train_launches_vllm_servers(tmp_path: Path, model_dir: Path, monkeypatch) -> None:
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    path = config(tmp_path, model_dir)
    done = dew_train(
        str(path), "--engine.kind", "vllm", "--engine.engines", "1",
        "--engine.python", str(python()), "--engine.args", json.dumps(list(ARGS)),
        "--output.wandb", "false",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["tasks"]["trained"] for r in records)
    assert (tmp_path / "run" / "export" / "config.json").is_file()
