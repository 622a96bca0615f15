"""Kept prefixes: a finished request's keys/values serve its session's next call.

The next turn of a multi-turn session extends the previous call's prompt and
completion; the engine keeps that call's slot (by affinity) and computes only the new
tokens. Nothing a request sees may change for it (greedy tokens, log-probs, versions),
and nothing computed under old weights survives a load.
"""

from __future__ import annotations

import random

import pytest
import torch

from dew.core import Call, SamplingParams
from dew.serving import RolloutServer
from dew.serving._prefix import KeptPrefixes

from ._helpers import WAIT, hf_greedy, lively, prompts, wait_until

GREEDY = {"temperature": 0.0, "stop_ids": ()}


def turn(server: RolloutServer, prompt: list[int], n: int, affinity: object) -> Call:
    params = SamplingParams(max_tokens=n, **GREEDY)
    return server.submit(prompt, params, affinity=affinity).result(timeout=WAIT)


def computed(server: RolloutServer) -> int:
    return server.stats()["prompt_tokens_computed"]


@pytest.mark.timeout(120)
def test_the_next_turn_computes_only_its_new_tokens(qwen: torch.nn.Module) -> None:
    first = prompts(1, qwen.config.vocab_size, seed=21, low=12, high=12)[0]
    with RolloutServer(qwen, max_batch=4) as server:
        one = turn(server, first, 5, affinity=7)
        assert server.stats()["kept"] == 1
        second = [*one.prompt, *one.completion, 30, 31, 32]  # the reply, then an observation
        before = computed(server)
        two = turn(server, second, 5, affinity=7)
        # the kept slot holds the prompt and all but the last sampled token
        assert computed(server) - before == 1 + 3
        assert server.stats()["kept"] == 1  # the second turn's slot replaced the first's
        other = turn(server, [*second, *two.completion, 40], 3, affinity=8)  # no kin kept
        assert computed(server) - before == 1 + 3 + len(second) + len(two.completion) + 1
    assert list(one.completion) == hf_greedy(qwen, first, 5)
    assert list(two.completion) == hf_greedy(qwen, second, 5)
    assert list(other.completion) == hf_greedy(qwen, [*second, *two.completion, 40], 3)


@pytest.mark.timeout(120)
def test_a_late_sample_copies_its_prompt_from_a_finished_sibling(qwen: torch.nn.Module) -> None:
    prompt = prompts(1, qwen.config.vocab_size, seed=22, low=10, high=10)[0]
    with RolloutServer(qwen, max_batch=4) as server:
        turn(server, prompt, 6, affinity=3)
        before = computed(server)
        late = turn(server, prompt, 6, affinity=3)
        assert computed(server) - before == 1  # the last prompt token, for its logits
    assert list(late.completion) == hf_greedy(qwen, prompt, 6)


@pytest.mark.timeout(120)
def test_a_load_drops_every_kept_prefix() -> None:
    old, new = lively("qwen2", 23), lively("qwen2", 24)
    first = prompts(1, old.config.vocab_size, seed=25, low=9, high=9)[0]
    with RolloutServer(old, version=1, max_batch=4) as server:
        one = turn(server, first, 4, affinity=0)
        second = [*one.prompt, *one.completion, 50, 51]
        server.load(new, 2)
        assert server.stats()["kept"] == 0
        before = computed(server)
        two = turn(server, second, 4, affinity=0)
        assert computed(server) - before == len(second)  # all of it, under the new weights
    assert one.version == 1 and two.version == 2
    assert list(two.completion) == hf_greedy(new, second, 4)
    assert list(two.completion) != hf_greedy(old, second, 4)  # the check is not vacuous


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [0, 1])
def test_prefix_cache_bounds_what_is_kept(qwen: torch.nn.Module, size: int) -> None:
    a, b = prompts(2, qwen.config.vocab_size, seed=26, low=8, high=8)
    with RolloutServer(qwen, max_batch=4, prefix_cache=size) as server:
        one_a = turn(server, a, 3, affinity="a")
        turn(server, b, 3, affinity="b")  # with one kept slot, b's pushes a's out
        assert server.stats()["kept"] == size
        before = computed(server)
        turn(server, [*one_a.prompt, *one_a.completion, 60], 3, affinity="a")
        assert computed(server) - before == len(a) + 3 + 1  # a's was not kept
    with pytest.raises(ValueError, match="prefix_cache must be >= 0"):
        RolloutServer(qwen, prefix_cache=-1)


@pytest.mark.timeout(300)
def test_sessions_through_kept_prefixes_see_what_they_would_without() -> None:
    """Twelve sessions at once, random turns, a load in the middle, sampling at
    temperature 1: every call computes exactly what it should (its whole prompt first and
    after the load, else its new tokens), and every log-prob is a full forward's."""
    model = lively("qwen2", 27)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    histories = prompts(12, vocab, seed=28, low=6, high=20)
    calls: list[Call] = []
    want_computed = 0
    with RolloutServer(model, max_batch=16, seed=1) as server:
        new = [len(h) for h in histories]  # tokens each session's next call must compute
        for round_ in range(5):
            if round_ == 2:
                server.load(model, 1)
                new = [len(h) for h in histories]
            want_computed += sum(new)
            params = [SamplingParams(max_tokens=rng.randint(1, 6)) for _ in histories]
            with server._cond:  # one admission for the round (see test_prefix_sharing)
                futures = [
                    server.submit(h, p, affinity=i % 5)
                    for i, (h, p) in enumerate(zip(histories, params, strict=True))
                ]
            for i, f in enumerate(futures):
                call = f.result(timeout=WAIT)
                calls.append(call)
                extra = [rng.randrange(6, vocab) for _ in range(rng.randint(1, 4))]
                histories[i] = [*call.prompt, *call.completion, *extra]
                new[i] = 1 + len(extra)  # the reply's last token and the observation
        stats = server.stats()
    assert stats["prompt_tokens_computed"] == want_computed
    assert stats["kept"] == 12  # one per session: each turn replaced its last
    for call in calls:
        ids = torch.tensor([[*call.prompt, *call.completion]])
        with torch.no_grad():
            logp = model(input_ids=ids).logits[0].double().log_softmax(-1)
        start = len(call.prompt) - 1
        want = [float(logp[start + j, t]) for j, t in enumerate(call.completion)]
        assert call.log_probs == pytest.approx(want, abs=2e-4)


def test_kept_prefixes_bookkeeping() -> None:
    kept = KeptPrefixes(first=10, size=2)
    one = kept.add([1, 2, 3], "s", 0)
    assert one is not None and one.slot == 10 and len(kept) == 1
    assert kept.match([1, 2, 3, 4], "s") == (one, 3)  # a prefix of the prompt
    assert kept.match([1, 2], "s") == (one, 2)  # the prompt inside the kept run
    assert kept.match([1, 9, 3], "s") is None and kept.match([1, 2, 3], "t") is None
    two = kept.add([1, 2, 3, 4, 5], "s", 0)  # extends one: one is dropped
    assert two is not None and len(kept) == 1 and two.slot == 10
    other = kept.add([7, 8], "t", 0)
    assert other is not None and other.slot == 11
    kept.pin(two)
    third = kept.add([9], "u", 0)  # full: the oldest unpinned entry (other) makes room
    assert third is not None and third.slot == 11 and kept.match([7, 8], "t") is None
    kept.pin(third)
    assert kept.add([5], "v", 0) is None  # every slot pinned: nothing kept
    kept.pin(third)  # two rows copy from it
    assert kept.add([9, 1], "u", 0) is None  # third is superseded, but still to be copied
    kept.unpin(third)
    assert kept.match([9], "u") == (third, 1)  # one row has yet to copy it
    kept.unpin(third)  # the last row copied it: the superseded entry goes
    assert kept.match([9], "u") is None
    assert kept.add([9, 1], "u", 0) is not None
    kept.release()  # what is still pinned (two) is unpinned
    assert kept.add([6], "x", 0) is not None  # two, the oldest, made room
    assert kept.match([1, 2, 3, 4, 5], "s") is None
    kept.clear()
    assert len(kept) == 0
    assert kept.add([4], "w", 0).slot == 10


def test_kept_prefixes_of_older_weights_serve_continuations_only() -> None:
    kept = KeptPrefixes(first=0, size=4)
    old = kept.add([1, 2, 3], "s", 1)
    assert old is not None
    assert kept.match([1, 2, 3], "s", 2) is None  # the same prompt: a new start
    assert kept.match([1, 2], "s", 2) is None  # the prompt inside the old run
    assert kept.match([1, 2, 3, 4], "s", 2) == (old, 3)  # its session's next turn
    assert kept.match([1, 2], "s", 1) == (old, 2)  # of the weights served: anything
    new = kept.add([1, 2, 7], "s", 2)
    assert new is not None
    assert kept.match([1, 2], "s", 2) == (new, 2)
    assert kept.match([1, 2], "s") == (new, 2)  # a tie goes to the newer weights


# --------------------------------------------------------------------------- on_load="keep"


def stale_greedy(old: torch.nn.Module, new: torch.nn.Module, prompt: list[int], k: int, n: int):
    """Greedy tokens when a load lands after ``k`` of ``n``: the old weights sample the
    first k, then the new weights go on over the old weights' keys/values (the cache
    as it stood: the prompt and the first k - 1 tokens)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    tokens: list[int] = []
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for i in range(n):
            model = old if i < k else new
            logits = model(input_ids=ids, cache=cache, use_cache=True).logits
            tokens.append(int(logits[0, -1].argmax()))
            ids = torch.tensor([[tokens[-1]]])
    return tokens


@pytest.mark.timeout(120)
def test_keep_lets_a_running_request_go_on_over_the_keys_and_values_it_has() -> None:
    old, new = lively("qwen2", 31), lively("qwen2", 32)
    prompt = prompts(1, old.config.vocab_size, seed=33, low=10, high=10)[0]
    n = 120
    with RolloutServer(old, version=1, max_batch=4, on_load="keep") as server:
        future = server.submit(prompt, SamplingParams(max_tokens=n, **GREEDY))
        wait_until(lambda: server.stats()["iterations"] >= 8, "the request to decode a while")
        before = computed(server)
        server.load(new, 2)
        call = future.result(timeout=WAIT)
        assert computed(server) == before  # nothing recomputed at the load
    assert call.version == 1  # the oldest weights behind its tokens
    plain_old, plain_new = hf_greedy(old, prompt, n), hf_greedy(new, prompt, n)
    got = list(call.completion)
    same = next((i for i, (a, b) in enumerate(zip(got, plain_old, strict=True)) if a != b), n)
    assert 0 < same < n and got != plain_new  # the load landed part way
    # the load landed after k tokens, for some k up to the first one that differs
    assert any(stale_greedy(old, new, prompt, k, n) == got for k in range(1, same + 1))


@pytest.mark.timeout(120)
def test_keep_carries_kept_prefixes_across_a_load_and_ages_their_calls() -> None:
    old, new = lively("qwen2", 34), lively("qwen2", 35)
    first = prompts(1, old.config.vocab_size, seed=36, low=9, high=9)[0]
    with RolloutServer(old, version=1, max_batch=4, on_load="keep") as server:
        one = turn(server, first, 4, affinity=0)
        server.load(new, 2)
        assert server.stats()["kept"] == 1
        second = [*one.prompt, *one.completion, 50, 51]
        before = computed(server)
        two = turn(server, second, 4, affinity=0)
        assert computed(server) - before == 1 + 2  # the kept columns were copied
        fresh = turn(server, first, 4, affinity=9)  # no prefix: the new weights alone
    assert (one.version, two.version, fresh.version) == (1, 1, 2)
    assert list(fresh.completion) == hf_greedy(new, first, 4)
    with pytest.raises(ValueError, match="on_load='never'"):
        RolloutServer(old, on_load="never")


@pytest.mark.timeout(120)
def test_keep_starts_a_prompt_afresh_rather_than_from_an_older_kept_sibling() -> None:
    """A late sample or a retried attempt of a group after a load: copying its prompt from
    a sibling that finished under the old weights would make it as old as that sibling
    (and a retry of a stale rollout stale again, for as long as the slot is kept)."""
    old, new = lively("qwen2", 37), lively("qwen2", 38)
    first = prompts(1, old.config.vocab_size, seed=39, low=9, high=9)[0]
    with RolloutServer(old, version=1, max_batch=4, on_load="keep") as server:
        turn(server, first, 4, affinity=0)
        server.load(new, 2)
        before = computed(server)
        again = turn(server, first, 4, affinity=0)
        assert computed(server) - before == len(first)  # all of it, under the new weights
        later = turn(server, first, 4, affinity=0)  # a sibling of the new weights serves
        assert computed(server) - before == len(first) + 1
    assert (again.version, later.version) == (2, 2)
    assert list(again.completion) == hf_greedy(new, first, 4)
    assert list(again.completion) != hf_greedy(old, first, 4)  # the check is not vacuous


@pytest.mark.timeout(120)
def test_keep_starts_a_prompt_afresh_rather_than_from_an_older_running_sibling() -> None:
    old, new = lively("qwen2", 40), lively("qwen2", 41)
    prompt = prompts(1, old.config.vocab_size, seed=42, low=10, high=10)[0]
    with RolloutServer(old, version=1, max_batch=4, on_load="keep") as server:
        running = server.submit(prompt, SamplingParams(max_tokens=150, **GREEDY), affinity=3)
        wait_until(lambda: server.stats()["iterations"] >= 4, "the request to decode a while")
        server.load(new, 2)
        before = computed(server)
        late = turn(server, prompt, 4, affinity=3)
        assert not running.done()  # the old request was still there to copy from
        assert computed(server) - before == len(prompt)
        assert running.result(timeout=WAIT).version == 1
    assert late.version == 2
    assert list(late.completion) == hf_greedy(new, prompt, 4)
