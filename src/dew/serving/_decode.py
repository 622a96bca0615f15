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

Both forwards run as TorchScript functions where ``torch.jit`` can compile them. Next
to a training thread and an environment's worker threads, an eager forward hands the
interpreter lock over at each of its many small ops and waits to get it back; a
compiled one runs its ops without coming back to Python. Each writes its new keys and
values into the cache's buffers itself (the graph cannot call back into the cache
object). The plain functions are the fallback, and they are the same source, so both
compute the same thing.

Only models whose structure is known to match are accepted (:func:`lean_forward`
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


def _rotary(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    # positions [...] -> cos, sin [..., 1, d]: one axis for the heads to broadcast over
    freqs = positions.unsqueeze(-1).float() * inv_freq.float()  # [..., d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).unsqueeze(-2), emb.sin().to(dtype).unsqueeze(-2)


def _output_and_mlp(
    h: torch.Tensor,
    o: torch.Tensor,
    w: list[Optional[torch.Tensor]],  # noqa: UP045 (TorchScript)
    eps: float,
) -> torch.Tensor:
    # The rest of a layer after attention: the output projection of ``o`` and the
    # SiLU-gated MLP, each added to the residual ``h`` (w: the layer's 16 tensors).
    h = h + F.linear(o, _some(w[8]), w[9])
    x = _rms(h, _some(w[1]), eps)
    gate = F.silu(F.linear(x, _some(w[10]), w[11]))
    return h + F.linear(gate * F.linear(x, _some(w[12]), w[13]), _some(w[14]), w[15])


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
    cos, sin = _rotary(positions, inv_freq, h.dtype)  # [n, 1, 1, d]
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
        h = _output_and_mlp(h, o, w, eps[2 * i + 1])
    h = _rms(h[:, -1], final, eps[-1])  # [n, D]
    return F.linear(h, head_w, head_b).float()


def _padded(x: torch.Tensor, flat: torch.Tensor, k: int, t: int, head_dim: int) -> torch.Tensor:
    # [N, H, d] real tokens -> [k, H, T, d] with zeros at the padding
    out = x.new_zeros([k * t, x.shape[1], head_dim])
    out[flat] = x
    return out.view(k, t, -1, head_dim).transpose(1, 2)


def _prefill_step(
    ids: torch.Tensor,
    positions: torch.Tensor,
    real: torch.Tensor,
    mask: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    slots: torch.Tensor,
    columns: torch.Tensor,
    first: int,
    span: int,
    layers: list[list[Optional[torch.Tensor]]],  # noqa: UP045 (TorchScript)
    eps: list[float],
    shared: list[torch.Tensor],
    head_b: Optional[torch.Tensor],  # noqa: UP045 (TorchScript)
    head_dim: int,
    groups: int,
    scaling: float,
) -> torch.Tensor:
    # ids, positions, real [k, T] (left-padded: each row's last column is real); mask
    # [k, 1, T, S]; slots, columns [N]: where each real token's key/value goes, in the
    # row-major order of ``real``. span 0: a prefill, attending over the new tokens
    # alone (S = T); else an extend, attending over the first ``span`` columns of slots
    # ``first ..`` (S = span). layers, eps, shared as in _decode_step. Returns float
    # logits [k, V] of each row's last token.
    embed, inv_freq, final, head_w = shared[0], shared[1], shared[2], shared[3]
    k, t = ids.shape[0], ids.shape[1]
    flat = real.reshape(-1).nonzero().squeeze(1)  # [N] real positions in [k * T]
    n = flat.shape[0]
    h = F.embedding(ids.reshape(-1)[flat], embed)  # [N, D]
    cos, sin = _rotary(positions.reshape(-1)[flat], inv_freq, h.dtype)  # [N, 1, d]
    for i in range(len(layers)):
        w = layers[i]
        x = _rms(h, _some(w[0]), eps[2 * i])
        q = _rotate(F.linear(x, _some(w[2]), w[3]).view(n, -1, head_dim), cos, sin)  # [N, Hq, d]
        key = _rotate(F.linear(x, _some(w[4]), w[5]).view(n, -1, head_dim), cos, sin)  # [N, Hkv, d]
        value = F.linear(x, _some(w[6]), w[7]).view(n, -1, head_dim)
        kbuf, vbuf = keys[i], values[i]
        kbuf[slots, :, columns] = key
        vbuf[slots, :, columns] = value
        if span > 0:
            kk, vv = kbuf[first : first + k, :, :span], vbuf[first : first + k, :, :span]
        else:
            kk, vv = _padded(key, flat, k, t, head_dim), _padded(value, flat, k, t, head_dim)
        if groups > 1:  # as transformers does under a mask: repeat each kv head
            kk = kk.repeat_interleave(groups, dim=1)  # [k, Hq, S, d]
            vv = vv.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(
            _padded(q, flat, k, t, head_dim), kk, vv, attn_mask=mask, scale=scaling
        )  # [k, Hq, T, d]
        o = o.transpose(1, 2).reshape(k * t, -1)[flat]  # [N, Hq*d]
        h = _output_and_mlp(h, o, w, eps[2 * i + 1])
    last = real.sum(1).cumsum(0) - 1  # [k] each row's last token in [N]
    h = _rms(h[last], final, eps[-1])  # [k, D]
    return F.linear(h, head_w, head_b).float()


@functools.cache
def _compiled(step: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``step`` compiled by TorchScript, or (with a warning saying why) ``step`` itself
    where it cannot be: no source to read, or a torch that dropped ``torch.jit``."""
    try:
        with warnings.catch_warnings():
            # torch marks torch.jit deprecated; nothing else runs a graph of small CPU ops
            # without a trip through Python per op and without a compiler toolchain.
            warnings.simplefilter("ignore", DeprecationWarning)
            return torch.jit.script(step)
    except Exception as exc:
        warnings.warn(
            f"the lean {step.__name__} runs uncompiled (TorchScript refused it: {exc!r:.200})",
            RuntimeWarning,
            stacklevel=2,
        )
        return step


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
    # Per layer the 16 tensors the steps index (see _decode_step), and the norms' eps.
    weights: list[list[torch.Tensor | None]] = []
    eps: list[float] = []
    for layer in inner.layers[: config.num_hidden_layers]:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
        linears += (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        weights.append([m.weight for m in norms] + [t for m in linears for t in (m.weight, m.bias)])
        eps += [float(m.variance_epsilon) for m in norms]
    head_dim = int(inner.layers[0].self_attn.head_dim)
    groups = int(inner.layers[0].self_attn.num_key_value_groups)
    scaling = float(inner.layers[0].self_attn.scaling)
    embed = inner.embed_tokens.weight
    head_w, head_b = model.lm_head.weight, model.lm_head.bias
    inv_freq = rotary.inv_freq
    kv_heads = int(inner.layers[0].self_attn.k_proj.weight.shape[0]) // head_dim
    eps.append(float(inner.norm.variance_epsilon))
    shared = [embed, inv_freq, inner.norm.weight, head_w]
    run_step, run_prefill = _compiled(_decode_step), _compiled(_prefill_step)

    def step(
        ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        # ids, positions [n, 1]; mask [n, 1, 1, W]; returns float logits [n, V]
        keys, values, slots, columns, width = cache.decode_buffers(kv_heads, head_dim, embed.dtype)
        return run_step(
            ids, positions, mask, keys, values, slots, columns, width,
            weights, eps, shared, head_b, head_dim, groups, scaling,
        )  # fmt: skip

    def prefill(
        ids: torch.Tensor,
        positions: torch.Tensor,
        real: torch.Tensor,
        mask: torch.Tensor,
        cache: Any,
    ) -> torch.Tensor:
        # ids, positions, real [k, T]; mask [k, 1, T, S]; returns float logits [k, V]
        keys, values, slots, columns, first, span = cache.prefill_buffers(
            kv_heads, head_dim, embed.dtype
        )
        return run_prefill(
            ids, positions, real, mask, keys, values, slots, columns, first, span,
            weights, eps, shared, head_b, head_dim, groups, scaling,
        )  # fmt: skip

    return LeanForward(step, prefill)
