"""The lean decode step and the lean prefill compute what the model's own forward computes."""

from __future__ import annotations

import pytest
import torch

from dew.demo.model import make_model
from dew.serving import _decode
from dew.serving._decode import lean_forward
from dew.serving._kv import ModelCall, SlotCache
from dew.serving._prefix import Row, forward_extend
from dew.serving._requests import Request

from ._helpers import lively, prompts


def _decode_both(model: torch.nn.Module, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Prefill a ragged batch once per path, then decode ``steps`` greedy tokens on each;
    returns each step's (lean, model) logits [n, V]."""
    batch = prompts(5, model.config.vocab_size, seed=3, low=2, high=15)
    out = []
    calls = [ModelCall(model), ModelCall(model, lean=False)]
    assert calls[0].lean is not None and calls[1].lean is None
    caches = [SlotCache(model.config.num_hidden_layers, 8, 64, torch.device("cpu")) for _ in calls]
    with torch.inference_mode():
        tokens = []
        for call, cache in zip(calls, caches, strict=True):
            for slot, p in enumerate(batch):  # one prompt per forward: no padding involved
                cache.reserve(slot + 1, len(p))
                cache.set_prefill([slot], [len(p)], len(p))
                ids = torch.tensor([p])
                allowed = torch.ones(len(p), len(p), dtype=torch.bool).tril()[None, None]
                logits = call(ids, torch.arange(len(p))[None], allowed, cache)
                if call is calls[0]:
                    tokens.append(int(logits.argmax()))
        cols = [len(p) for p in batch]
        for _ in range(steps):
            n, width = len(batch), max(cols) + 1
            columns = torch.tensor(cols)
            ids = torch.tensor(tokens)[:, None]
            allowed = (torch.arange(width)[None] <= columns[:, None])[:, None, None]
            step = []
            for call, cache in zip(calls, caches, strict=True):
                cache.reserve(n, width)
                cache.set_decode(n, columns, width)
                step.append(call.decode(ids, columns[:, None], allowed, cache))
            out.append((step[0], step[1]))
            tokens = step[1].argmax(-1).tolist()
            cols = [c + 1 for c in cols]
    return out


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_lean_decode_matches_the_model_forward(arch: str) -> None:
    for lean, ref in _decode_both(lively(arch, 4), steps=6):
        assert torch.allclose(lean, ref, atol=1e-4, rtol=1e-4), (lean - ref).abs().max()


@pytest.mark.parametrize("step", [_decode._decode_step, _decode._prefill_step])
def test_the_lean_forwards_run_compiled(step: object) -> None:
    assert isinstance(_decode._compiled(step), torch.jit.ScriptFunction)


def _uncompiled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_decode, "_compiled", lambda step: step)


def test_the_uncompiled_step_computes_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback is the compiled step's own source run by Python: same logits."""
    model = lively("qwen2", 4)
    compiled = _decode_both(model, steps=4)
    _uncompiled(monkeypatch)
    assert ModelCall(model).lean is not None
    plain = _decode_both(model, steps=4)
    for (a, ref), (b, _) in zip(compiled, plain, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()
        assert torch.allclose(b, ref, atol=1e-4, rtol=1e-4), (b - ref).abs().max()


def test_a_step_torchscript_refuses_runs_uncompiled_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(fn: object) -> None:
        raise RuntimeError("no source")

    monkeypatch.setattr(torch.jit, "script", refuse)
    for step in (_decode._decode_step, _decode._prefill_step):
        with pytest.warns(RuntimeWarning, match=f"{step.__name__} runs uncompiled.*no source"):
            assert _decode._compiled.__wrapped__(step) is step


def test_models_it_does_not_reproduce_are_left_to_their_own_forward() -> None:
    model = make_model("qwen2", "tiny", seed=0)
    model.config._attn_implementation = "eager"
    assert lean_forward(model) is None
    assert ModelCall(model).lean is None


def _padded_prefill(
    call: ModelCall, cache: SlotCache, seqs: list[list[int]], slots: list[int]
) -> torch.Tensor:
    """One left-padded forward of ``seqs`` (longest first) into ``slots``, as the
    engine's admission runs it."""
    width = len(seqs[0])
    cache.reserve(max(slots) + 1, width)
    lens = torch.tensor([len(s) for s in seqs])  # [k]
    ids = torch.tensor([[0] * (width - len(s)) + s for s in seqs])  # [k, T]
    col = torch.arange(width)
    pad = (width - lens).unsqueeze(1)
    positions = (col.unsqueeze(0) - pad).clamp(min=0)
    allowed = (col.unsqueeze(1) >= col.unsqueeze(0)) & (col.unsqueeze(0) >= pad).unsqueeze(1)
    allowed |= torch.eye(width, dtype=torch.bool)
    cache.set_prefill(slots, lens.tolist(), width)
    return call.prefill(ids, positions, lens, allowed.unsqueeze(1), cache)


def _request(prompt: list[int]) -> Request:
    return Request(prompt, 1, 0.0, None, None, frozenset(), None, False)


def _same_cache(a: SlotCache, b: SlotCache, slots: int, columns: int) -> None:
    for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True):
        x, y = x[:slots, :, :columns], y[:slots, :, :columns]
        assert torch.allclose(x, y, atol=1e-5, rtol=1e-4), (x - y).abs().max()


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_lean_prefill_matches_the_model_forward(
    arch: str, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ragged batch in one padded forward, then prompts that extend two of them
    (their prefixes copied in first), then decode steps over all of it: the lean
    paths, compiled or not, give the model forward's logits and leave the same
    keys/values behind."""
    if not compiled:
        _uncompiled(monkeypatch)
    model = lively(arch, 5)
    vocab = model.config.vocab_size
    batch = sorted(prompts(5, vocab, seed=7, low=2, high=15), key=len, reverse=True)
    tails = prompts(2, vocab, seed=8, low=1, high=6)
    longer = [batch[1] + tails[0], batch[3] + tails[1]]
    calls = [ModelCall(model), ModelCall(model, lean=False)]
    caches = [SlotCache(model.config.num_hidden_layers, 8, 64, torch.device("cpu")) for _ in calls]
    span = max(len(p) for p in longer)
    with torch.inference_mode():
        slots = [4, 0, 2, 1, 3]
        first = [_padded_prefill(c, m, batch, slots) for c, m in zip(calls, caches, strict=True)]
        assert torch.allclose(first[0], first[1], atol=1e-4, rtol=1e-4)
        _same_cache(*caches, slots=5, columns=len(batch[0]))
        extended = []
        for call, cache in zip(calls, caches, strict=True):
            cache.reserve(7, span)
            # slot 0 holds batch[1] and slot 1 holds batch[3]; rows go longest first
            rows = [Row(_request(p), len(p) - len(t)) for p, t in zip(longer, tails, strict=True)]
            order = sorted(range(2), key=lambda i: rows[i].new, reverse=True)
            for slot, i in enumerate(order, start=5):
                cache.move([i], [slot], rows[i].start)
            extended.append(forward_extend(call, cache, [rows[i] for i in order], 5))
        assert torch.allclose(extended[0], extended[1], atol=1e-4, rtol=1e-4)
        _same_cache(*caches, slots=7, columns=span)
