"""``dew serve`` as a real process on 127.0.0.1: token exactness, weight pushes, bad input,
aborts, auth, refusal to bind, shutdown. Nothing here mocks the server."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from dew.objectives.rl.grpo import GRPOObjective
from dew.serving.weights import BroadcastGroup, tensor_specs, write_weights

from ._helpers import Worker, hf_greedy, lively, prompts
from ._launch import Served, launch, rss_kib, run_once, serve

BOUND = 2e-4  # the in-process engine's bound against a full forward (test_server.py)
LONG = 1000  # completion tokens (of a 2-token prompt) of a request that outlives the checks


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    model = lively("qwen2", 1)
    folder = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def served(checkpoint: tuple[Path, torch.nn.Module]) -> Iterator[Served]:
    with serve("--model", str(checkpoint[0]), "--seed", "3", "--max-batch", "16") as s:
        yield s


def _body(ids: list[int], max_new: int, **sampling: Any) -> dict[str, Any]:
    return {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new, "stop_token_ids": [], **sampling},
        "return_logprob": True,
    }


def trainer_log_probs(
    model: torch.nn.Module,
    prompt: list[int],
    completion: list[int],
    temperature: float,
    support: list[list[int]] | None,
) -> list[float]:
    """The trainer's log-probs of ``completion``: GRPOObjective.packed_log_probs on one row."""
    tokens = np.array([prompt + completion])
    width = tokens.shape[1]
    batch: dict[str, np.ndarray] = {
        "tokens": tokens,
        "positions": np.arange(width)[None],
        "segments": np.ones((1, width), np.int64),
    }
    if support is not None:
        rows: list[list[int]] = [[] for _ in prompt] + support
        offsets = np.zeros((1, width + 1), np.int64)
        offsets[0, 1:] = np.cumsum([len(r) for r in rows])
        batch["support"] = np.array([[t for r in rows for t in r]], np.int64)
        batch["support_offsets"] = offsets
    with torch.no_grad():
        logp = GRPOObjective(temperature=temperature).packed_log_probs(model, batch)
    return logp[0, len(prompt) :].tolist()


def _check_exact(model: torch.nn.Module, prompt: list[int], out: dict[str, Any]) -> None:
    meta = out["meta_info"]
    completion = out["output_ids"]
    lps = [row[0] for row in meta["output_token_logprobs"]]
    assert [row[1] for row in meta["output_token_logprobs"]] == completion
    want = trainer_log_probs(
        model, prompt, completion, meta["dew_temperature"], meta["dew_support"]
    )
    assert lps == pytest.approx(want, abs=BOUND)


# --------------------------------------------------------------------------- exactness


@pytest.mark.timeout(180)
def test_log_probs_match_the_trainer_and_greedy_matches_generate(
    served: Served, checkpoint: tuple[Path, torch.nn.Module]
) -> None:
    model = checkpoint[1]
    vocab = model.config.vocab_size
    batch = prompts(6, vocab, seed=2)
    settings = [
        {"temperature": 1.0},
        {"temperature": 0.7},
        {"temperature": 1.3, "top_k": 5},
        {"temperature": 0.8, "top_p": 0.5},
        {"temperature": 1.0, "top_k": 20, "top_p": 0.9},
        {"temperature": 0.0},
    ]
    with served.client() as client, ThreadPoolExecutor(len(batch)) as pool:
        outs = list(
            pool.map(
                lambda a: client.post("/generate", json=_body(a[0], 16, **a[1])),
                zip(batch, settings, strict=True),
            )
        )
    for p, s, r in zip(batch, settings, outs, strict=True):
        assert r.status_code == 200, r.text
        out = r.json()
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 16}
        assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(p), 16)
        assert meta["weight_version"] == 0
        assert meta["dew_temperature"] == (s["temperature"] or 1.0)
        filtered = "top_k" in s or "top_p" in s or s["temperature"] == 0
        assert (meta["dew_support"] is not None) == filtered
        _check_exact(model, p, out)
        if s["temperature"] == 0:
            assert out["output_ids"] == hf_greedy(model, p, 16)


@pytest.mark.timeout(120)
def test_stop_ids_default_to_eos_and_rid_comes_back(served: Served) -> None:
    with served.client() as client:
        info = client.get("/get_model_info").json()
        assert info["is_generation"] is True and info["dew_vocab_size"] == 102
        assert info["dew_max_len"] == 1024 and info["dew_version"] == 0
        greedy = client.post("/generate", json=_body([7, 8, 9], 6, temperature=0)).json()
        stop = greedy["output_ids"][2]
        body = _body([7, 8, 9], 6, temperature=0, stop_token_ids=[stop])
        out = client.post("/generate", json={**body, "rid": "mine"}).json()
        assert out["output_ids"] == greedy["output_ids"][: greedy["output_ids"].index(stop) + 1]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert out["meta_info"]["id"] == "mine"
        plain = {"input_ids": [7], "sampling_params": {"max_new_tokens": 2}}
        meta = client.post("/generate", json=plain).json()["meta_info"]
        assert "output_token_logprobs" not in meta and meta["dew_support"] is None


# --------------------------------------------------------------------------- bad input


def _long(rid: str) -> dict[str, Any]:
    return {**_body([7, 8], LONG), "rid": rid}


def _still_served_then_abort(client: httpx.Client, long: Worker, rid: str) -> None:
    """The long request ran through everything checked meanwhile; abort it, see it answer."""
    assert not long.done.is_set(), "the long request ended before the checks did"
    assert client.post("/abort_request", json={"rid": rid}).json()["success"] is True
    r = long.join()
    assert isinstance(r, httpx.Response) and r.status_code == 200, r
    meta = r.json()["meta_info"]
    assert meta["finish_reason"] == {"type": "abort"} and meta["completion_tokens"] > 0


_BAD: list[tuple[str, Any, str]] = [
    ("/generate", b"{bad json", "body"),
    ("/generate", b"[1, 2]", "body"),
    ("/generate", {"input_ids": [7], "sampling_params": {"max_new_tokens": 2}, "x": 1}, "x"),
    ("/generate", {"input_ids": [7], "sampling_params": {"max_new_tokens": 2, "seed": 1}},
     "sampling_params.seed"),
    ("/generate", {"sampling_params": {"max_new_tokens": 2}}, "input_ids"),
    ("/generate", {"input_ids": [7]}, "sampling_params"),
    ("/generate", {"input_ids": [7], "sampling_params": {}}, "sampling_params.max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}, "text"),
    ("/generate", {"input_ids": [], "sampling_params": {"max_new_tokens": 2}}, "input_ids"),
    ("/generate", {"input_ids": [7, 102], "sampling_params": {"max_new_tokens": 2}}, "input_ids"),
    ("/generate", {"input_ids": [-1], "sampling_params": {"max_new_tokens": 2}}, "input_ids"),
    ("/generate", {"input_ids": ["7"], "sampling_params": {"max_new_tokens": 2}}, "input_ids"),
    ("/generate", {"input_ids": [7] * 1024, "sampling_params": {"max_new_tokens": 1}}, "input_ids"),
    ("/generate", {"input_ids": [7] * 1000, "sampling_params": {"max_new_tokens": 25}},
     "sampling_params.max_new_tokens"),
    ("/generate", {"input_ids": [7], "sampling_params": {"max_new_tokens": 0}},
     "sampling_params.max_new_tokens"),
    ("/generate", {"input_ids": [7], "sampling_params": {"max_new_tokens": -3}},
     "sampling_params.max_new_tokens"),
    ("/generate", {"input_ids": [7], "sampling_params": {"max_new_tokens": 2.5}},
     "sampling_params.max_new_tokens"),
    ("/generate", {"input_ids": [7], "sampling_params": {"max_new_tokens": 2, "temperature": -1}},
     "sampling_params.temperature"),
    ("/generate", {"input_ids": [7], "sampling_params": {"max_new_tokens": 2, "top_k": 0}},
     "sampling_params.top_k"),
    ("/generate", {"input_ids": [7], "sampling_params": {"max_new_tokens": 2, "top_p": 1.5}},
     "sampling_params.top_p"),
    ("/generate", {"input_ids": [7], "sampling_params": {"max_new_tokens": 2,
                                                          "stop_token_ids": [500]}},
     "sampling_params.stop_token_ids"),
    ("/generate", {"input_ids": [7], "sampling_params": {"max_new_tokens": 2},
                   "return_logprob": "yes"}, "return_logprob"),
    ("/generate", {"input_ids": [7], "sampling_params": {"max_new_tokens": 2},
                   "stream": True}, "stream"),
    ("/generate", {"input_ids": [7], "sampling_params": {"max_new_tokens": 2},
                   "return_hidden_states": True}, "return_hidden_states"),
    ("/abort_request", {}, "rid"),
    ("/abort_request", {"rid": "a", "abort_all": True}, "abort_all"),
    ("/update_weights_from_disk", {"model_path": "/nope"}, "dew_version"),
    ("/update_weights_from_disk", {"model_path": "/nope", "dew_version": 5}, "model_path"),
    ("/update_weights_from_distributed",
     {"names": [], "dtypes": [], "shapes": [], "group_name": "none", "dew_version": 5},
     "group_name"),
]  # fmt: skip


@pytest.mark.timeout(180)
def test_bad_input_answers_4xx_naming_the_field_while_serving(served: Served) -> None:
    with served.client() as client:
        long = Worker(lambda: client.post("/generate", json=_long("bad-input")))
        for path, body, param in _BAD:
            if isinstance(body, bytes):
                r = client.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = client.post(path, json=body)
            assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text)
            error = r.json()["error"]
            assert error["param"] == param, (body, error)
            assert error["type"] == "invalid_request_error"
            assert param.rsplit(".", 1)[-1] in error["message"] or param == "body", error
        # SGLang's flags at their defaults, as sglang-router relays every request, pass.
        relayed = {**_body([7], 1), "model": None, "stream": False, "log_metrics": True,
                   "return_text_in_logprobs": False, "return_hidden_states": False,
                   "background": False, "no_logs": False, "return_bytes": False,
                   "return_entropy": False}  # fmt: skip
        assert client.post("/generate", json=relayed).status_code == 200
        assert client.get("/nope").status_code == 404
        assert client.get("/generate").status_code == 405
        _still_served_then_abort(client, long, "bad-input")
        health = client.get("/health").json()
        assert health == {"status": "ok", "dew_version": 0, "dew_in_flight": 0, "dew_run": None}


# --------------------------------------------------------------------------- aborts


def _in_flight(client: httpx.Client, rid: str) -> bool:
    """A rid is in flight iff a valid one-token request reusing it is refused."""
    r = client.post("/generate", json={**_body([7], 1), "rid": rid})
    if r.status_code == 400:
        assert r.json()["error"]["param"] == "rid"
        return True
    assert r.status_code == 200, r.text
    return False


@pytest.mark.timeout(180)
def test_abort_by_rid_and_by_client_disconnect() -> None:
    # The base demo model: a LONG request must outlast the short client's 0.5 s read
    # timeout, which the tiny model's decode step no longer takes on a quiet machine.
    with serve("--demo", "base", "--max-batch", "16") as served, served.client() as client:
        kept = Worker(lambda: client.post("/generate", json={**_body([9, 8], LONG), "rid": "B"}))
        with httpx.Client(base_url=served.url, timeout=httpx.Timeout(60.0, read=0.5)) as short:
            with pytest.raises(httpx.ReadTimeout):  # the client gives up and disconnects
                short.post("/generate", json={**_body([9, 8], LONG), "rid": "A"})
        deadline = time.monotonic() + 30
        while _in_flight(client, "A"):
            assert time.monotonic() < deadline, "the disconnected request was never dropped"
            time.sleep(0.05)
        assert _in_flight(client, "B"), "B ran as long as A: A ended by itself, not by abort"
        assert client.post("/abort_request", json={"rid": "B"}).json()["success"] is True
        r = kept.join()
        assert isinstance(r, httpx.Response) and r.status_code == 200
        meta = r.json()["meta_info"]
        assert meta["finish_reason"] == {"type": "abort"} and meta["id"] == "B"
        assert 0 < meta["completion_tokens"] < LONG and meta["weight_version"] == 0
        again = client.post("/abort_request", json={"rid": "B"}).json()
        assert again["success"] is False  # finished: idempotent, nothing to do
        assert client.post("/abort_request", json={"rid": "never"}).json()["success"] is False
        assert client.get("/health").status_code == 200


# --------------------------------------------------------------------------- weight pushes


def _greedy_hits(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> np.ndarray:
    """Per completion token: is it ``model``'s argmax given the tokens before it."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0]
    best = logits[len(prompt) - 1 : -1].argmax(-1).numpy()
    return best == np.array(completion)


def _split(
    old: torch.nn.Module, new: torch.nn.Module, prompt: list[int], out: dict[str, Any]
) -> int:
    """The k such that tokens before k follow ``old`` and from k on ``new``: exact log-probs
    when sampled, argmax when greedy (whose log-probs are all 0)."""
    meta = out["meta_info"]
    completion, temp, sup = out["output_ids"], meta["dew_temperature"], meta["dew_support"]
    if sup is not None and all(len(row) == 1 for row in sup):  # greedy
        a, b = _greedy_hits(old, prompt, completion), _greedy_hits(new, prompt, completion)
    else:
        got = np.array([row[0] for row in meta["output_token_logprobs"]])
        a = np.abs(got - trainer_log_probs(old, prompt, completion, temp, sup)) <= BOUND
        b = np.abs(got - trainer_log_probs(new, prompt, completion, temp, sup)) <= BOUND
    n = len(completion)
    splits = [k for k in range(1, n) if a[:k].all() and b[k:].all()]
    assert splits, f"no split: old matches {a.sum()}/{n}, new matches {b.sum()}/{n}"
    assert not a.all() and not b.all(), "the push did not land inside the request"
    return splits[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_calls_spanning_a_weight_push(
    checkpoint: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    old, new = checkpoint[1], lively("qwen2", 2)
    path = write_weights(new, tmp_path, 1)
    with (
        serve("--model", str(checkpoint[0]), "--seed", "4", "--weights-dir", str(tmp_path)) as s,
        s.client(240) as client,
    ):
        reqs = [([11, 12], {"temperature": 1.0}), ([14, 15], {"temperature": 0.0})]
        workers = [Worker(lambda p=p, k=k: client.post("/generate", json=_body(p, LONG, **k)))
                   for p, k in reqs]  # fmt: skip
        time.sleep(0.3)  # both are decoding
        push = client.post("/update_weights_from_disk", json={"model_path": str(path),
                                                               "dew_version": 1})  # fmt: skip
        assert push.status_code == 200, push.text
        assert push.json() == {"success": True, "message": push.json()["message"],
                               "dew_version": 1}  # fmt: skip
        assert not any(w.done.is_set() for w in workers), "a request ended before the push"
        for (prompt, _), w in zip(reqs, workers, strict=True):
            # Two 1,000-token decodes: tens of seconds on a loaded 2-core machine.
            r = w.join(200)
            assert isinstance(r, httpx.Response) and r.status_code == 200, r
            out = r.json()
            assert out["meta_info"]["weight_version"] == 0  # the oldest that served a token
            _split(old, new, prompt, out)
        after = client.post("/generate", json=_body([11, 12], 12)).json()
        assert after["meta_info"]["weight_version"] == 1
        _check_exact(new, [11, 12], after)
        assert client.get("/health").json()["dew_version"] == 1


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_api_key_and_refused_pushes_keep_the_old_weights(
    checkpoint: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    old = checkpoint[1]
    good = write_weights(lively("qwen2", 2), tmp_path / "good", 3)
    data = good.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) - 100])
    corrupt = tmp_path / "corrupt.safetensors"
    flipped = bytearray(data)
    flipped[-5] ^= 0x10
    corrupt.write_bytes(bytes(flipped))
    llama = write_weights(lively("llama", 2), tmp_path / "llama", 4)
    prompt = [21, 22, 23]
    want = hf_greedy(old, prompt, 8)
    with serve(
        "--model",
        str(checkpoint[0]),
        "--version",
        "2",
        "--weights-dir",
        str(tmp_path),
        api_key="s3cret",
    ) as s:
        with httpx.Client(base_url=s.url, timeout=60) as anon:
            assert anon.get("/health").status_code == 200  # no key needed
            for bad in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                for method, path in (("GET", "/get_model_info"), ("POST", "/generate"),
                                     ("POST", "/update_weights_from_disk")):  # fmt: skip
                    r = anon.request(method, path, json=_body(prompt, 2), headers=bad)
                    assert r.status_code == 401, (bad, path, r.text)
                    assert r.json()["error"]["param"] == "authorization"
        with s.client() as client:
            long = Worker(lambda: client.post("/generate", json=_long("refusals")))
            refusals = [
                ({"model_path": str(good), "dew_version": 2}, "dew_version"),  # not newer
                ({"model_path": str(good), "dew_version": 1}, "dew_version"),  # older
                ({"model_path": str(good), "dew_version": 5}, "dew_version"),  # file says 3
                ({"model_path": str(truncated), "dew_version": 3}, "model_path"),
                ({"model_path": str(corrupt), "dew_version": 3}, "model_path"),
                ({"model_path": str(tmp_path / "missing"), "dew_version": 3}, "model_path"),
                ({"model_path": str(llama), "dew_version": 4}, "model_path"),  # wrong shapes
            ]
            for body, param in refusals:
                r = client.post("/update_weights_from_disk", json=body)
                assert r.status_code == 400, (body, r.text)
                out = r.json()
                assert out["success"] is False and out["error"]["param"] == param, out
                health = client.get("/health").json()
                assert (health["status"], health["dew_version"]) == ("ok", 2), health
                greedy = client.post("/generate", json=_body(prompt, 8, temperature=0)).json()
                assert greedy["output_ids"] == want and greedy["meta_info"]["weight_version"] == 2
            _still_served_then_abort(client, long, "refusals")
            ok = client.post("/update_weights_from_disk", json={"model_path": str(good),
                                                                "dew_version": 3})  # fmt: skip
            assert ok.status_code == 200 and ok.json()["dew_version"] == 3
            after = client.post("/generate", json=_body(prompt, 8, temperature=0)).json()
            assert after["meta_info"]["weight_version"] == 3
            assert after["output_ids"] == hf_greedy(lively("qwen2", 2), prompt, 8)


@pytest.mark.timeout(240)
def test_broadcast_push_over_http(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    new = lively("qwen2", 3)
    names, dtypes, shapes = tensor_specs(new)
    port = _free_port()
    with serve("--model", str(checkpoint[0])) as s, s.client() as client:
        trainer = Worker(lambda: BroadcastGroup("127.0.0.1", port, 2, group_name="g", timeout=60))
        init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                "world_size": 2, "group_name": "g", "backend": "gloo"}  # fmt: skip
        r = client.post("/init_weights_update_group", json=init)
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        group = trainer.join()
        assert isinstance(group, BroadcastGroup), trainer.error
        push = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": "g"}
        refused = client.post("/update_weights_from_distributed", json={**push, "dew_version": 0})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "dew_version"
        wrong = [[1, *shapes[0]], *shapes[1:]]
        r = client.post("/update_weights_from_distributed",
                        json={**push, "shapes": wrong, "dew_version": 1})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "shapes", r.text
        taker = Worker(
            lambda: client.post("/update_weights_from_distributed", json={**push, "dew_version": 1})
        )
        group.broadcast(new)
        r = taker.join()
        assert isinstance(r, httpx.Response) and r.status_code == 200, r
        assert r.json()["dew_version"] == 1
        out = client.post("/generate", json=_body([5, 6, 7], 10, temperature=0)).json()
        assert out["meta_info"]["weight_version"] == 1
        assert out["output_ids"] == hf_greedy(new, [5, 6, 7], 10)
        group.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --------------------------------------------------------------------------- process


@pytest.mark.timeout(120)
def test_non_loopback_bind_refused_without_a_key() -> None:
    start = time.monotonic()
    done = run_once(["--demo", "tiny", "--host", "0.0.0.0", "--port", "0"])
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "0.0.0.0" in lines[0] and "API key" in lines[0], done.stderr
    assert time.monotonic() - start < 60


@pytest.mark.timeout(180)
def test_sigterm_aborts_in_flight_requests_and_exits_zero() -> None:
    # The base demo model, so that LONG tokens take seconds even on a quiet machine.
    s = launch("--demo", "base", "--seed", "1")
    try:
        with s.client() as client:
            long = Worker(
                lambda: client.post("/generate", json={**_body([7, 8], LONG), "rid": "L"})
            )
            time.sleep(0.5)  # it is decoding (LONG tokens of the base model take seconds)
            assert not long.done.is_set()
            s.stop()
            r = long.join()
    finally:
        s.stop()
    assert s.returncode == 0, s.stderr
    assert isinstance(r, httpx.Response) and r.status_code == 200, r
    assert r.json()["meta_info"]["finish_reason"] == {"type": "abort"}


@pytest.mark.timeout(180)
def test_first_publish_at_the_initial_version_then_only_newer_or_the_same_weights(
    checkpoint: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    # A trainer's first push carries the number the server starts at (the scheduler
    # pushes at updates=0); a resume re-publishes what is served. Both must go through;
    # other weights under a served number, or an older number, must not.
    prompt = [21, 22, 23]
    first = write_weights(lively("qwen2", 4), tmp_path / "a", 0)
    other = write_weights(lively("qwen2", 5), tmp_path / "b", 0)
    with (
        serve("--model", str(checkpoint[0]), "--weights-dir", str(tmp_path)) as s,
        s.client() as client,
    ):

        def push(path: Path, version: int) -> httpx.Response:
            return client.post(
                "/update_weights_from_disk", json={"model_path": str(path), "dew_version": version}
            )

        def greedy() -> list[int]:
            out = client.post("/generate", json=_body(prompt, 8, temperature=0)).json()
            return out["output_ids"]

        assert greedy() == hf_greedy(checkpoint[1], prompt, 8)
        assert push(first, 0).status_code == 200  # the first publish, at the initial version
        assert greedy() == hf_greedy(lively("qwen2", 4), prompt, 8)
        again = push(first, 0)  # the same weights again: accepted, nothing changes
        assert again.status_code == 200 and again.json()["dew_version"] == 0
        refused = push(other, 0)  # other weights under the served number
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "dew_version"
        assert greedy() == hf_greedy(lively("qwen2", 4), prompt, 8)  # still the first
        # An older version, its file's own: refused by the version rule itself.
        newer = write_weights(lively("qwen2", 6), tmp_path / "c", 3)
        older = write_weights(lively("qwen2", 7), tmp_path / "d", 2)
        assert push(newer, 3).status_code == 200
        stale = push(older, 2)
        assert stale.status_code == 400, stale.text
        assert "not newer than the served version 3" in stale.json()["error"]["message"]
        assert greedy() == hf_greedy(lively("qwen2", 6), prompt, 8)


@pytest.mark.timeout(120)
def test_slow_clients_get_a_408_and_connections_are_bounded() -> None:
    with serve("--demo", "tiny", "--read-timeout", "0.5", "--max-connections", "3") as s:
        silent = socket.create_connection(("127.0.0.1", s.port), timeout=10.0)
        trickle = socket.create_connection(("127.0.0.1", s.port), timeout=10.0)
        try:
            trickle.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\ncontent-length: 90\r\n\r\n{")
            with s.client(timeout=10.0) as c:  # the third connection: still under the bound
                assert c.get("/health").status_code == 200
            for sock in (silent, trickle):
                t0, answer = time.monotonic(), b""
                while chunk := sock.recv(4096):
                    answer += chunk
                assert answer.startswith(b"HTTP/1.1 408"), answer
                assert time.monotonic() - t0 < 3.0
        finally:
            silent.close()
            trickle.close()
        held = [socket.create_connection(("127.0.0.1", s.port), timeout=10.0) for _ in range(3)]
        try:
            time.sleep(0.1)
            with s.client(timeout=10.0) as c:
                assert c.get("/health").status_code == 503  # past --max-connections
        finally:
            for sock in held:
                sock.close()
    assert "must be > 0" in run_once(["--demo", "tiny", "--read-timeout", "0"]).stderr


def _serving(c: httpx.Client) -> int:
    """How many /generate requests the server is serving (its ``dew_in_flight``)."""
    return int(c.get("/health").json()["dew_in_flight"])


def _abort_requests(s: Served, n: int, wave: int = 32) -> None:
    """``n`` long /generate requests abandoned mid-generation, ``wave`` at a time.

    Each wave is sent whole; the clients hang up once the server is generating all
    of them (``dew_in_flight``), and the next wave starts once it has dropped them
    all. Sent without pause, most would meet the connection bound (503) instead.
    """
    body = json.dumps(_body([9, 8], LONG)).encode()
    head = (
        b"POST /generate HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    )

    def until(c: httpx.Client, count: int) -> None:
        deadline = time.monotonic() + 30.0
        while (now := _serving(c)) != count:
            assert time.monotonic() < deadline, f"{now} in flight, waiting for {count}"
            time.sleep(0.002)

    with s.client(timeout=10.0) as c:
        for start in range(0, n, wave):
            socks = []
            try:
                for _ in range(min(wave, n - start)):
                    sock = socket.create_connection(("127.0.0.1", s.port), timeout=10.0)
                    socks.append(sock)
                    sock.sendall(head + body)
                until(c, len(socks))
            finally:
                for sock in socks:
                    sock.close()
            until(c, 0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_memory_stays_flat_over_ten_thousand_aborted_requests() -> None:
    with serve("--demo", "tiny", "--max-batch", "64") as s:
        # Warm up: allocator pools and caches may grow over the first requests. Measured
        # (2026-12-02, waves of 32): 378 MiB after 2,500 and still after 20,000.
        _abort_requests(s, 10_000)
        time.sleep(1.0)
        before = rss_kib(s.pid)
        _abort_requests(s, 10_000)
        time.sleep(2.0)
        # Had the aborts not been taken up, this would queue behind thousands of
        # generations of 1,000 tokens: the short timeout tells.
        with s.client(timeout=10.0) as c:
            assert c.get("/health").status_code == 200
            ok = c.post("/generate", json=_body([9, 8], 2))
            assert ok.status_code == 200, ok.text
        after = rss_kib(s.pid)
        assert after - before < 16 * 1024, (before, after)  # KiB: under 16 MiB of growth


@pytest.mark.timeout(180)
def test_a_push_reads_only_small_regular_files_under_the_weights_folder(
    checkpoint: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    folder = tmp_path / "weights"
    good = write_weights(lively("qwen2", 6), folder, 1)
    secret = tmp_path / "secret"
    secret.write_bytes(b"root:*:20000:0:99999:7:::\n" * 100)
    os.mkfifo(folder / "fifo")  # no writer: a read would block for ever
    (folder / "link").symlink_to(secret)
    huge = folder / "huge.safetensors"
    with huge.open("wb") as f:  # sparse: takes no memory or disk
        f.truncate(1 << 40)
    named = [
        (secret, "read only from"),
        (folder / ".." / "secret", "read only from"),
        (folder / "link", "read only from"),
        (tmp_path / "nothing-here", "read only from"),  # the same answer as a file that is
        (Path("/etc/shadow"), "read only from"),
        (Path("/proc/self/environ"), "read only from"),
        (Path("/dev/zero"), "read only from"),
        (folder / "fifo", "not a regular file"),
        (huge, "more than"),
    ]
    args = ("--model", str(checkpoint[0]), "--weights-dir", str(folder))
    with serve(*args) as s, s.client(30) as client:
        for path, why in named:
            start = time.monotonic()
            r = client.post(
                "/update_weights_from_disk", json={"model_path": str(path), "dew_version": 1}
            )
            assert r.status_code == 400 and why in r.text, (path, r.text)
            assert time.monotonic() - start < 5.0, path  # refused at once, never read
            assert "root:" not in r.text and "20000" not in r.text
        # Nothing held the weights lock: a good push goes through, and it is served.
        r = client.post(
            "/update_weights_from_disk", json={"model_path": str(good), "dew_version": 1}
        )
        assert r.status_code == 200, r.text
        assert client.get("/health").json()["dew_version"] == 1


@pytest.mark.timeout(180)
def test_extreme_sampling_values_fail_only_their_own_request(
    served: Served, checkpoint: tuple[Path, torch.nn.Module]
) -> None:
    model = checkpoint[1]
    batch = prompts(8, model.config.vocab_size, seed=9)
    extremes = [
        ({"temperature": 1e-300}, "temperature"),
        ({"temperature": 5e-3}, "temperature"),
        ({"temperature": 1e300, "top_p": 1e-300}, None),  # finite: served, and exact
        ({"top_k": 10**18}, None),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
    ]
    with served.client(120) as client, ThreadPoolExecutor(len(batch) + len(extremes)) as pool:
        good = [pool.submit(client.post, "/generate", json=_body(p, 40)) for p in batch]
        odd = [
            pool.submit(client.post, "/generate", json=_body(batch[0], 40, **values))
            for values, _ in extremes
        ]
        for (values, field), future in zip(extremes, odd, strict=True):
            r = future.result()
            if field is None:
                assert r.status_code == 200, (values, r.text)
                _check_exact(model, batch[0], r.json())
            else:
                assert r.status_code == 400 and field in r.json()["error"]["param"], r.text
        for prompt, future in zip(batch, good, strict=True):
            r = future.result()
            assert r.status_code == 200, r.text
            _check_exact(model, prompt, r.json())


@pytest.mark.timeout(180)
def test_joins_to_a_dead_address_are_bounded_and_block_neither_pushes_nor_sigterm(
    checkpoint: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    dead = _free_port()  # nobody listens there
    join = {"master_address": "127.0.0.1", "master_port": dead, "rank_offset": 1,
            "world_size": 2}  # fmt: skip
    good = write_weights(lively("qwen2", 7), tmp_path, 1)
    args = ("--model", str(checkpoint[0]), "--weights-dir", str(tmp_path), "--group-timeout", "3")
    s = launch(*args)
    try:
        with s.client(30) as client, ThreadPoolExecutor(8) as pool:
            start = time.monotonic()
            joins = [pool.submit(client.post, "/init_weights_update_group", json=join)
                     for _ in range(8)]  # fmt: skip
            # Pushes and generation go on while joins wait for a peer that never comes.
            push = client.post(
                "/update_weights_from_disk", json={"model_path": str(good), "dew_version": 1}
            )
            assert push.status_code == 200, push.text
            assert client.post("/generate", json=_body([5, 6], 4)).status_code == 200
            answers = [j.result() for j in joins]
            # One join at a time; it gives up within its bound, the others are told at once.
            assert {r.status_code for r in answers} <= {400, 409}
            assert any(r.status_code == 400 for r in answers)
            for r in answers:
                assert "\n" not in r.json()["error"]["message"], r.text
            assert time.monotonic() - start < 3 + 15
            # SIGTERM with a join under way: the server is gone within 10 s plus the bound.
            pending = pool.submit(client.post, "/init_weights_update_group", json=join)
            time.sleep(0.5)  # likely under way by now; the bound holds either way
            stopping = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            s.proc.wait(timeout=10 + 3 + 10)
            assert time.monotonic() - stopping < 10 + 3 + 5
            with pytest.raises(httpx.HTTPError):
                pending.result().raise_for_status()
    finally:
        s.stop()


@pytest.mark.timeout(120)
def test_an_idle_server_exits_at_once_on_sigterm() -> None:
    """Its own things closed, the server skips the interpreter's teardown of its heap."""
    s = launch("--demo", "tiny")
    try:
        with s.client() as client:
            assert client.get("/health").status_code == 200
        stopping = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=30) == 0
        # The interpreter's teardown alone takes longer than this.
        assert time.monotonic() - stopping < 0.6, time.monotonic() - stopping
    finally:
        s.stop()
