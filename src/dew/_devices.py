"""Torch device names as a user writes them (``cpu``, ``cuda``, ``cuda:1``), checked
against this machine before anything is placed there. Shared by ``dew serve`` and
``dew train``; imports nothing of dew, and torch only when a device is checked."""

from __future__ import annotations

import re

__all__ = ["DEVICE_PATTERN", "default_device", "device_problem"]

# The kinds dew places models on; an index only where the kind has several.
DEVICE_PATTERN = re.compile(r"(cpu|mps|(cuda|xpu)(:\d+)?)")


def device_problem(name: str) -> str | None:
    """Why ``name`` is not a device of this machine (None: it is one)."""
    if not DEVICE_PATTERN.fullmatch(name):
        return "not a device name (cpu, cuda, cuda:N, xpu, xpu:N or mps)"
    import torch

    kind, _, index = name.partition(":")
    backend = {"cuda": torch.cuda, "xpu": getattr(torch, "xpu", None)}.get(kind)
    if kind == "mps" and not torch.backends.mps.is_available():
        return "MPS is not available on this machine"
    if backend is None:
        return None
    if not backend.is_available():
        return f"{kind.upper()} is not available on this machine"
    if index and int(index) >= backend.device_count():
        return f"this machine has {backend.device_count()} {kind} devices (0..)"
    return None


def default_device() -> str:
    """Where a model goes when nobody said: the first GPU if there is one, else cpu."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
