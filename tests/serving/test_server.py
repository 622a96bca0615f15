"""RolloutServer outputs: greedy equality, log-probs, filters, stop ids, versions, bad input."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from dew.core import Aborted, Call, SamplingParams
from dew.serving import RolloutServer

from ._helpers import Worker, hf_greedy, lively, prompts


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_matches_model_generate(arch: str) -> None:
    model = lively(arch, 3)
    batch = prompts(10, model.config.vocab_size, seed=1, low=1, high=20)
    lengths = [5, 24, 1, 17, 9, 30, 2, 12, 20, 7]  # requests join and leave at different steps
    with RolloutServer(model, max_batch=4) as server:  # fewer slots than requests
        workers = [
            Worker(
                lambda p=p, n=n: server.generate(
                    p, SamplingParams(max_tokens=n, temperature=0, stop_ids=())
                )
            )
            for p, n in zip(batch, lengths, strict=True)
        ]
        calls = [w.join() for w in workers]
    for p, n, call in zip(batch, lengths, calls, strict=True):
        assert isinstance(call, Call)
        assert list(call.completion) == hf_greedy(model, p, n)
        assert list(call.prompt) == p
        assert call.finish_reason == "length"
        assert call.log_probs == [0.0] * n  # the greedy distribution is a point mass
        assert call.temperature == 1.0
        assert call.support == [[t] for t in call.completion]


@pytest.mark.timeout(120)
def test_greedy_with_a_stop_id_matches_model_generate_with_eos(qwen: torch.nn.Module) -> None:
    batch = prompts(12, qwen.config.vocab_size, seed=6)
    # A stop token the model actually emits within its first 30 tokens for some prompts.
    seen = [hf_greedy(qwen, p, 30) for p in batch]
    stop_id = max(set(seen[0]), key=lambda t: sum(t in s for s in seen))
    with RolloutServer(qwen) as server:
        workers = [
            Worker(
                lambda p=p: server.generate(
                    p, SamplingParams(max_tokens=30, temperature=0, stop_ids=[stop_id])
                )
            )
            for p in batch
        ]
        calls = [w.join() for w in workers]
    stopped = 0
    for p, call in zip(batch, calls, strict=True):
        assert isinstance(call, Call)
        want = hf_greedy(qwen, p, 30, eos=stop_id)
        assert list(call.completion) == want
        assert call.finish_reason == ("stop" if want[-1] == stop_id else "length")
        stopped += call.finish_reason == "stop"
    assert stopped > 0


def _reference_log_probs(
    model: torch.nn.Module, call: Call, temperature: float, top_k: int | None, top_p: float | None
) -> tuple[list[float], list[list[int]]]:
    """Recompute each sampled token's log-prob with one full forward (no cache): HF
    order, temperature then top-k then top-p, implemented here independently."""
    ids = torch.tensor([list(call.prompt) + list(call.completion)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()  # [L, V]
    start = len(call.prompt) - 1
    lps, sets = [], []
    for i, tok in enumerate(call.completion):
        row = logits[start + i] / temperature
        order = torch.argsort(row, descending=True, stable=True).tolist()
        keep = order[: top_k or len(order)]
        if top_p is not None:
            probs = torch.softmax(row[keep], dim=0).tolist()
            cut, mass = [], 0.0
            for t, p in zip(keep, probs, strict=True):
                cut.append(t)
                mass += p
                if mass >= top_p:
                    break
            keep = cut
        logp = torch.log_softmax(row[keep], dim=0)
        lps.append(float(logp[keep.index(tok)]) if tok in keep else -math.inf)
        sets.append(sorted(keep))
    return lps, sets


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [
        (1.0, None, None),
        (0.7, None, None),
        (1.3, 5, None),
        (0.8, None, 0.5),
        (1.0, 20, 0.9),
    ],
)
def test_log_probs_and_support_recomputed(
    qwen: torch.nn.Module, temperature: float, top_k: int | None, top_p: float | None
) -> None:
    batch = prompts(4, qwen.config.vocab_size, seed=2)
    with RolloutServer(qwen, seed=5) as server:
        workers = [
            Worker(
                lambda p=p: server.generate(
                    p,
                    SamplingParams(
                        max_tokens=12,
                        temperature=temperature,
                        top_k=top_k,
                        top_p=top_p,
                        stop_ids=(),
                    ),
                )
            )
            for p in batch
        ]
        calls = [w.join() for w in workers]
    for call in calls:
        assert isinstance(call, Call)
        want, sets = _reference_log_probs(qwen, call, temperature, top_k, top_p)
        assert call.log_probs == pytest.approx(want, abs=2e-4)
        assert call.temperature == temperature
        if top_k is None and top_p is None:
            assert call.support is None
        else:
            assert call.support is not None
            assert [sorted(s) for s in call.support] == sets
            assert all(t in s for t, s in zip(call.completion, call.support, strict=True))


def test_stop_ids_end_the_completion_and_are_kept(server: RolloutServer) -> None:
    vocab = server.vocab_size
    call = server.generate([7, 8, 9], SamplingParams(max_tokens=50, stop_ids=range(vocab)))
    assert len(call.completion) == 1 and call.finish_reason == "stop"
    greedy = server.generate([7, 8, 9], SamplingParams(max_tokens=6, temperature=0, stop_ids=()))
    stop_at = greedy.completion[3]
    first = list(greedy.completion).index(stop_at)
    call = server.generate(
        [7, 8, 9], SamplingParams(max_tokens=6, temperature=0, stop_ids=[stop_at])
    )
    assert list(call.completion) == list(greedy.completion[: first + 1])
    assert call.finish_reason == "stop"
    assert server.generate([7], SamplingParams(max_tokens=1, stop_ids=())).finish_reason == "length"


def test_stop_ids_none_means_the_model_eos(qwen: torch.nn.Module) -> None:
    model = lively("qwen2", 1)
    with RolloutServer(model) as server:
        greedy = server.generate(
            [7, 8, 9], SamplingParams(max_tokens=6, temperature=0, stop_ids=())
        )
        eos = int(greedy.completion[2])
    model.config.eos_token_id = eos  # the served model's end-of-sequence id
    model.generation_config.eos_token_id = eos
    with RolloutServer(model) as server:
        assert server.eos_token_ids == (eos,)
        call = server.generate([7, 8, 9], SamplingParams(max_tokens=6, temperature=0))
        first = list(greedy.completion).index(eos)
        assert list(call.completion) == list(greedy.completion[: first + 1])
        assert call.finish_reason == "stop"
        never = server.generate([7, 8, 9], SamplingParams(max_tokens=6, temperature=0, stop_ids=()))
        assert list(never.completion) == list(greedy.completion)


def test_properties_and_versions(qwen: torch.nn.Module) -> None:
    with RolloutServer(qwen, version=7) as server:
        assert server.version == 7
        assert server.vocab_size == qwen.config.vocab_size
        assert server.max_len == qwen.config.max_position_embeddings
        assert server.eos_token_ids == (qwen.config.eos_token_id,)
        assert server.generate([5, 6], SamplingParams(max_tokens=2, stop_ids=())).version == 7
        server.load(qwen, 9)
        assert server.version == 9
        assert server.generate([5, 6], SamplingParams(max_tokens=2, stop_ids=())).version == 9
        server.load(qwen.state_dict(), 10)
        assert server.version == 10
        assert server.alive
    assert not server.alive  # closed


def test_the_server_owns_a_copy(qwen: torch.nn.Module) -> None:
    model = lively("qwen2", 4)
    with RolloutServer(model) as server:
        before = server.generate(
            [9, 10, 11], SamplingParams(max_tokens=8, temperature=0, stop_ids=())
        ).completion
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        assert hf_greedy(model, [9, 10, 11], 8) != before  # the caller's model did change
        assert (
            server.generate(
                [9, 10, 11], SamplingParams(max_tokens=8, temperature=0, stop_ids=())
            ).completion
            == before
        )


BAD = [
    ({"prompt": []}, "prompt is empty"),
    ({"prompt": [1, 2, 10_000]}, r"prompt\[2\] = 10000 is outside the vocabulary"),
    ({"prompt": [-1]}, "outside the vocabulary"),
    ({"prompt": [1.5]}, "must be an int"),
    ({"prompt": [3, True]}, r"prompt\[1\] must be an int"),
    ({"prompt": "abc"}, "sequence of token ids"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"max_tokens": 5000}, "exceeds max_len"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"stop_ids": [10_000]}, "stop_ids"),
    ({"stop_ids": [-2]}, "stop_ids"),
    ({"stop_ids": "ab"}, "stop_ids"),
    ({"max_tokens": True}, "max_tokens must be an int"),
]


@pytest.mark.timeout(120)
def test_bad_input_raises_value_error_while_others_are_served(server: RolloutServer) -> None:
    stop = threading.Event()
    running = Worker(
        lambda: server.generate([5] * 4, SamplingParams(max_tokens=900, stop_ids=()), stop=stop)
    )
    for change, message in BAD:
        kwargs = {"prompt": [3, 4], "max_tokens": 4, **change}
        prompt = kwargs.pop("prompt")
        # The sampling checks run where SamplingParams is built, the model's at submit.
        with pytest.raises(ValueError, match=message):
            server.generate(prompt, SamplingParams(**kwargs))  # type: ignore[arg-type]
    assert len(server.generate([3, 4], SamplingParams(max_tokens=4, stop_ids=())).completion) == 4
    assert not running.done.is_set()
    stop.set()
    running.join()
    assert isinstance(running.error, Aborted)  # it was still being served, untouched
    assert server.stats()["active"] == 0


def test_bad_construction_and_load(qwen: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="max_batch"):
        RolloutServer(qwen, max_batch=0)
    with pytest.raises(ValueError, match="version"):
        RolloutServer(qwen, version=-1)
    with RolloutServer(qwen) as server:
        state = dict(qwen.state_dict())
        name = "model.norm.weight"
        with pytest.raises(ValueError, match="missing"):
            server.load({k: v for k, v in state.items() if k != name}, 1)
        with pytest.raises(ValueError, match="shape"):
            server.load({**state, name: state[name][:1]}, 1)
        with pytest.raises(ValueError, match="unexpected"):
            server.load({**state, "extra.weight": state[name]}, 1)
        with pytest.raises(ValueError, match="version"):
            server.load(qwen, -2)
        with pytest.raises(ValueError, match=r"nn\.Module or a mapping"):
            server.load([1, 2], 1)  # type: ignore[arg-type]
        assert server.version == 0
        assert len(server.generate([3], SamplingParams(max_tokens=3, stop_ids=())).completion) == 3


def test_tied_weights_may_be_given_once() -> None:
    """A checkpoint saved without the tied duplicate (lm_head = embeddings) loads."""
    a, b = lively("qwen2", 20), lively("qwen2", 21)
    state = {k: v for k, v in b.state_dict().items() if k != "lm_head.weight"}
    with RolloutServer(a) as server:
        server.load(state, 1)
        call = server.generate([4, 5, 6], SamplingParams(max_tokens=10, temperature=0, stop_ids=()))
    assert list(call.completion) == hf_greedy(b, [4, 5, 6], 10)


def test_unsupported_attention_is_refused() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="flex_attention")
    with pytest.raises(ValueError, match="attention implementation"):
        RolloutServer(model)


@pytest.mark.timeout(120)
def test_a_request_whose_logits_overflow_fails_alone_and_its_batch_stays_exact(
    qwen: torch.nn.Module,
) -> None:
    # SamplingParams refuses such a temperature; forced past it here, as a buggy or
    # hostile caller could, it must fail its own request and no other.
    extreme = SamplingParams(max_tokens=12, temperature=1.0, stop_ids=())
    object.__setattr__(extreme, "temperature", 1e-40)  # 0.0 in float32: logits / 0
    params = SamplingParams(max_tokens=12, temperature=0.8, stop_ids=())
    batch = prompts(5, qwen.config.vocab_size, seed=4)
    with RolloutServer(qwen, seed=6) as server:
        futures = [server.submit(p, params) for p in batch[:4]]
        bad = server.submit(batch[4], extreme)
        with pytest.raises(ValueError, match="not finite") as caught:
            bad.result(timeout=60)
        assert "\n" not in str(caught.value)
        calls = [f.result(timeout=60) for f in futures]
        after = server.generate(batch[4], params)  # the server goes on serving
    for call in [*calls, after]:
        want, _ = _reference_log_probs(qwen, call, 0.8, None, None)
        assert call.log_probs == pytest.approx(want, abs=2e-4)


@pytest.mark.timeout(120)
def test_prompts_of_numpy_or_tensor_ids_are_served_as_the_same_ints(server: RolloutServer) -> None:
    import numpy as np

    greedy = SamplingParams(max_tokens=4, temperature=0, stop_ids=())
    want = server.generate([3, 4, 5], greedy)
    for prompt in (np.array([3, 4, 5]), torch.tensor([3, 4, 5]), [np.int64(3), 4, np.int32(5)]):
        got = server.generate(prompt, greedy)  # type: ignore[arg-type]
        assert got.prompt == want.prompt and all(type(t) is int for t in got.prompt)
        assert got.completion == want.completion
