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

The decode step runs as one TorchScript function where ``torch.jit`` can compile it.
Next to a training thread and an environment's worker threads, the eager step hands the
interpreter lock over at each of its many small ops and waits to get it back; the
compiled step runs its ops without coming back to Python. The plain function is the
fallback, and it is the same source, so both compute the same thing.

Only models whose structure is known to match are accepted (:func:`lean_decode`
returns ``None`` otherwise, and the engine calls the model itself): ``model_type``
llama or qwen2, ``sdpa`` attention, default rotary embedding without scaling, SiLU
activation. The weights are held by reference: the engine's loads copy into the same
tensors, so the step always runs the weights being served.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch
from torch.nn import functional as F

__all__ = ["LeanForward", "lean_forward"]

_TYPES = ("llama", "qwen2")


def _rms(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(h.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _some(t: Optional[torch.Tensor]) -> torch.Tensor:  # noqa: UP045 (TorchScript)
    assert t is not None
    return t


def _decode_step(
    ids: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    slots: torch.Tensor,
    columns: torch.Tensor,
    width: int,
    layers: list[list[Optional[torch.Tensor]]],  # noqa: UP045 (TorchScript)
    eps: list[float],
    shared: list[torch.Tensor],
    head_b: Optional[torch.Tensor],  # noqa: UP045 (TorchScript)
    head_dim: int,
    groups: int,
    scaling: float,
) -> torch.Tensor:
    # ids, positions [n, 1]; mask [n, 1, 1, W]; keys, values: per layer the cache's
    # [slots, Hkv, capacity, d] buffers, each row's new key/value written at (slots[i],
    # columns[i]); eps: per layer its two norms' then the final norm's; shared: the
    # embedding, the rotary inverse frequencies, the final norm and the LM head weights.
    # layers: per layer 16 tensors (a bias may be None), indexed by literals since
    # TorchScript reads no global constants: [0] input norm, [1] post-attention norm,
    # then weight and bias of q [2, 3], k [4, 5], v [6, 7], o [8, 9], gate [10, 11],
    # up [12, 13] and down [14, 15]. Returns float logits [n, V].
    embed, inv_freq, final, head_w = shared[0], shared[1], shared[2], shared[3]
    n = ids.shape[0]
    h = F.embedding(ids, embed)  # [n, 1, D]
    freqs = positions.unsqueeze(-1).float() * inv_freq.float()  # [n, 1, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().to(h.dtype).unsqueeze(1)  # [n, 1, 1, d]
    sin = emb.sin().to(h.dtype).unsqueeze(1)
    for i in range(len(layers)):
        w = layers[i]
        x = _rms(h, _some(w[0]), eps[2 * i])
        q = F.linear(x, _some(w[2]), w[3]).view(n, 1, -1, head_dim).transpose(1, 2)
        k = F.linear(x, _some(w[4]), w[5]).view(n, 1, -1, head_dim).transpose(1, 2)
        v = F.linear(x, _some(w[6]), w[7]).view(n, 1, -1, head_dim).transpose(1, 2)
        kbuf, vbuf = keys[i], values[i]
        kbuf[slots, :, columns] = _rotate(k, cos, sin)[:, :, 0]  # [n, Hkv, d]
        vbuf[slots, :, columns] = v[:, :, 0]
        q = _rotate(q, cos, sin)  # [n, Hq, 1, d]
        if groups > 1:  # query heads of one kv head become its query rows
            q = q.reshape(n, -1, groups, head_dim)  # [n, Hkv, groups, d]
        o = F.scaled_dot_product_attention(
            q, kbuf[:n, :, :width], vbuf[:n, :, :width], attn_mask=mask, scale=scaling
        )
        o = o.reshape(n, -1, 1, head_dim).transpose(1, 2).reshape(n, 1, -1)  # [n, 1, Hq*d]
        h = h + F.linear(o, _some(w[8]), w[9])
        x = _rms(h, _some(w[1]), eps[2 * i + 1])
        gate = F.silu(F.linear(x, _some(w[10]), w[11]))
        h = h + F.linear(gate * F.linear(x, _some(w[12]), w[13]), _some(w[14]), w[15])
    h = _rms(h[:, -1], final, eps[-1])  # [n, D]
    return F.linear(h, head_w, head_b).float()


@functools.cache
def _compiled_decode_step() -> Callable[..., torch.Tensor]:
    """The decode step compiled by TorchScript, or (with a warning saying why) the plain
    function where it cannot be: no source to read, or a torch that dropped ``torch.jit``."""
    try:
        with warnings.catch_warnings():
            # torch marks torch.jit deprecated; nothing else runs a graph of small CPU ops
            # without a trip through Python per op and without a compiler toolchain.
            warnings.simplefilter("ignore", DeprecationWarning)
            return torch.jit.script(_decode_step)
    except Exception as exc:
        warnings.warn(
            f"the lean decode step runs uncompiled (TorchScript refused it: {exc!r:.200})",
            RuntimeWarning,
            stacklevel=2,
        )
        return _decode_step


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
    kv_heads = int(inner.layers[0].self_attn.k_proj.weight.shape[0]) // head_dim
    weights = [
        [ln1[0], ln2[0], *q_p, *k_p, *v_p, *o_p, *g_p, *u_p, *d_p]
        for ln1, q_p, k_p, v_p, o_p, ln2, g_p, u_p, d_p in layers
    ]
    eps = [e for layer in layers for e in (layer[0][1], layer[5][1])] + [final[1]]
    shared = [embed, inv_freq, final[0], head_w]
    run_step = _compiled_decode_step()

    def step(
        ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        # ids, positions [n, 1]; mask [n, 1, 1, W]; returns float logits [n, V]
        keys, values, slots, columns, width = cache.decode_buffers(kv_heads, head_dim, embed.dtype)
        return run_step(
            ids, positions, mask, keys, values, slots, columns, width,
            weights, eps, shared, head_b, head_dim, groups, scaling,
        )  # fmt: skip

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
            x = _rms(h, *ln1)
            q = _rotate(F.linear(x, *q_p).view(n, -1, head_dim), cos, sin)  # [N, Hq, d]
            key = _rotate(F.linear(x, *k_p).view(n, -1, head_dim), cos, sin)  # [N, Hkv, d]
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
            x = _rms(h, *ln2)
            h = h + F.linear(F.silu(F.linear(x, *g_p)) * F.linear(x, *u_p), *d_p)
        last = real.sum(1).cumsum(0) - 1  # [k] each row's last token in [N]
        h = _rms(h[last], *final)  # [k, D]
        return F.linear(h, head_w, head_b).float()

    return LeanForward(step, prefill)
