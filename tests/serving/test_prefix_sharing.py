"""RolloutServer prefix sharing: a group's prompt is computed once, and sharing changes
nothing a request sees (tokens, log-probs, versions, aborts)."""

from __future__ import annotations

import threading

import pytest
import torch

from dew.core import Aborted, Call, SamplingParams
from dew.demo.model import make_model
from dew.serving import RolloutServer

from ._helpers import WAIT, hf_greedy, lively, prompts, wait_until

GREEDY = {"temperature": 0.0, "stop_ids": ()}


def _groups(
    server: RolloutServer, batch: list[list[int]], group: int, lengths: list[int], **params: object
) -> list[list[Call]]:
    """Submit ``group`` samples of each prompt (all at once, as a source does) and wait.

    The submits happen under the engine's lock (re-entrant), so the engine sees all of
    them or none at its next admission: on a loaded machine a loop of submits could
    otherwise be split across two admissions, and the counters would vary.
    """
    with server._cond:
        futures = [
            [
                server.submit(p, SamplingParams(max_tokens=n, **params), affinity=i)
                for _ in range(group)
            ]
            for i, (p, n) in enumerate(zip(batch, lengths, strict=True))
        ]
    return [[f.result(timeout=WAIT) for f in fs] for fs in futures]


def _scored(model: torch.nn.Module, call: Call) -> list[float]:
    """Each completion token's log-prob at temperature 1, from one full forward."""
    ids = torch.tensor([list(call.prompt) + list(call.completion)])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)  # [L, V]
    start = len(call.prompt) - 1
    return [float(logp[start + i, t]) for i, t in enumerate(call.completion)]


@pytest.mark.timeout(120)
def test_shared_greedy_outputs_equal_unshared_ones_and_counters_show_the_saving(
    qwen: torch.nn.Module,
) -> None:
    group = 4
    batch = prompts(6, qwen.config.vocab_size, seed=8, low=1, high=24)  # mixed lengths
    lengths = [9, 1, 14, 5, 20, 3]
    out: dict[bool, list[list[Call]]] = {}
    for share in (True, False):
        with RolloutServer(qwen, max_batch=64, share_prefixes=share) as server:
            out[share] = _groups(server, batch, group, lengths, **GREEDY)
            stats = server.stats()
        served = sum(len(p) for p in batch) * group
        assert stats["prompt_tokens"] == served
        if share:
            assert stats["prompt_tokens_computed"] <= served / group
        else:
            assert stats["prompt_tokens_computed"] == served
    for p, n, shared, alone in zip(batch, lengths, out[True], out[False], strict=True):
        want = hf_greedy(qwen, p, n)
        for a, b in zip(shared, alone, strict=True):
            assert list(a.completion) == list(b.completion) == want
            assert a.log_probs == b.log_probs == [0.0] * n
            assert a.finish_reason == "length"


@pytest.mark.timeout(120)
def test_samples_of_a_shared_prompt_are_independent_and_their_log_probs_exact() -> None:
    model = make_model("qwen2", "tiny", seed=2)  # near-uniform: samples spread out
    prompt = prompts(1, model.config.vocab_size, seed=5, low=12, high=12)[0]
    with RolloutServer(model, seed=3) as server:
        (calls,) = _groups(server, [prompt], 16, [8], temperature=1.0, stop_ids=())
        stats = server.stats()
    assert stats["prompt_tokens_computed"] == len(prompt)  # one prefill for 16 samples
    assert len({c.completion[0] for c in calls}) > 1  # first tokens drawn independently
    assert len({tuple(c.completion) for c in calls}) == len(calls)
    for call in calls:
        assert call.log_probs == pytest.approx(_scored(model, call), abs=2e-4)


@pytest.mark.timeout(120)
def test_a_prompt_extending_or_equal_to_an_active_one_reuses_its_columns(
    qwen: torch.nn.Module,
) -> None:
    base = prompts(1, qwen.config.vocab_size, seed=11, low=10, high=10)[0]
    longer = [*base, 40, 41, 42]  # a next turn: the active prompt plus more
    with RolloutServer(qwen, max_batch=8) as server:
        hold = threading.Event()
        holder = server.submit(base, SamplingParams(max_tokens=500, **GREEDY), stop=hold)
        wait_until(lambda: server.stats()["active"] == 1, "the holder to decode")
        before = server.stats()["prompt_tokens_computed"]
        same = server.submit(base, SamplingParams(max_tokens=6, **GREEDY))
        more = server.submit(longer, SamplingParams(max_tokens=6, **GREEDY))
        same_call, more_call = same.result(timeout=WAIT), more.result(timeout=WAIT)
        computed = server.stats()["prompt_tokens_computed"] - before
        hold.set()
        with pytest.raises(Aborted):
            holder.result(timeout=WAIT)
    assert computed == 3  # `same` reuses the holder's columns and logits; `more` adds 3
    assert list(same_call.completion) == hf_greedy(qwen, base, 6)
    assert list(more_call.completion) == hf_greedy(qwen, longer, 6)


@pytest.mark.timeout(120)
def test_a_load_between_admissions_never_serves_an_old_prefix() -> None:
    old, new = lively("qwen2", 10), lively("qwen2", 11)
    base = prompts(1, old.config.vocab_size, seed=12, low=9, high=9)[0]
    longer = [*base, 30, 31]
    assert hf_greedy(old, base, 6) != hf_greedy(new, base, 6)  # the check is not vacuous
    with RolloutServer(old, version=1, max_batch=8) as server:
        hold = threading.Event()
        holder = server.submit(base, SamplingParams(max_tokens=500, **GREEDY), stop=hold)
        first = _groups(server, [base], 3, [6], **GREEDY)[0]  # shared under the old weights
        wait_until(lambda: server.stats()["active"] == 1, "the holder to decode alone")
        server.load(new, 2)  # the holder's columns are recomputed before any admission
        before = server.stats()["prompt_tokens_computed"]
        same = server.submit(base, SamplingParams(max_tokens=6, **GREEDY))
        more = server.submit(longer, SamplingParams(max_tokens=6, **GREEDY))
        same_call, more_call = same.result(timeout=WAIT), more.result(timeout=WAIT)
        # The holder's columns are shared, but not its old prompt logits: `same` computes
        # its last prompt token again under the new weights, `more` its two new ones.
        assert server.stats()["prompt_tokens_computed"] - before == 1 + 2
        after = _groups(server, [base], 3, [6], **GREEDY)[0]
        hold.set()
        with pytest.raises(Aborted):
            holder.result(timeout=WAIT)
    assert all(list(c.completion) == hf_greedy(old, base, 6) and c.version == 1 for c in first)
    for call, p in [(same_call, base), (more_call, longer), *((c, base) for c in after)]:
        assert call.version == 2
        assert list(call.completion) == hf_greedy(new, p, 6)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", [0, 2])  # the group's leader, or one of its followers
def test_aborting_one_sample_of_a_shared_group_leaves_the_others(
    qwen: torch.nn.Module, victim: int
) -> None:
    prompt = prompts(1, qwen.config.vocab_size, seed=13, low=7, high=7)[0]
    want = hf_greedy(qwen, prompt, 40)
    with RolloutServer(qwen, max_batch=8) as server:
        stops = [threading.Event() for _ in range(4)]
        with server._cond:  # one admission (see _groups)
            futures = [
                server.submit(prompt, SamplingParams(max_tokens=40, **GREEDY), stop=s, affinity=0)
                for s in stops
            ]
        wait_until(lambda: server.stats()["active"] == 4, "the group to decode")
        stops[victim].set()
        for i, f in enumerate(futures):
            if i == victim:
                with pytest.raises(Aborted):
                    f.result(timeout=WAIT)
            else:
                assert list(f.result(timeout=WAIT).completion) == want
        # A stopped sample of a group still waiting for a slot is dropped alone.
        gone = threading.Event()
        gone.set()
        with pytest.raises(Aborted):
            server.submit(prompt, SamplingParams(max_tokens=4, **GREEDY), stop=gone).result(
                timeout=WAIT
            )
        stats = server.stats()
        assert (stats["pending"], stats["active"]) == (0, 0)
        assert stats["prompt_tokens_computed"] == len(prompt)


@pytest.mark.timeout(120)
def test_a_group_larger_than_the_free_slots_is_served_across_admissions(
    qwen: torch.nn.Module,
) -> None:
    batch = prompts(3, qwen.config.vocab_size, seed=14, low=4, high=16)
    with RolloutServer(qwen, max_batch=5) as server:  # 3 groups of 4 through 5 slots
        groups = _groups(server, batch, 4, [7, 2, 11], **GREEDY)
        stats = server.stats()
    for p, n, calls in zip(batch, [7, 2, 11], groups, strict=True):
        assert all(list(c.completion) == hf_greedy(qwen, p, n) for c in calls)
    # Samples admitted beside (or while) a sibling is active share its prompt; one
    # admitted after all its siblings finished copies it from a kept sibling.
    assert stats["prompt_tokens"] == 4 * sum(map(len, batch))
    assert stats["prompt_tokens_computed"] < stats["prompt_tokens"]
