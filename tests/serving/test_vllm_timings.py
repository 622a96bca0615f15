"""VLLMEngine's timings against a real vLLM server (vLLM's CPU build) on 127.0.0.1.

The log is built from the server's ``/metrics`` one window per read (the engine's
module docstring): a fresh server has none, requests sent together are logged at their
count, and a later read adds its own window to the same cumulative log. The parsing
and windowing on captured texts: test_vllm_metrics.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dew.core import SamplingParams, Timed
from dew.serving.fleet import EngineFleet
from dew.serving.vllm import VLLMEngine

from ._helpers import WAIT
from ._vllm import save_model, vllm_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_timings_count_the_servers_steps_window_by_window(tmp_path: Path) -> None:
    model = save_model(tmp_path / "model")
    weights = tmp_path / "weights"
    weights.mkdir()
    with (
        vllm_server(model, weights, "--max-num-seqs", "8") as server,
        VLLMEngine(server.url, weights_dir=weights) as engine,  # type: ignore[attr-defined]
    ):
        assert isinstance(engine, Timed)
        [fresh] = engine.timings()
        assert fresh.name == engine.url and fresh.max_active == 8  # the server's max_num_seqs
        assert fresh.iterations.iterations == 0
        sp = SamplingParams(max_tokens=16, temperature=1.0, stop_ids=())
        futures = [engine.submit([10 + i, 11, 12, 13], sp) for i in range(4)]
        calls = [f.result(timeout=WAIT) for f in futures]
        assert all(len(c.completion) == 16 for c in calls)
        [first] = engine.timings()
        rows = first.iterations.rows()
        assert first.iterations.iterations >= 15  # a request of 16 tokens takes 16 steps
        assert all(1 <= active <= 8 for active in rows) and all(s > 0 for _, s in rows.values())
        # One window: its steps at their mean count, about the 64 tokens they made.
        [(active, (steps, seconds))] = rows.items()
        assert 60 <= active * steps <= 68 and 0 < seconds / steps < 1.0

        call = engine.generate(
            [5, 6, 7], SamplingParams(max_tokens=12, temperature=1.0, stop_ids=())
        )
        [second] = engine.timings()
        ran = second.iterations.since(first.iterations)
        assert ran.iterations >= len(call.completion) - 1 and 1 in ran.rows()
        assert second.iterations.iterations == first.iterations.iterations + ran.iterations
        # A fleet of it reports its entry, named by the URL, from the same server.
        with EngineFleet([engine.url], engine="vllm", weights_dir=weights) as fleet:
            [entry] = fleet.timings()
        assert (
            entry.name == engine.url and entry.iterations.iterations >= second.iterations.iterations
        )
