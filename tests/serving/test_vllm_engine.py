"""VLLMEngine against a real vLLM server (vLLM's CPU build) on 127.0.0.1.

One server of a tiny tied-embedding Qwen2, prefix caching on, serves the module; each
test first pushes weights of its own at the next version, so none depends on another's.
Shown here: calls token-exact against the trainer's forward before and after pushes and
on each side of an in-flight push (both ``on_load`` modes), pushes that serve exactly
the pushed weights through a warm prefix cache, bad pushes refused with the old weights
and version kept, aborts that end at once with their partial tokens and free the
server, and servers or sampling settings that do not fit refused in one line.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from dew.core import Aborted, SamplingParams
from dew.serving.vllm import VLLMEngine, VLLMProcess
from dew.serving.weights import write_weights

from ._helpers import Worker
from ._vllm import (
    lively,
    log_probs,
    metric,
    save_model,
    spliced_log_probs,
    vllm_server,
    wait_metric,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BOUND = 1e-4  # |vLLM's log-prob - the trainer's|, float32 on both sides (seen: ~1e-5)
T = 0.8
PROMPT = [10, 11, 12, 13, 14, 15]
LONG_PROMPT = [6 + (i * 7) % 90 for i in range(150)]  # more than one 128-token KV block
CONTEXT = 1024
DECODE = CONTEXT - len(PROMPT)  # the in-flight tests' decode, as long as the context allows


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, weights_dir: Path) -> Iterator[VLLMProcess]:
    model = save_model(tmp_path_factory.mktemp("model"))
    # A long context, so a decode under test outlasts many pushes.
    with vllm_server(model, weights_dir, "--max-model-len", str(CONTEXT)) as proc:
        yield proc


@pytest.fixture
def engine(server: VLLMProcess, weights_dir: Path) -> Iterator[VLLMEngine]:
    with VLLMEngine(server.url, weights_dir=weights_dir) as e:  # type: ignore[attr-defined]
        yield e


def _push_own(engine: VLLMEngine, seed: int) -> tuple[torch.nn.Module, int]:
    model = lively(seed)
    version = engine.version + 1
    engine.load(model, version)
    assert engine.version == version
    return model, version


def _close(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want)
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert worst < BOUND, worst
    return worst


def _label(url: str) -> str:
    return httpx.get(f"{url}/weight_info", timeout=10).json()["weight_version"]


def test_calls_are_token_exact_before_and_after_a_push(engine: VLLMEngine) -> None:
    for seed in (11, 12):
        model, version = _push_own(engine, seed)
        for prompt in (PROMPT, LONG_PROMPT[:40], [7]):
            call = engine.generate(prompt, SamplingParams(max_tokens=24, temperature=T))
            assert call.prompt == prompt and call.version == version
            assert call.temperature == T and call.finish_reason in ("stop", "length")
            _close(call.log_probs, log_probs(model, prompt, call.completion, T))
    # dew's stop rule: the stop id ends the completion and is kept as its last token.
    seen = engine.generate(PROMPT, SamplingParams(max_tokens=30, temperature=T, stop_ids=()))
    stop = seen.completion[5]
    call = engine.generate(PROMPT, SamplingParams(max_tokens=30, temperature=T, stop_ids=(stop,)))
    assert call.completion.count(stop) == 1 or call.finish_reason == "length"
    if call.finish_reason == "stop":
        assert call.completion[-1] == stop


@pytest.mark.parametrize("on_load", ["recompute", "keep"])
def test_a_push_serves_exactly_the_pushed_weights_through_a_warm_prefix_cache(
    server: VLLMProcess, weights_dir: Path, on_load: str
) -> None:
    url = server.url  # type: ignore[attr-defined]
    with VLLMEngine(url, weights_dir=weights_dir, on_load=on_load) as engine:
        old, _ = _push_own(engine, 21)
        params = SamplingParams(max_tokens=12, temperature=T)
        engine.generate(LONG_PROMPT, params)
        hits = metric(url, "vllm:prefix_cache_hits_total")
        call = engine.generate(LONG_PROMPT, params)  # the cache is warm: it serves the prompt
        assert metric(url, "vllm:prefix_cache_hits_total") > hits
        _close(call.log_probs, log_probs(old, LONG_PROMPT, call.completion, T))
        # The tied head and the cached prefix must both follow the push: either left on
        # the old weights is off by far more than BOUND.
        new, version = _push_own(engine, 22)
        for _ in range(2):
            call = engine.generate(LONG_PROMPT, params)
            assert call.version == version
            _close(call.log_probs, log_probs(new, LONG_PROMPT, call.completion, T))
        assert _label(url) == str(version)


def test_bad_pushes_are_refused_and_the_old_weights_keep_serving(
    engine: VLLMEngine, weights_dir: Path, tmp_path: Path
) -> None:
    model, version = _push_own(engine, 31)
    state = {k: v.clone() for k, v in lively(32).state_dict().items()}
    q = "model.layers.0.self_attn.q_proj.weight"
    wrong_shape = {**state, q: torch.zeros(state[q].shape[0] + 1, state[q].shape[1])}
    no_k = {k: v for k, v in state.items() if k != "model.layers.0.self_attn.k_proj.weight"}
    unknown = {**state, "model.extra.weight": torch.zeros(2, 2)}
    refusals = [
        (wrong_shape, version + 1, "shape"),
        (no_k, version + 1, "missing"),
        (unknown, version + 1, "unknown"),
        (state, version - 1, "older"),
        (state, version, "served already"),
    ]
    for bad, at, why in refusals:
        with pytest.raises(ValueError, match=why):
            engine.load(bad, at)
    corrupt = write_weights(state, weights_dir, version + 1)
    data = bytearray(corrupt.read_bytes())
    data[-1] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        engine.load_file(corrupt, version + 1)
    elsewhere = write_weights(state, tmp_path, version + 1)
    with pytest.raises(ValueError, match="read only from"):
        engine.load_file(elsewhere, version + 1)
    # Nothing changed: same version, same label, and the served weights are still model's.
    assert engine.health() and engine.version == version
    assert _label(engine.url) == str(version)
    call = engine.generate(PROMPT, SamplingParams(max_tokens=16, temperature=T))
    assert call.version == version
    _close(call.log_probs, log_probs(model, PROMPT, call.completion, T))
    engine.load(model, version)  # the same weights again: a no-op, not a refusal
    assert engine.version == version


def test_one_server_serves_run_after_run_and_a_held_one_only_by_takeover(
    server: VLLMProcess, weights_dir: Path
) -> None:
    url = server.url  # type: ignore[attr-defined]
    first = VLLMEngine(url, weights_dir=weights_dir, run="first")
    try:
        first.load(lively(71), first.version + 5)
        with VLLMEngine(url, weights_dir=weights_dir, run="second") as second:
            assert second.held_by == "first"
            with pytest.raises(ValueError, match="held by run 'first'"):
                second.load(lively(72), 0)
            first.close()  # releases the server
            model = lively(72)
            second.load(model, 0)  # its own sequence: 0, below the first run's versions
            assert second.version == 0 and _label(url) == "0"
            call = second.generate(PROMPT, SamplingParams(max_tokens=8, temperature=T))
            assert call.version == 0
            _close(call.log_probs, log_probs(model, PROMPT, call.completion, T))
            with VLLMEngine(url, weights_dir=weights_dir, run="third", takeover=True) as third:
                # Held by a live run: passes as a takeover only (which pauses with
                # mode=abort, ending that run's requests in flight).
                third.load(lively(73), 100)
                assert third.version == 100 and _label(url) == "100"
                with pytest.raises(ValueError, match="held by run 'third'"):
                    second.load(model, 1)  # and its next push refused
    finally:
        first.close()


def test_a_broadcast_push_serves_exactly_the_sent_weights(engine: VLLMEngine) -> None:
    _push_own(engine, 61)
    group = engine.open_broadcast()  # gloo here; the same code carries NCCL on GPUs
    try:
        for seed in (62, 63):
            model, version = lively(seed), engine.version + 1
            engine.load_broadcast(group, model, version)
            assert engine.version == version and _label(engine.url) == str(version)
            call = engine.generate(PROMPT, SamplingParams(max_tokens=16, temperature=T))
            assert call.version == version
            _close(call.log_probs, log_probs(model, PROMPT, call.completion, T))
            # Refused before anything is sent, so the group stays usable for the next.
            with pytest.raises(ValueError, match="not newer"):
                engine.load_broadcast(group, model, version)
            state = lively(64).state_dict()
            q = "model.layers.1.self_attn.q_proj.weight"
            state[q] = torch.zeros(3, 3)
            with pytest.raises(ValueError, match="shape"):
                engine.load_broadcast(group, state, version + 1)
            assert engine.health() and engine.version == version
        # Should the check be passed over (two trainers racing), the server's own guard
        # refuses after receiving the whole broadcast: the sender is not stranded, the
        # served weights stay, and the group serves the next push. (A broadcast that was
        # not checked names no run, and the server is held by this engine's.)
        model, version = lively(65), engine.version
        check = engine._rpc

        async def no_check(method: str, *args: str) -> dict:
            return {} if method == "dew_check_broadcast" else await check(method, *args)

        engine._rpc = no_check  # type: ignore[method-assign]
        try:
            with pytest.raises(ValueError, match="held by run"):
                engine.load_broadcast(group, model, version)
        finally:
            engine._rpc = check  # type: ignore[method-assign]
        assert engine.health() and engine.version == version
        engine.load_broadcast(group, model, version + 1)
        call = engine.generate(PROMPT, SamplingParams(max_tokens=16, temperature=T))
        assert call.version == version + 1
        _close(call.log_probs, log_probs(model, PROMPT, call.completion, T))
    finally:
        group.close()


def _raw(url: str, prompt: list[int], tokens: int) -> dict:
    """A generation straight through vLLM's API: its tokens, log-probs and weight spans."""
    body = {
        "token_ids": prompt,
        "sampling_params": {
            "max_tokens": tokens,
            "temperature": T,
            "logprobs": 0,
            "ignore_eos": True,
            "top_k": 0,
            "top_p": 1.0,
        },
    }
    choice = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=120).json()
    choice = choice["choices"][0]
    return {
        "tokens": choice["token_ids"],
        "log_probs": [c["logprob"] for c in choice["logprobs"]["content"]],
        "spans": choice["weight_versions"],
    }


@pytest.mark.parametrize("on_load", ["recompute", "keep"])
def test_in_flight_pushes_are_exact_on_each_side_of_every_span(
    server: VLLMProcess, weights_dir: Path, on_load: str
) -> None:
    url = server.url  # type: ignore[attr-defined]
    with VLLMEngine(url, weights_dir=weights_dir, on_load=on_load) as engine:
        pair = (lively(42), lively(43))  # made beforehand: pushes follow back to back
        model, before = _push_own(engine, 41)
        models = {before: model}
        crossed = []
        # Pushes follow each other until the decode under test ends. Whether one lands
        # inside it is up to the machine's timing: a decode that ran between two pushes
        # is checked too, and a few attempts must see at least one push inside.
        for attempt in range(10):
            raw = Worker(lambda: _raw(url, PROMPT, DECODE))
            # Pushes start once the decode runs (a push before it is admitted is wasted).
            ended = raw.done
            wait_metric(url, "vllm:num_requests_running", lambda v, e=ended: v >= 1 or e.is_set())
            while not raw.done.is_set():
                version = engine.version + 1
                models[version] = pair[version % 2]
                engine.load(models[version], version)
            raw.join(120)
            assert raw.error is None, raw.error
            tokens, spans = raw.result["tokens"], raw.result["spans"]
            spans = [(int(s["version"]), s["start"], s["end"]) for s in spans]
            assert spans[0][1] == 0 and spans[-1][2] == len(tokens) == DECODE, spans
            by_token = [models[v] for v, start, end in spans for _ in range(start, end)]
            if on_load == "keep":  # later tokens attend to the keys/values older weights made
                want = spliced_log_probs(by_token, PROMPT, tokens, T)
            else:  # recomputed at each push: each token comes from its weights alone
                full = {v: log_probs(models[v], PROMPT, tokens, T) for v, _, _ in spans}
                want = [full[v][i] for v, start, end in spans for i in range(start, end)]
            _close(raw.result["log_probs"], want)
            if len(spans) > 1:
                crossed.append(attempt)
                break
        assert crossed, "no push landed inside a decode in 10 attempts"
        # Through the engine: a call is as old as its oldest token (kept prefixes: as old
        # as the version it was sent under). Alone, as a second decode beside the first
        # made pushes land in neither on a loaded host.
        submitted = engine.version
        through_engine = engine.submit(PROMPT, SamplingParams(max_tokens=DECODE, stop_ids=()))
        while not through_engine.done():
            version = engine.version + 1
            models[version] = pair[version % 2]
            engine.load(models[version], version)
        call = through_engine.result()
        if on_load == "keep":
            assert call.version == submitted
        else:
            assert submitted <= call.version < engine.version


def test_an_abort_ends_the_call_at_once_with_its_partial_tokens(engine: VLLMEngine) -> None:
    url = engine.url
    _push_own(engine, 51)
    wait_metric(url, "vllm:num_requests_running", lambda v: v == 0)
    long = SamplingParams(max_tokens=240, temperature=T, stop_ids=())
    future = engine.submit(PROMPT, long)
    wait_metric(url, "vllm:num_requests_running", lambda v: v >= 1)
    started = time.monotonic()
    engine.abort(future)
    with pytest.raises(Aborted) as caught:
        future.result(timeout=30)
    assert time.monotonic() - started < 2.0
    assert 0 <= caught.value.tokens < 240
    wait_metric(url, "vllm:num_requests_running", lambda v: v == 0, within=5.0)
    # The same through a stop event, and the server serves the next call normally.
    stop = threading.Event()
    future = engine.submit(PROMPT, long, stop=stop)
    wait_metric(url, "vllm:num_requests_running", lambda v: v >= 1)
    stop.set()
    with pytest.raises(Aborted):
        future.result(timeout=30)
    assert len(engine.generate(PROMPT, SamplingParams(max_tokens=8, temperature=T)).completion)


def test_sampling_it_cannot_score_exactly_is_refused_at_submit(engine: VLLMEngine) -> None:
    for params in (
        SamplingParams(max_tokens=4, temperature=0.0),
        SamplingParams(max_tokens=4, top_k=5),
        SamplingParams(max_tokens=4, top_p=0.9),
    ):
        with pytest.raises(ValueError, match="temperature > 0 and neither top_k nor top_p"):
            engine.submit(PROMPT, params)
    with pytest.raises(ValueError, match=f"max_len={CONTEXT}"):
        engine.submit(PROMPT, SamplingParams(max_tokens=CONTEXT))
    with pytest.raises(ValueError, match="on_load"):
        VLLMEngine(engine.url, on_load="later")


def test_a_server_that_does_not_fit_is_refused_in_one_line(
    tmp_path: Path, weights_dir: Path
) -> None:
    model = save_model(tmp_path / "model")
    with vllm_server(model, weights_dir, "--logprobs-mode", "raw_logprobs") as proc:
        with pytest.raises(ValueError, match="--logprobs-mode processed_logprobs") as caught:
            VLLMEngine(proc.url)  # type: ignore[attr-defined]
        assert "\n" not in str(caught.value)
    # A server on another weight-transfer backend serves file pushes, not broadcasts.
    other = ("--weight-transfer-config", '{"backend": "nccl"}')
    with vllm_server(model, weights_dir, *other) as proc:
        with VLLMEngine(proc.url, weights_dir=weights_dir) as engine:  # type: ignore[attr-defined]
            with pytest.raises(ValueError, match="backend 'nccl'") as caught:
                engine.open_broadcast()
            assert "\n" not in str(caught.value)
            engine.load(lively(5), 1)
            assert engine.version == 1
