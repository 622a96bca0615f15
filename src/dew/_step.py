"""One training step's arithmetic: forward and backward in row slices, and the
gradient clip across device meshes. No threads and no state of its own.
Imports nothing of dew."""

from __future__ import annotations

import itertools
from typing import Any

__all__ = ["backward", "clip_grad_norm", "per_row", "slices"]

Batch = dict[str, Any]


def backward(
    objective: Any, model: Any, packed: Batch, parts: int
) -> tuple[float, dict[str, float]]:
    """Forward and backward over ``packed`` in ``parts`` row slices; returns the loss and
    the metrics (see ``fit``'s ``micro_batches``)."""
    if parts == 1:
        loss, metrics = objective.loss(model, packed)
        loss.backward()
        return float(loss.detach()), dict(metrics)
    rows, width = (int(n) for n in packed["loss_mask"].shape)
    total = 0.0
    weighted: dict[str, float] = {}
    tokens = float(packed["loss_mask"].sum())
    for start, stop in slices(rows, parts):
        part = {k: v[start:stop] if per_row(v, rows) else v for k, v in packed.items()}
        loss, metrics = objective.loss(model, part, normalizer=float(rows * width))
        loss.backward()
        total += float(loss.detach())
        share = float(part["loss_mask"].sum()) / tokens if tokens else 1.0 / parts
        for name, value in metrics.items():
            if name.endswith("_max"):
                weighted[name] = max(weighted.get(name, value), value)
            elif name.endswith("_tokens"):  # counts add up
                weighted[name] = weighted.get(name, 0.0) + float(value)
            else:
                weighted[name] = weighted.get(name, 0.0) + share * float(value)
    return total, weighted


def clip_grad_norm(model: Any, max_norm: float) -> float:
    """Scale the gradients so their global 2-norm is at most ``max_norm``; returns the norm.

    As ``torch.nn.utils.clip_grad_norm_``, but for gradients on several device meshes
    too (a model split along a tensor axis holds DTensors on the 2-D mesh beside
    replicated ones on the data axis, which torch's version refuses to mix): the norm
    is taken per mesh, in parameter order (the same collectives on every process), and
    the parts are combined.
    """
    import torch
    from torch.distributed.tensor import DTensor

    groups: dict[int, list[torch.Tensor]] = {}  # id(mesh) (0: plain tensors) -> grads
    for p in model.parameters():
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(id(mesh) if mesh is not None else 0, []).append(p.grad)
    if not groups:
        return 0.0
    squares = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float().cpu() ** 2)
    total = torch.stack(squares).sum().sqrt()  # []
    coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    for grads in groups.values():
        torch._foreach_mul_(grads, coef)
    return float(total)


def slices(rows: int, parts: int) -> list[tuple[int, int]]:
    edges = [round(i * rows / parts) for i in range(parts + 1)]
    return [(a, b) for a, b in itertools.pairwise(edges) if b > a]


def per_row(value: Any, rows: int) -> bool:
    shape = getattr(value, "shape", ())
    return len(shape) >= 1 and int(shape[0]) == rows
