"""VLLMEngine's timings from vLLM's ``/metrics``: the parsing and the windows.

The three texts under ``data/`` are real: one vLLM 0.32 CPU server of the tests' tiny
Qwen2 (``tests/serving/_vllm.py``'s flags, ``--max-num-seqs 8``), scraped after 4
requests of 16 tokens sent together (``vllm_metrics_1.txt``), then after 8 of 24
(``_2``), then after one of 12 (``_3``). Their counters, read by hand from the texts,
are the expected values here. The engine against a live server: test_vllm_timings.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dew.core import IterationLog
from dew.serving.vllm._engine import MetricWindows, Scrape, parse_metrics

DATA = Path(__file__).parent / "data"

# (iteration_tokens_total_count, generation_tokens_total, inter_token_latency sum, count)
S1, S2, S3 = 0.2322672789596254, 0.8462791009806097, 0.8786212679697201
READS = [
    Scrape(17.0, 64.0, S1, 60.0),
    Scrape(42.0, 256.0, S2, 244.0),
    Scrape(54.0, 268.0, S3, 255.0),
]


def _text(i: int) -> str:
    return (DATA / f"vllm_metrics_{i + 1}.txt").read_text()


def _rows(log: IterationLog) -> dict[int, tuple[int, object]]:
    """The log's rows, seconds compared up to float rounding."""
    return {k: (n, pytest.approx(s, rel=1e-12)) for k, (n, s) in log.rows().items()}


def test_the_counters_are_read_from_real_texts_summed_over_label_sets() -> None:
    for i, want in enumerate(READS):
        assert parse_metrics(_text(i)) == want
    # One label set more (a second engine of the server) adds to each counter.
    extra = _text(0).replace('engine="0"', 'engine="1"')
    assert parse_metrics(_text(0) + extra) == Scrape(34.0, 128.0, 2 * S1, 120.0)


def test_each_read_adds_its_window_as_one_row_at_the_mean_sequence_count() -> None:
    windows = MetricWindows()
    first = windows.update(_text(0))  # from the server's start: 4 requests together
    # 64 tokens in 17 steps: 3.76 sequences a step -> 4; each step the mean latency.
    assert _rows(first) == {4: (17, 17 * S1 / 60)}
    second = windows.update(_text(1))  # 8 together: 192 tokens in 25 steps -> 8
    per = (S2 - S1) / (244 - 60)
    assert _rows(second) == {4: (17, 17 * S1 / 60), 8: (25, 25 * per)}
    third = windows.update(_text(2))  # one alone: 12 tokens in 12 steps
    per = (S3 - S2) / (255 - 244)
    assert _rows(third.since(second)) == {1: (12, 12 * per)}
    assert third.iterations == 54  # cumulative: every step the server counted
    assert third.fit_line() is not None  # three widths: the planner's line fits
    # Nothing ran since: the same read again adds nothing.
    assert windows.update(_text(2)).rows() == third.rows()


def test_metrics_without_what_is_needed_leave_the_log_unchanged() -> None:
    windows = MetricWindows()
    before = windows.update(_text(0)).rows()
    lacking = [
        "",
        "not prometheus at all {{{",
        "\n".join(line for line in _text(1).splitlines() if "generation_tokens_total" not in line),
        "\n".join(line for line in _text(1).splitlines() if "inter_token_latency" not in line),
    ]
    for text in lacking:
        assert parse_metrics(text) is None
        assert windows.update(text).rows() == before
    # ...and the next complete read takes the whole window since the last one used.
    assert windows.update(_text(1)).iterations == 42


def test_a_window_without_a_timed_step_waits_for_the_next_and_the_older_name_counts() -> None:
    def text(steps: int, tokens: int, seconds: float, samples: int) -> str:
        # no label set, and the older name of the latency histogram
        return (
            f"vllm:iteration_tokens_total_count {steps}\n"
            f"vllm:generation_tokens_total {tokens}\n"
            f"vllm:time_per_output_token_seconds_sum {seconds}\n"
            f"vllm:time_per_output_token_seconds_count {samples}\n"
        )

    windows = MetricWindows()
    assert windows.update(text(3, 3, 0.0, 0)).rows() == {}  # prefills only: no step timed
    log = windows.update(text(10, 21, 0.07, 14))  # this window holds the first 3 steps too
    assert _rows(log) == {2: (10, 10 * 0.07 / 14)}


def test_counters_that_fell_start_the_log_over() -> None:
    windows = MetricWindows()
    for i in range(3):
        old = windows.update(_text(i))
    restarted = windows.update(_text(0))  # a new server on the URL counts from zero
    assert _rows(restarted) == {4: (17, 17 * S1 / 60)}
    # A reader's difference takes the restarted log whole (IterationLog.since's rule).
    assert restarted.since(old).rows() == restarted.rows()


def test_labels_holding_spaces_and_braces_are_parsed() -> None:
    odd = _text(0).replace('model_name="/tmp/cap/model"', 'model_name="/a b/{x} y"')
    assert parse_metrics(odd) == READS[0]
