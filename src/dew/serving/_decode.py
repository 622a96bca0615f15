"""Lean forwards (decode step and packed prefill) for Llama-family models (Llama, Qwen2)
under SDPA attention.

A decode step of a small model on a CPU spends most of its time in the Python around
the tensor ops: the Hugging Face module stack (decorators, output dataclasses, mask
and rotary helpers, one ``Module.__call__`` per linear layer). This module runs the
same computation (one token per row, keys/values through the engine's
:class:`~dew.serving._kv.SlotCache`) as a flat sequence of tensor ops over the model's
own weight tensors: embedding, then per layer RMSNorm, the q/k/v projections, rotary
embedding, cache write, SDPA with grouped query heads folded into the query length
(as ``transformers`` does for a single query token), the output projection, RMSNorm
and the SiLU-gated MLP; a final RMSNorm and the LM head on the one position.

A prefill forward has the opposite problem: its prompts are left-padded to a common
width, and the model's own forward runs every projection and MLP over the padding too
(a third of the positions for prompts of 8-24 tokens). The lean prefill runs those
over the real tokens only, packed into one ``[N, D]`` matrix, and goes back to the
padded ``[k, heads, T, d]`` layout just for the cache write and attention, which see
exactly the tensors the model's forward would give them (padded keys are zeros rather
than projections of the pad token; no mask lets a real query see them).

Only models whose structure is known to match are accepted (:func:`lean_decode`
returns ``None`` otherwise, and the engine calls the model itself): ``model_type``
llama or qwen2, ``sdpa`` attention, default rotary embedding without scaling, SiLU
activation. The weights are held by reference: the engine's loads copy into the same
tensors, so the step always runs the weights being served.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.nn import functional as F

__all__ = ["LeanForward", "lean_forward"]

_TYPES = ("llama", "qwen2")


def _norm(module: Any) -> tuple[torch.Tensor, float]:
    return module.weight, float(module.variance_epsilon)


class LeanForward(NamedTuple):
    """The two lean forwards of one model (see the module docstring)."""

    # (ids [n, 1], positions [n, 1], mask [n, 1, 1, W], cache) -> logits [n, V]
    decode: Callable[..., torch.Tensor]
    # (ids [k, T], positions [k, T], real [k, T], mask [k, 1, T, S], cache) -> logits [k, V]
    prefill: Callable[..., torch.Tensor]


def lean_forward(model: torch.nn.Module) -> LeanForward | None:
    """The lean forwards for ``model``, or ``None`` when its structure is not one this
    module reproduces exactly."""
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

    def padded(x: torch.Tensor, flat: torch.Tensor, k: int, t: int) -> torch.Tensor:
        # [N, H, d] real tokens -> [k, H, T, d] with zeros at the padding
        out = x.new_zeros(k * t, x.shape[1], head_dim)
        out[flat] = x
        return out.view(k, t, -1, head_dim).transpose(1, 2)

    def prefill(
        ids: torch.Tensor,
        positions: torch.Tensor,
        real: torch.Tensor,
        mask: torch.Tensor,
        cache: Any,
    ) -> torch.Tensor:
        # ids, positions, real [k, T] (left-padded: each row's last column is real);
        # mask [k, 1, T, S]; returns float logits [k, V] of each row's last token
        k, t = ids.shape
        flat = real.reshape(-1).nonzero().squeeze(1)  # [N] real positions in [k * T]
        n = flat.shape[0]
        h = F.embedding(ids.reshape(-1)[flat], embed)  # [N, D]
        freqs = positions.reshape(-1)[flat, None].float() * inv_freq.float()  # [N, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(h.dtype).unsqueeze(1)  # [N, 1, d]
        sin = emb.sin().to(h.dtype).unsqueeze(1)
        for i, (ln1, q_p, k_p, v_p, o_p, ln2, g_p, u_p, d_p) in enumerate(layers):
            x = rms(h, ln1)
            q = rotate(F.linear(x, *q_p).view(n, -1, head_dim), cos, sin)  # [N, Hq, d]
            key = rotate(F.linear(x, *k_p).view(n, -1, head_dim), cos, sin)  # [N, Hkv, d]
            value = F.linear(x, *v_p).view(n, -1, head_dim)
            keys, values = cache.update(
                padded(key, flat, k, t), padded(value, flat, k, t), i
            )  # [k, Hkv, S, d]
            if groups > 1:  # as transformers does under a mask: repeat each kv head
                keys = keys.repeat_interleave(groups, dim=1)  # [k, Hq, S, d]
                values = values.repeat_interleave(groups, dim=1)
            o = F.scaled_dot_product_attention(
                padded(q, flat, k, t), keys, values, attn_mask=mask, scale=scaling
            )  # [k, Hq, T, d]
            o = o.transpose(1, 2).reshape(k * t, -1)[flat]  # [N, Hq*d]
            h = h + F.linear(o, *o_p)
            x = rms(h, ln2)
            h = h + F.linear(F.silu(F.linear(x, *g_p)) * F.linear(x, *u_p), *d_p)
        last = real.sum(1).cumsum(0) - 1  # [k] each row's last token in [N]
        h = rms(h[last], final)  # [k, D]
        return F.linear(h, head_w, head_b).float()

    return LeanForward(step, prefill)
