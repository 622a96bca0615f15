"""``HTTPEngine(batch_groups=True)``: a group's requests go in one ``/generate`` of
SGLang's batch form (counted by a proxy in front of a real ``dew serve``), and each
comes back as it would alone: the same tokens and log-probs, its own abort."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

import dew.serving.http_engine as http_engine
from dew.core import Aborted, SamplingParams
from dew.serving.http_engine import HTTPEngine

from ._launch import Served, serve
from ._proxy import Proxy

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, stop_ids=())
SAMPLED = SamplingParams(max_tokens=4, temperature=1.0, stop_ids=())


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve("--demo", "tiny", "--max-batch", "16") as s:
        yield s


@pytest.mark.timeout(120)
def test_a_group_goes_in_one_request_and_each_call_comes_back_as_alone(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A window wide enough that every submit below lands in it, however loaded the machine.
    monkeypatch.setattr(http_engine, "_GATHER", 0.3)
    prompts = [[5, 6 + i] for i in range(4)]
    proxy = Proxy(("127.0.0.1", served.port))
    try:
        with HTTPEngine(proxy.url) as plain:
            alone = [plain.generate(p, GREEDY) for p in prompts]
        sent = proxy.generates
        with HTTPEngine(proxy.url, batch_groups=True) as batched:
            group = [batched.submit(p, GREEDY, affinity="g") for p in prompts]
            other = [batched.submit(p, SAMPLED, affinity="h") for p in prompts[:2]]
            single = batched.submit(prompts[0], GREEDY)  # no group: sent on its own
            calls = [f.result(timeout=60) for f in group]
            assert all(f.result(timeout=60).completion for f in [*other, single])
        assert proxy.generates - sent == 3  # one per group, and the lone one
    finally:
        proxy.close()
    assert [c.completion for c in calls] == [c.completion for c in alone]
    for got, want in zip(calls, alone, strict=True):
        assert got.log_probs == pytest.approx(want.log_probs, abs=1e-5)
        assert got.prompt == want.prompt and got.version == want.version


@pytest.mark.timeout(120)
def test_a_request_of_a_batch_stops_alone(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_engine, "_GATHER", 0.3)
    long = SamplingParams(max_tokens=800, temperature=1.0, stop_ids=())
    with HTTPEngine(served.url, batch_groups=True) as engine:
        stopped = threading.Event()
        stopped.set()
        never_sent = engine.submit([5, 6], GREEDY, affinity="g", stop=stopped)
        cut = engine.submit([5, 7], long, affinity="g")
        kept = engine.submit([5, 8], GREEDY, affinity="g")
        with pytest.raises(Aborted):
            never_sent.result(timeout=60)
        while engine.in_flight < 2:
            pass
        engine.abort(cut)
        with pytest.raises(Aborted):
            cut.result(timeout=60)
        assert len(kept.result(timeout=60).completion) == 4
