"""Real vLLM servers for tests: the vLLM environment, a tiny model folder, a process.

The vLLM environment is built by ``make vllm-env`` (``make test-slow`` builds it and
passes its interpreter as ``DEW_VLLM_PYTHON``); a test that needs it and finds none
fails saying so, never skips. Servers listen on 127.0.0.1 on a free port, are ready once
``/health`` answers, and are stopped by their own process group in a ``finally``.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from dew.demo.model import make_model, make_tokenizer
from dew.serving.vllm import VLLMProcess

ROOT = Path(__file__).resolve().parents[2]
START = 300.0  # seconds: a vLLM server starts in ~20 s alone, slower beside others
# float32 and eager, so its log-probs are comparable with the trainer's forward; a small
# key/value cache (GiB) and context, so a server fits beside others on a small machine.
ARGS = ("--dtype", "float32", "--max-model-len", "256", "--enforce-eager")
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
SIZE = "tiny64"  # heads of 64 dimensions: the smallest vLLM's CPU attention serves


def python() -> Path:
    """The vLLM environment's interpreter (``DEW_VLLM_PYTHON``, else ``.venv-vllm``)."""
    given = os.environ.get("DEW_VLLM_PYTHON")
    path = Path(given) if given else ROOT / ".venv-vllm" / "bin" / "python"
    if not path.is_file():
        pytest.fail(f"no vLLM environment at {path}: run `make vllm-env` (make test-slow does)")
    return path


def lively(seed: int) -> torch.nn.Module:
    """A tiny Qwen2 (tied embeddings) with weights scaled up, so greedy-ish and sampled
    decodes depend on every weight (at the default init they barely do)."""
    model = make_model("qwen2", SIZE, seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    return model


def save_model(folder: Path, seed: int = 0) -> Path:
    """A model folder vLLM can serve: config, weights and the demo tokenizer."""
    lively(seed).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


@contextmanager
def vllm_server(
    model: Path, weights_dir: Path, *args: str, env: dict[str, str] | None = None
) -> Iterator[VLLMProcess]:
    """One vLLM server of ``model`` (flags ``ARGS`` + ``args``); yields the process,
    whose ``url`` attribute is set; stopped on the way out however it ends."""
    proc = VLLMProcess(
        python(), model, weights_dir=weights_dir, args=[*ARGS, *args], env={**ENV, **(env or {})}
    )
    try:
        proc.url = proc.start(START, threading.Event())  # type: ignore[attr-defined]
        yield proc
    finally:
        proc.stop(20.0)


def metric(url: str, name: str) -> float:
    """The sum of a Prometheus metric's samples on ``url/metrics``."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"no metric {name} at {url}/metrics"
    return total


def wait_metric(url: str, name: str, ok: object, within: float = 60.0) -> float:
    """Poll ``metric(url, name)`` until ``ok(value)`` holds (bounded)."""
    deadline = time.monotonic() + within
    while True:
        value = metric(url, name)
        if ok(value):  # type: ignore[operator]
            return value
        assert time.monotonic() < deadline, f"{name} = {value} at {url} after {within}s"
        time.sleep(0.01)


def log_probs(
    model: torch.nn.Module, prompt: Sequence[int], completion: Sequence[int], t: float
) -> list[float]:
    """The trainer's log-prob of each completion token, at temperature ``t``."""
    ids = torch.tensor([[*prompt, *completion]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / t
    return logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


def spliced_log_probs(
    models: Sequence[torch.nn.Module], prompt: Sequence[int], completion: Sequence[int], t: float
) -> list[float]:
    """Log-probs of a decode whose weights changed while its keys and values were kept:
    ``models[i]`` sampled token ``i``, so it ran the step whose input was the token
    before (the prompt, for token 0), attending to whatever computed the earlier ones."""
    inputs = [*prompt, *completion[:-1]]
    # The model behind each input position: the prompt's is token 0's.
    owner = [models[0]] * (len(prompt) - 1) + list(models)
    logits, cache, at = [], None, 0
    with torch.no_grad():
        while at < len(inputs):
            end = at
            while end < len(inputs) and owner[end] is owner[at]:
                end += 1
            out = owner[at](torch.tensor([inputs[at:end]]), cache=cache, use_cache=True)
            cache = out.cache
            logits.append(out.logits[0])
            at = end
    scaled = torch.cat(logits)[len(prompt) - 1 :].float() / t
    return scaled.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()
