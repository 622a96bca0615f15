"""How a dense ``[rows, 1, q, k]`` boolean attention mask is handed to a transformers model.

The two kernels that take an explicit dense mask want different encodings: SDPA the
boolean mask itself (True = attend), eager an additive float mask added to the
scores. Both the trainer's packed scoring and the serving engine build a boolean mask
and pick the encoding from this registry by ``config._attn_implementation``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

__all__ = ["ATTENTION_MASKS", "additive_mask", "boolean_mask"]


def boolean_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SDPA encoding: the boolean mask itself (True = attend)."""
    del dtype
    return allowed


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Eager encoding: 0 where allowed, the dtype's most negative value elsewhere."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


# attention implementation -> how a [rows, 1, q, k] boolean mask is encoded for it
ATTENTION_MASKS: Mapping[str, Callable[[torch.Tensor, torch.dtype], torch.Tensor]] = {
    "sdpa": boolean_mask,
    "eager": additive_mask,
}
