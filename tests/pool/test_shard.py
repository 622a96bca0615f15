"""dew.pool's checks and the mesh-aware gradient clipping, in one process (the pool
itself runs across processes in test_pool.py)."""

from __future__ import annotations

import pytest
import torch

from dew._step import clip_grad_norm as _clip_grad_norm
from dew.demo.model import make_model
from dew.pool import init_pool
from dew.pool._shard import _check_tensor_split, _decoder_layers


@pytest.mark.parametrize("max_norm", [1e-3, 1e3])
def test_clipping_equals_torchs_on_a_plain_model(max_norm: float) -> None:
    models = [make_model("qwen2", "tiny", seed=0) for _ in range(2)]
    ids = torch.randint(0, 90, (2, 8), generator=torch.Generator().manual_seed(0))
    for model in models:
        model(input_ids=ids, labels=ids).loss.backward()
    ours = _clip_grad_norm(models[0], max_norm)
    theirs = float(torch.nn.utils.clip_grad_norm_(models[1].parameters(), max_norm))
    assert ours == pytest.approx(theirs, rel=1e-6) and ours > 1e-3
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=0)
    scaled = torch.sqrt(sum((p.grad**2).sum() for p in models[0].parameters()))
    assert float(scaled) == pytest.approx(min(max_norm, ours), rel=1e-4)


@pytest.mark.parametrize(
    ("kwargs", "world", "message"),
    [
        ({"tensor": 0}, 2, "tensor=0 must be an int >= 1"),
        ({"data": True}, 2, "data=True must be an int >= 1"),
        ({"tensor": 3}, 4, "tensor=3 must divide the world size 4"),
        ({"tensor": 2, "data": 1}, 4, "data=1 x tensor=2 = 2 processes, but the job has 4"),
        ({"timeout": 0}, 2, "timeout=0 must be a positive number of seconds"),
    ],
)
def test_init_pool_refuses_a_mesh_that_cannot_be(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict, world: int, message: str
) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        init_pool("gloo", **kwargs)


def test_tensor_parallelism_names_what_does_not_split() -> None:
    model = make_model("qwen2", "tiny", seed=0)  # 4 heads, 2 key/value heads, MLP 128
    _check_tensor_split(model, 2)
    with pytest.raises(ValueError, match="tensor=4 must divide the model's num_key_value_heads=2"):
        _check_tensor_split(model, 4)
    with pytest.raises(ValueError, match="tensor=3 must divide the model's num_attention_heads"):
        _check_tensor_split(model, 3)
    assert len(_decoder_layers(model)) == 2
    with pytest.raises(ValueError, match=r"a Linear has no model\.layers"):
        _decoder_layers(torch.nn.Linear(2, 2))
