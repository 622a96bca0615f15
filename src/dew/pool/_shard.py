"""The model on the pool's mesh: FSDP2 along data, tensor parallelism along tensor.

:func:`shard_model` is the one place a model is laid out on the mesh. Along the
``tensor`` axis (when it has more than one process) each decoder layer's attention
and MLP projections are split with ``torch.distributed.tensor.parallel`` (queries,
keys, values, gate and up by output column, the output and down projections by input
row, so each block needs one reduction forward and one backward); along ``data``
every decoder layer and then the whole model are sharded with ``fully_shard``
(FSDP2), which gathers a layer's parameters for its forward and backward and
reduce-scatters its gradients: gradients are averaged over the data axis by FSDP2,
never by hand.

Collectives: everything here that moves tensors between processes is a collective
every process of the mesh must reach at the same point; the trainer guarantees it by
calling these only from steps every process takes (see :mod:`dew.pool._pool`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from dew.pool._pool import Pool

__all__ = [
    "full_state_dict",
    "is_sharded",
    "local_numel",
    "optimizer_tensors",
    "save_pretrained",
    "shard_model",
]

# Submodule of a Llama/Qwen-style decoder layer -> how tensor parallelism splits it.
# "colwise": by output features (heads and MLP channels); "rowwise": by input features,
# with the partial results summed across the tensor axis.
TENSOR_PLAN: dict[str, str] = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}

# Config fields that must divide by the tensor axis for the split above to be exact.
_DIVISIBLE = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def _decoder_layers(model: Any) -> list[Any]:
    """The decoder layers of a Hugging Face causal LM (``model.model.layers``)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(
            f"model: a {type(model).__name__} has no model.layers; dew.pool shards "
            "Hugging Face decoder models laid out as Llama/Qwen are "
            "(model.model.layers[i].self_attn / .mlp)"
        )
    return list(layers)


def _check_tensor_split(model: Any, tensor: int) -> None:
    config = getattr(model, "config", None)
    for field in _DIVISIBLE:
        value = getattr(config, field, None)
        if value is None:
            raise ValueError(f"tensor={tensor}: the model's config has no {field}")
        if value % tensor:
            raise ValueError(
                f"tensor={tensor} must divide the model's {field}={value} "
                "(each process of the tensor axis holds an equal part)"
            )


def shard_model(model: torch.nn.Module, pool: Pool) -> torch.nn.Module:
    """Lay ``model`` out on ``pool``'s mesh in place and return it.

    Build the optimizer after this call (its parameters are the sharded ones), and
    build an in-process engine's copy before it (it copies full tensors). With
    ``pool.tensor > 1`` the model must be a Llama/Qwen-style decoder whose head counts
    and MLP width divide by ``pool.tensor``; a ValueError says which does not.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if pool.mesh is None:
        raise ValueError("pool: has no device mesh (made by init_pool)")
    layers = _decoder_layers(model)
    if pool.tensor > 1:
        _check_tensor_split(model, pool.tensor)
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        for i, layer in enumerate(layers):
            names = dict(layer.named_modules())
            plan = {}
            for name, style in TENSOR_PLAN.items():
                if name not in names:
                    raise ValueError(
                        f"model: decoder layer {i} has no {name}; tensor parallelism splits "
                        f"{', '.join(TENSOR_PLAN)}"
                    )
                plan[name] = styles[style]()
            parallelize_module(layer, pool.mesh["tensor"], plan)
    data = pool.mesh["data"]
    for layer in layers:
        fully_shard(layer, mesh=data)
    fully_shard(model, mesh=data)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (sharded or split on a mesh)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def full_state_dict(model: torch.nn.Module, *, rank0_only: bool = False) -> dict[str, Any]:
    """The model's whole tensors by name, gathered from every process.

    A collective over the mesh: every process calls it at the same point. With
    ``rank0_only`` the tensors are copied to CPU on rank 0 and the other processes get
    an empty dict (for a ``save_pretrained`` export: one full copy, on one process).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    return get_model_state_dict(model, options=options)


def local_numel(tensors: Iterable[Any]) -> int:
    """Elements this process holds of ``tensors`` (a DTensor counts its local shard)."""
    from torch.distributed.tensor import DTensor

    return sum(int((t.to_local() if isinstance(t, DTensor) else t).numel()) for t in tensors)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[Any]:
    """Every tensor of the optimizer's per-parameter state (Adam's moments, steps)."""
    import torch

    out = []
    for state in optimizer.state.values():
        if isinstance(state, Mapping):
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def save_pretrained(model: Any, folder: Any, pool: Pool, *, tokenizer: Any = None) -> None:
    """``model.save_pretrained(folder)`` of a sharded model: the whole tensors are gathered
    to rank 0 (on CPU), which alone writes; a collective every process calls."""
    with pool.collective("save_pretrained"):
        state = full_state_dict(model, rank0_only=True)
    error = ""
    if pool.rank == 0:
        try:
            model.save_pretrained(folder, state_dict=state)
            if tokenizer is not None:
                tokenizer.save_pretrained(folder)
        except (OSError, ValueError, RuntimeError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    del state
    # Every process returns only once the folder is written (or all raise).
    pool.agree(RuntimeError(f"save_pretrained({folder}): {error}") if error else None)
