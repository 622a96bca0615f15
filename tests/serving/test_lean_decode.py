"""The lean decode step computes what the model's own forward computes."""

from __future__ import annotations

import pytest
import torch

from dew.demo.model import make_model
from dew.serving._decode import lean_decode
from dew.serving._kv import ModelCall, SlotCache

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


def test_models_it_does_not_reproduce_are_left_to_their_own_forward() -> None:
    model = make_model("qwen2", "tiny", seed=0)
    model.config._attn_implementation = "eager"
    assert lean_decode(model) is None
    assert ModelCall(model).lean is None
