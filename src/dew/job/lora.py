"""LoRA for ``dew train`` (the ``lora`` extra: peft): only the adapter trains, the
engines serve the merged weights.

:func:`wrap` puts a peft LoRA adapter on the model (after the engine copied the base
model: an engine never sees adapter modules). :class:`MergedPublisher` stands between
the scheduler and the engine: every push hands the engine the base model's own names,
each adapted weight replaced by ``W + scale * B @ A`` computed from the adapter as it
is now (the trainer's model is not modified, so training goes on from the unmerged
adapter). :func:`export` writes both a merged ``save_pretrained`` folder, loadable and
servable like any checkpoint, and the adapter alone under ``adapter/``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["MergedPublisher", "export", "merged_state_dict", "wrap"]


def wrap(model: Any, *, rank: int, alpha: float, dropout: float, targets: Sequence[str]) -> Any:
    """``model`` with a LoRA adapter on ``targets`` (module names, or ``all-linear``);
    only the adapter's parameters require gradients."""
    import peft

    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(targets) if list(targets) != ["all-linear"] else "all-linear",
    )
    with warnings.catch_warnings():  # peft 0.21 asks transformers 5 a deprecated question
        warnings.filterwarnings(
            "ignore", message=".is_gradient_checkpointing. is deprecated", category=FutureWarning
        )
        return peft.get_peft_model(model, config)


def merged_state_dict(peft_model: Any) -> dict[str, Any]:
    """The base model's state dict (its own names) with every adapter merged in."""
    import torch
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    with torch.no_grad():
        deltas = {
            name: module.get_delta_weight(module.active_adapters[0])
            for name, module in base.named_modules()
            if isinstance(module, LoraLayer) and module.active_adapters
        }
        merged = {}
        for key, value in base.state_dict().items():
            if ".lora_" in key:
                continue
            name = key.replace(".base_layer.", ".")
            owner = key.rsplit(".base_layer.", 1)[0] if ".base_layer." in key else None
            if owner in deltas and key.endswith(".base_layer.weight"):
                value = value + deltas[owner].to(value.dtype)
            merged[name] = value
    return merged


class MergedPublisher:
    """A Publisher that pushes ``merged_state_dict`` of the trainer's peft model."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def load(self, variables: Any, version: int) -> None:
        self.engine.load(merged_state_dict(variables), version)


def export(peft_model: Any, tokenizer: Any, base_path: str, folder: Path) -> None:
    """``folder``: the merged model and tokenizer; ``folder/adapter``: the adapter."""
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    dtype = next(peft_model.parameters()).dtype
    merged = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype)
    merged.load_state_dict(merged_state_dict(peft_model))
    merged.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    peft_model.save_pretrained(folder / "adapter")
