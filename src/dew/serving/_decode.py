"""A lean decode step for Llama-family models (Llama, Qwen2) under SDPA attention.

A decode step of a small model on a CPU spends most of its time in the Python around
the tensor ops: the Hugging Face module stack (decorators, output dataclasses, mask
and rotary helpers, one ``Module.__call__`` per linear layer). This module runs the
same computation (one token per row, keys/values through the engine's
:class:`~dew.serving._kv.SlotCache`) as a flat sequence of tensor ops over the model's
own weight tensors: embedding, then per layer RMSNorm, the q/k/v projections, rotary
embedding, cache write, SDPA with grouped query heads folded into the query length
(as ``transformers`` does for a single query token), the output projection, RMSNorm
and the SiLU-gated MLP; a final RMSNorm and the LM head on the one position.

Only models whose structure is known to match are accepted (:func:`lean_decode`
returns ``None`` otherwise, and the engine calls the model itself): ``model_type``
llama or qwen2, ``sdpa`` attention, default rotary embedding without scaling, SiLU
activation. The weights are held by reference: the engine's loads copy into the same
tensors, so the step always runs the weights being served.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

__all__ = ["lean_decode"]

_TYPES = ("llama", "qwen2")


def _norm(module: Any) -> tuple[torch.Tensor, float]:
    return module.weight, float(module.variance_epsilon)


def lean_decode(model: torch.nn.Module) -> Callable[..., torch.Tensor] | None:
    """The lean decode step for ``model``, or ``None`` when its structure is not one
    this module reproduces exactly."""
    config = model.config
    try:
        inner = model.model
        rotary = inner.rotary_emb
        supported = (
            config.model_type in _TYPES
            and getattr(config, "_attn_implementation", None) == "sdpa"
            and getattr(config, "hidden_act", None) == "silu"
            and getattr(rotary, "rope_type", None) == "default"
            and float(rotary.attention_scaling) == 1.0
            and all(type(layer.mlp.act_fn).__name__ == "SiLUActivation" for layer in inner.layers)
        )
    except AttributeError:
        return None
    if not supported:
        return None
    layers = []
    for layer in inner.layers[: config.num_hidden_layers]:
        attn, mlp = layer.self_attn, layer.mlp
        layers.append(
            (
                _norm(layer.input_layernorm),
                (attn.q_proj.weight, attn.q_proj.bias),
                (attn.k_proj.weight, attn.k_proj.bias),
                (attn.v_proj.weight, attn.v_proj.bias),
                (attn.o_proj.weight, attn.o_proj.bias),
                _norm(layer.post_attention_layernorm),
                (mlp.gate_proj.weight, mlp.gate_proj.bias),
                (mlp.up_proj.weight, mlp.up_proj.bias),
                (mlp.down_proj.weight, mlp.down_proj.bias),
            )
        )
    head_dim = int(inner.layers[0].self_attn.head_dim)
    groups = int(inner.layers[0].self_attn.num_key_value_groups)
    scaling = float(inner.layers[0].self_attn.scaling)
    embed = inner.embed_tokens.weight
    final = _norm(inner.norm)
    head_w, head_b = model.lm_head.weight, model.lm_head.bias
    inv_freq = rotary.inv_freq

    def rms(h: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
        x = h.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm[1])
        return norm[0] * x.to(h.dtype)

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def step(
        ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        # ids, positions [n, 1]; mask [n, 1, 1, W]; returns float logits [n, V]
        n = ids.shape[0]
        h = F.embedding(ids, embed)  # [n, 1, D]
        freqs = positions[..., None].float() * inv_freq.float()  # [n, 1, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(h.dtype).unsqueeze(1)  # [n, 1, 1, d]
        sin = emb.sin().to(h.dtype).unsqueeze(1)
        for i, (ln1, q_p, k_p, v_p, o_p, ln2, g_p, u_p, d_p) in enumerate(layers):
            x = rms(h, ln1)
            q = F.linear(x, *q_p).view(n, 1, -1, head_dim).transpose(1, 2)  # [n, Hq, 1, d]
            k = F.linear(x, *k_p).view(n, 1, -1, head_dim).transpose(1, 2)  # [n, Hkv, 1, d]
            v = F.linear(x, *v_p).view(n, 1, -1, head_dim).transpose(1, 2)
            keys, values = cache.update(rotate(k, cos, sin), v, i)  # [n, Hkv, W, d]
            q = rotate(q, cos, sin)
            if groups > 1:  # query heads of one kv head become its query rows
                q = q.reshape(n, -1, groups, head_dim)  # [n, Hkv, groups, d]
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
            o = o.reshape(n, -1, 1, head_dim).transpose(1, 2).reshape(n, 1, -1)  # [n, 1, Hq*d]
            h = h + F.linear(o, *o_p)
            x = rms(h, ln2)
            h = h + F.linear(F.silu(F.linear(x, *g_p)) * F.linear(x, *u_p), *d_p)
        h = rms(h[:, -1], final)  # [n, D]
        return F.linear(h, head_w, head_b).float()

    return step
