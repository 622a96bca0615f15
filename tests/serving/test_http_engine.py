"""HTTPEngine against real ``dew serve`` processes on 127.0.0.1.

Token exactness (greedy: the in-process engine's tokens; sampled: the trainer's forward
pass), versions across pushes, aborts, faults (SIGKILL, SIGSTOP), bad input, close with
requests in flight, and a short training run of the demo task on an HTTPEngine.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, wait
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from dew.core import Aborted, Call, Engine, EngineError, Publisher, SamplingParams
from dew.serving import RolloutServer
from dew.serving.http_engine import HTTPEngine
from dew.serving.weights import write_weights

from ._helpers import WAIT, hf_greedy, lively, prompts
from ._launch import serve
from .test_server import _reference_log_probs

KEY = "test-key"  # the shared server wants it, so every request here proves it is sent
LONG = SamplingParams(max_tokens=900, stop_ids=())  # far longer than any test waits


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    """The weights every exactness check compares against (pushed to the server)."""
    return lively("qwen2", 4)


@pytest.fixture(scope="module")
def url(model: torch.nn.Module) -> Iterator[str]:
    """One ``dew serve --demo tiny`` process serving ``model`` (pushed as version 1)."""
    with serve("--demo", "tiny", "--max-batch", "32", api_key=KEY) as server:
        with HTTPEngine(server.url, api_key=KEY) as engine:
            engine.load(model, engine.version + 1)
        yield server.url


@pytest.fixture
def engine(url: str) -> Iterator[HTTPEngine]:
    with HTTPEngine(url, api_key=KEY, timeout=60) as e:
        yield e


def _in_table(engine: HTTPEngine, future: Future[Call]) -> bool:
    """Whether the server still holds the request behind ``future`` (its rid); a request
    it holds is aborted by the probe, so this checks requests that should be gone."""
    rid = future.rid  # type: ignore[attr-defined]
    answer = engine._block(
        engine._request("POST", "/abort_request", {"rid": rid}, retry=True, short=True)
    )
    return bool(answer["success"])


def _running(engine: HTTPEngine, count: int) -> None:
    """Wait until the server holds ``count`` requests (its ``/health`` counts them), so
    what the test does next meets them mid-generation. A fixed sleep here once let a
    request of 900 tokens finish first, once the decode step got fast enough."""
    deadline = time.monotonic() + WAIT
    while _held(engine) < count:
        assert time.monotonic() < deadline, "requests never reached the server"
        time.sleep(0.002)


def _held(engine: HTTPEngine) -> int:
    """Requests the server holds now (from its ``/health``, asked apart from the engine)."""
    with urllib.request.urlopen(f"{engine.url}/health", timeout=WAIT) as answer:
        return int(json.load(answer)["dew_in_flight"])


# --------------------------------------------------------------------------- contract


@pytest.mark.timeout(60)
def test_contract_properties_and_info(engine: HTTPEngine, model: torch.nn.Module) -> None:
    assert isinstance(engine, Engine) and isinstance(engine, Publisher)
    assert engine.vocab_size == model.config.vocab_size
    assert engine.max_len == model.config.max_position_embeddings
    assert engine.eos_token_ids == (model.config.eos_token_id,)
    assert engine.version >= 1
    assert engine.health()
    assert engine.url in repr(engine)


@pytest.mark.timeout(120)
def test_greedy_tokens_equal_the_in_process_engine(
    engine: HTTPEngine, model: torch.nn.Module
) -> None:
    batch = prompts(12, engine.vocab_size, seed=3)
    eos = engine.eos_token_ids[0]
    cases = [SamplingParams(max_tokens=24, temperature=0.0, stop_ids=())] * 8 + [
        SamplingParams(max_tokens=24, temperature=0.0)  # the model's eos ends it
    ] * 4
    futures = [engine.submit(p, sp) for p, sp in zip(batch, cases, strict=True)]
    with RolloutServer(model, seed=0) as local:
        want = [local.generate(p, sp) for p, sp in zip(batch, cases, strict=True)]
    for p, sp, f, w in zip(batch, cases, futures, want, strict=True):
        call = f.result(timeout=WAIT)
        assert list(call.prompt) == p
        assert list(call.completion) == list(w.completion)
        assert list(call.completion) == hf_greedy(
            model, p, 24, eos=None if sp.stop_ids == () else eos
        )
        assert call.log_probs == [0.0] * len(call.completion) == list(w.log_probs)
        assert call.support == [[t] for t in call.completion]
        assert call.temperature == 1.0 and call.finish_reason == w.finish_reason
        assert call.version == engine.version


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, None, None), (0.7, None, None), (1.3, 5, None), (0.8, None, 0.5), (1.0, 20, 0.9)],
)
def test_sampled_log_probs_equal_the_trainers_forward_pass(
    engine: HTTPEngine,
    model: torch.nn.Module,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
) -> None:
    params = SamplingParams(
        max_tokens=12, temperature=temperature, top_k=top_k, top_p=top_p, stop_ids=()
    )
    batch = prompts(4, engine.vocab_size, seed=2)
    futures = [engine.submit(p, params) for p in batch]
    for p, f in zip(batch, futures, strict=True):
        call = f.result(timeout=WAIT)
        assert list(call.prompt) == p and len(call.completion) == 12
        want, sets = _reference_log_probs(model, call, temperature, top_k, top_p)
        assert call.log_probs == pytest.approx(want, abs=2e-4)  # test_server.py's bound
        assert call.temperature == temperature and call.finish_reason == "length"
        if top_k is None and top_p is None:
            assert call.support is None
        else:
            assert call.support is not None
            assert [sorted(s) for s in call.support] == sets


@pytest.mark.timeout(120)
def test_versions_across_a_push(engine: HTTPEngine, model: torch.nn.Module) -> None:
    """Calls spanning a push report the old version and stay exact (the same weights are
    pushed again under a new number); calls after ``load`` returns get the new one."""
    before = engine.version
    # Long enough to outlast the push: 200 tokens once finished first on a loaded
    # machine, and 600 on a quiet one once the decode step got faster.
    params = SamplingParams(max_tokens=960, temperature=0.9, stop_ids=())
    batch = prompts(4, engine.vocab_size, seed=5)
    spanning = [engine.submit(p, params) for p in batch]
    _running(engine, len(spanning))
    engine.load(model, before + 1)
    running = [not f.done() for f in spanning]  # still generating once the push is in
    assert engine.version == before + 1
    after = engine.generate(batch[0], SamplingParams(max_tokens=4, temperature=0.9))
    assert after.version == before + 1
    calls = [f.result(timeout=WAIT) for f in spanning]
    assert all(c.version in (before, before + 1) for c in calls)
    spanned = [c for c, r in zip(calls, running, strict=True) if r and c.version == before]
    assert spanned, "no call spanned the push"
    want, _ = _reference_log_probs(model, spanned[0], 0.9, None, None)
    assert spanned[0].log_probs == pytest.approx(want, abs=2e-4)
    # A state dict, a file pushed by path, and a refusal keep the version straight.
    engine.load(model.state_dict(), before + 2)
    path = write_weights(model, Path(engine._folder()), before + 3)
    engine.load_file(path, before + 3)
    assert engine.version == before + 3
    engine.load_file(path, before + 3)  # the served weights again: an accepted no-op
    older = write_weights(model, Path(engine._folder()), before + 2)
    with pytest.raises(ValueError, match="dew_version"):
        engine.load_file(older, before + 2)  # older than the served version
    assert engine.version == before + 3 and engine.health()


# --------------------------------------------------------------------------- aborts


@pytest.mark.timeout(60)
def test_abort_by_stop_event_and_by_future(engine: HTTPEngine) -> None:
    stop = threading.Event()
    by_event = engine.submit([7, 8, 9], LONG, stop=stop)
    by_future = engine.submit([7, 8, 10], LONG)
    others = [engine.submit([7, 8, 11], LONG) for _ in range(2)]
    _running(engine, 4)
    t0 = time.monotonic()
    stop.set()
    engine.abort(by_future)
    for f in others:
        engine.abort(f)
        engine.abort(f)  # idempotent
    for f in (by_event, by_future, *others):
        with pytest.raises(Aborted) as info:
            f.result(timeout=WAIT)
        # Cut short, not run to its end: the tokens it had, far from LONG's.
        assert 0 <= info.value.tokens < LONG.max_tokens
    assert time.monotonic() - t0 < 10
    for f in (by_event, by_future):
        assert not _in_table(engine, f)  # the server's table let them go
    assert engine.in_flight == 0
    engine.abort(by_future)  # a resolved future: nothing happens
    # A stop already set: the request is never sent.
    stop2 = threading.Event()
    stop2.set()
    with pytest.raises(Aborted):
        engine.submit([7], LONG, stop=stop2).result(timeout=WAIT)
    assert engine.generate([7, 8], SamplingParams(max_tokens=3)).completion


# --------------------------------------------------------------------------- bad input


@pytest.mark.timeout(60)
def test_bad_input_is_a_value_error_naming_the_field(url: str, engine: HTTPEngine) -> None:
    vocab = engine.vocab_size
    with pytest.raises(ValueError, match=r"prompt\[1\]"):
        engine.submit([7, vocab], SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="max_len"):
        engine.submit([7], SamplingParams(max_tokens=engine.max_len))
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.submit([7], {"max_tokens": 3})  # type: ignore[arg-type]
    # What only the server can check comes back through the future, naming the field.
    engine._vocab = vocab + 10
    with pytest.raises(ValueError, match=r"input_ids\[1\]"):
        engine.submit([7, vocab + 1], SamplingParams(max_tokens=3)).result(timeout=WAIT)
    engine._vocab = vocab
    # Refused weights: corrupt file, wrong names.
    bad = Path(engine._folder()) / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ValueError, match="model_path"):
        engine.load_file(bad, engine.version + 1)
    with pytest.raises(ValueError, match="weights"):
        engine.load({"nope": torch.zeros(3)}, engine.version + 1)
    # A wrong API key is refused at construction; a missing server names its URL.
    with pytest.raises(ValueError, match="401"):
        HTTPEngine(url, api_key="wrong")
    with pytest.raises(ValueError, match="url"):
        HTTPEngine("127.0.0.1:80")
    for abort_urls in ("http://127.0.0.1:1", ["127.0.0.1:1"]):  # a str, a URL without scheme
        with pytest.raises(ValueError, match="abort_urls"):
            HTTPEngine(url, abort_urls=abort_urls)
    assert engine.generate([7, 8], SamplingParams(max_tokens=3)).completion  # still serving


@pytest.mark.timeout(60)
def test_an_unreachable_server_is_named_at_construction() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=f"127.0.0.1:{port}"):
        HTTPEngine(f"http://127.0.0.1:{port}", startup_timeout=1.0, connect_timeout=0.5)
    assert time.monotonic() - t0 < 10


# --------------------------------------------------------------------------- lifetime


@pytest.mark.timeout(60)
def test_close_fails_what_is_in_flight(url: str) -> None:
    with HTTPEngine(url, api_key=KEY) as probe:
        engine = HTTPEngine(url, api_key=KEY)
        futures = [engine.submit([7, 8, i + 6], LONG) for i in range(4)]
        deadline = time.monotonic() + WAIT
        while engine.in_flight < 4:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)  # let them reach the server
        engine.close()
        for f in futures:
            with pytest.raises(RuntimeError, match="closed"):
                f.result(timeout=0)
        assert not engine._thread.is_alive()
        with pytest.raises(RuntimeError, match="closed"):
            engine.submit([7], LONG)
        with pytest.raises(RuntimeError, match="closed"):
            engine.load_file("/nonexistent", 99)
        assert not engine.health()
        engine.close()  # idempotent
        deadline = time.monotonic() + WAIT
        while any(_in_table(probe, f) for f in futures):  # the server drops them
            assert time.monotonic() < deadline, "the server kept a closed engine's requests"
            time.sleep(0.05)
        assert probe.generate([7, 8], SamplingParams(max_tokens=3)).completion


@pytest.mark.timeout(60)
def test_blocking_calls_are_refused_on_the_loop_thread(engine: HTTPEngine) -> None:
    seen: list[BaseException] = []

    def callback(f: Future[Call]) -> None:
        try:
            engine.generate([7], SamplingParams(max_tokens=2))
        except RuntimeError as exc:
            seen.append(exc)

    engine.submit([7, 8], SamplingParams(max_tokens=2)).add_done_callback(callback)
    deadline = time.monotonic() + WAIT
    while not seen:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert "loop thread" in str(seen[0])


# --------------------------------------------------------------------------- faults


@pytest.mark.timeout(90)
def test_a_killed_server_turns_calls_into_engine_errors() -> None:
    with serve("--demo", "tiny") as server:
        engine = HTTPEngine(server.url, timeout=30, connect_timeout=1)
        try:
            futures = [engine.submit([7, 8, i + 6], LONG) for i in range(4)]
            _running(engine, len(futures))
            os.kill(server.pid, signal.SIGKILL)
            server.proc.wait(timeout=WAIT)
            done, _ = wait(futures, timeout=WAIT)
            assert len(done) == len(futures)
            for f in futures:
                with pytest.raises(EngineError, match=server.url):
                    f.result()
            later = engine.submit([7, 8], SamplingParams(max_tokens=3))
            with pytest.raises(EngineError, match="connect"):
                later.result(timeout=WAIT)
            assert not engine.health()
            with pytest.raises(EngineError):
                engine.load_file("/nonexistent", 99)
        finally:
            engine.close()


@pytest.mark.timeout(90)
def test_a_stopped_server_times_out_into_engine_errors() -> None:
    with serve("--demo", "tiny") as server:
        engine = HTTPEngine(server.url, timeout=2.0, connect_timeout=0.5)
        try:
            assert engine.generate([7], SamplingParams(max_tokens=2)).completion
            os.kill(server.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            futures = [engine.submit([7, 8, i + 6], LONG) for i in range(3)]
            for f in futures:
                with pytest.raises(EngineError, match="no answer in time"):
                    f.result(timeout=WAIT)
            took = time.monotonic() - t0
            assert 1.5 < took < 6.0, took
            assert not engine.health()
            os.kill(server.pid, signal.SIGCONT)  # it serves again
            call = engine.generate([7, 8], SamplingParams(max_tokens=3))
            assert len(call.completion) >= 1 and engine.health()
        finally:
            os.kill(server.pid, signal.SIGCONT)
            os.kill(server.pid, signal.SIGKILL)
            engine.close()


# --------------------------------------------------------------------------- training


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_scheduler_trains_the_demo_task_on_an_http_engine(tmp_path: Path) -> None:
    from dew.demo.run import DemoConfig, build_job
    from dew.train import fit, read_records

    steps = 4
    config = DemoConfig.for_task("single", steps=steps, batch_size=2, group_size=8)
    with ExitStack() as stack:
        server = stack.enter_context(serve("--demo", "tiny", "--max-batch", "64"))
        engine = stack.enter_context(HTTPEngine(server.url, timeout=60))
        # The engine is the publisher too: every push goes to the server.
        job = build_job(config, stack, engine=engine)
        model, optimizer, dataset = job.model, job.optimizer, job.dataset
        scheduler, objective = job.scheduler, job.objective

        # The server serves the trainer's initial weights (the same demo config and
        # seed) as version 0: its log-probs are the trainer's forward pass.
        call = engine.generate([7, 8, 9, 10], SamplingParams(max_tokens=6, stop_ids=()))
        assert call.version == 0
        assert call.log_probs == pytest.approx(
            _reference_log_probs(model, call, 1.0, None, None)[0], abs=2e-4
        )
        result = fit(
            model,
            optimizer,
            dataset,
            scheduler,
            objective,
            steps=steps,
            run_dir=tmp_path,
            checkpoint_every=steps,
            tensorboard=False,
        )
        assert result.updates == steps
        assert engine.version == steps - 1  # the scheduler pushed before each later step
        assert engine.health()
    records = read_records(tmp_path)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        sched = r["scheduler"]
        assert sched["updates"] == r["step"] - 1
        assert 0 <= sched["lag"] <= config.max_lag
        assert sched["version"] == sched["updates"] - sched["lag"]
        assert sched["resubmitted"].get("infra_error", 0) == 0  # no request was lost
        assert sched["groups"] + sched["cut"] + sched["abandoned"] <= config.batch_size
        assert sum(len(ids) for ids in r["tasks"].values()) == config.batch_size
        reward = sched["metrics"].get("reward/mean")
        assert reward is None or (math.isfinite(reward) and 0.0 <= reward <= 1.0)
        assert math.isfinite(r["loss"]) and r["trained_tokens"] > 0
    assert any("reward/mean" in r["scheduler"]["metrics"] for r in records)
