"""Per-slot key/value buffers and the model-call adapter of the serving engine.

Layout: for each attention layer, keys and values live in ``[slots, kv_heads, capacity,
head_dim]`` buffers. A request owns one slot; its tokens occupy columns ``0 .. length-1``
of that slot, so a token's column is also its position. Active requests always hold the
slots ``0 .. n-1`` (a leaving request's hole is filled by moving the last slot down), so
a decode step reads plain views ``[:n, :, :width]`` of the buffers without gathering.

The buffers are handed to a Hugging Face model as its cache object: its attention
layers call ``update(keys, values, layer_idx, ...)`` with the new tokens' projections,
and get back the keys and values to attend over. Masks are built here as ready 4-D
tensors, which the models' mask helpers pass through untouched, so nothing in the model
needs to know how the cache is laid out.

Two modes, set before each forward:

* prefill: ``k`` new requests, left-padded to a common prompt width ``T``. The model
  attends over the new tokens only; ``update`` copies each row's real tokens into
  columns ``0 .. len-1`` of its slot.
* extend: ``k`` new requests in the contiguous slots ``first .. first+k-1``, each
  appending its tokens (left-padded to a common width ``T``) after the ``start``
  columns its slot already holds (a shared prefix, copied in with :meth:`move`).
  ``update`` writes the real tokens at columns ``start .. start+len-1`` and the model
  attends over the slots' first ``span`` columns, each query masked past its own column.
* decode: one new token per active slot, written at the slot's own column; attention
  covers columns ``0 .. width-1``, with each row masked past its own column.

Invariant kept by the caller: every column a mask lets a row see holds finite values
(buffers start zeroed; padded prefill rows attend to themselves), so masked garbage can
never turn into NaN through ``0 * nan``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from dew._attention import ATTENTION_MASKS as MASKS
from dew.serving._decode import lean_forward

__all__ = ["MASKS", "ModelCall", "SlotCache", "forward_decode", "forward_prefill"]

# Moves of at most this many slots copy slot by slot (see SlotCache.move).
_FEW = 8


class SlotCache:
    """Growable per-slot KV buffers (see the module docstring for the layout)."""

    def __init__(self, layers: int, max_slots: int, max_len: int, device: torch.device) -> None:
        self.layers = layers
        self.max_slots = max_slots
        self.max_len = max_len
        self.device = device
        self.keys: list[torch.Tensor] = []  # per layer [slots, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor] = []
        self.slot_capacity = 0
        self.capacity = 0
        self._want_slots = 0
        self._want_capacity = 0
        # Mode of the next forward (see module docstring).
        self._prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._decode: tuple[int, torch.Tensor, torch.Tensor, int] | None = None
        self._span: tuple[int, int, int] | None = None  # extend: first slot, k, span
        self._slot_ids = torch.arange(max_slots, device=device)  # [max_slots]

    # ------------------------------------------------------------------ sizing

    def reserve(self, slots: int, columns: int) -> None:
        """Make room for ``slots`` slots of ``columns`` columns (grows by doubling)."""
        if slots > max(self.slot_capacity, self._want_slots):
            self._want_slots = min(self.max_slots, max(slots, 2 * self.slot_capacity, 4))
        if columns > max(self.capacity, self._want_capacity):
            self._want_capacity = min(self.max_len, max(columns, 2 * self.capacity, 64))
        if self.keys and (
            self._want_slots > self.slot_capacity or self._want_capacity > self.capacity
        ):
            self.keys = [self._grown(t) for t in self.keys]
            self.values = [self._grown(t) for t in self.values]
            self.slot_capacity = max(self.slot_capacity, self._want_slots)
            self.capacity = max(self.capacity, self._want_capacity)

    def _grown(self, t: torch.Tensor) -> torch.Tensor:
        s, h, c, d = t.shape
        out = torch.zeros(
            max(s, self._want_slots),
            h,
            max(c, self._want_capacity),
            d,
            dtype=t.dtype,
            device=t.device,
        )
        out[:s, :, :c] = t
        return out

    def _allocate(self, heads: int, dim: int, dtype: torch.dtype) -> None:
        # First forward: the model tells us kv heads, head dim and dtype.
        self.slot_capacity = max(self.slot_capacity, self._want_slots)
        self.capacity = max(self.capacity, self._want_capacity)
        shape = (self.slot_capacity, heads, self.capacity, dim)
        self.keys = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.layers)
        ]
        self.values = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.layers)
        ]

    def clear(self) -> None:
        """Drop all buffers (after a failed step their contents are unknown)."""
        self.keys, self.values = [], []
        self.slot_capacity = self.capacity = 0
        self._prefill = self._decode = self._span = None

    # ------------------------------------------------------------------ modes

    def set_prefill(self, slots: list[int], lengths: list[int], width: int) -> None:
        """Next forward prefills ``len(lengths)`` sequences, left-padded to ``width``,
        into ``slots``."""
        k = len(lengths)
        lens = torch.tensor(lengths, device=self.device)  # [k]
        # Flattened (slot, column) <- (row, padded column) pairs of every real token.
        rows = torch.repeat_interleave(torch.arange(k, device=self.device), lens)  # [N]
        starts = torch.cumsum(lens, 0) - lens  # [k]
        cols = torch.arange(int(lens.sum()), device=self.device) - starts[rows]  # [N]
        src_cols = cols + (width - lens)[rows]
        slot_of_row = torch.tensor(slots, device=self.device)  # [k]
        self._prefill = (slot_of_row[rows], cols, rows, src_cols)
        self._decode = self._span = None

    def set_extend(
        self, first: int, starts: list[int], lengths: list[int], width: int, span: int
    ) -> None:
        """Next forward appends ``lengths[i]`` tokens (left-padded to ``width``) after the
        ``starts[i]`` columns slot ``first + i`` holds; attention covers ``span`` columns."""
        k = len(lengths)
        lens = torch.tensor(lengths, device=self.device)  # [k]
        start = torch.tensor(starts, device=self.device)  # [k]
        rows = torch.repeat_interleave(torch.arange(k, device=self.device), lens)  # [N]
        offsets = torch.cumsum(lens, 0) - lens  # [k]
        j = torch.arange(int(lens.sum()), device=self.device) - offsets[rows]  # [N] i-th new
        self._prefill = (first + rows, start[rows] + j, rows, j + (width - lens)[rows])
        self._span = (first, k, span)
        self._decode = None

    def set_decode(self, n: int, columns: torch.Tensor, width: int) -> None:
        """Next forward writes one token per slot ``0 .. n-1`` at ``columns`` [n] and
        attends over ``width`` columns."""
        self._decode = (n, self._slot_ids[:n], columns, width)
        self._prefill = self._span = None

    def decode_buffers(
        self, heads: int, dim: int, dtype: torch.dtype
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor, int]:
        """What a decode step set by :meth:`set_decode` writes and reads, for a forward
        that does its own cache writes (the lean step): every layer's key and value
        buffers, the slots ``0 .. n-1``, their columns [n] and the width attended over.
        Allocates the buffers (``heads`` kv heads of ``dim``, ``dtype``) on first use."""
        if self._decode is None:
            raise RuntimeError("SlotCache.decode_buffers called outside a decode step")
        if not self.keys:
            self._allocate(heads, dim, dtype)
        _, slot_ids, columns, width = self._decode
        return self.keys, self.values, slot_ids, columns, width

    def prefill_buffers(
        self, heads: int, dim: int, dtype: torch.dtype
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor, int, int]:
        """What a prefill or extend set by :meth:`set_prefill` / :meth:`set_extend` writes
        and reads, for a forward that does its own cache writes (the lean prefill): every
        layer's key and value buffers, the slot and column [N] of each real token (in
        the row-major order of the padded batch), and for an extend its first slot and
        the columns attended over (``0, 0`` for a prefill, which attends over the new
        tokens alone). Allocates the buffers on first use, as :meth:`decode_buffers`."""
        if self._prefill is None:
            raise RuntimeError("SlotCache.prefill_buffers called outside a prefill")
        if not self.keys:
            self._allocate(heads, dim, dtype)
        slots, cols = self._prefill[0], self._prefill[1]
        first, _, span = self._span if self._span is not None else (0, 0, 0)
        return self.keys, self.values, slots, cols, first, span

    def move(self, src: list[int], dst: list[int], width: int) -> None:
        """Copy slots ``src`` onto slots ``dst`` (first ``width`` columns)."""
        if not src or not self.keys:
            return
        tensors = (*self.keys, *self.values)
        if len(src) <= _FEW and set(src).isdisjoint(dst):
            # a few slots: one narrow copy each measured cheaper than an indexed gather
            # and scatter (bench/RESULTS.md, "Figures moved out of code comments")
            for t in tensors:
                for i, j in zip(src, dst, strict=True):
                    t[j, :, :width].copy_(t[i, :, :width])
            return
        s = torch.tensor(src, device=self.device)
        d = torch.tensor(dst, device=self.device)
        for t in tensors:
            t[d, :, :width] = t[s, :, :width]

    # ------------------------------------------------------------------ model protocol

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Called by each attention layer with its new keys/values ``[b, kv_heads, q, dim]``."""
        if not self.keys:
            _, heads, _, dim = keys.shape
            self._allocate(heads, dim, keys.dtype)
        kbuf, vbuf = self.keys[layer_idx], self.values[layer_idx]
        if self._prefill is not None:
            slots, cols, rows, src_cols = self._prefill
            kbuf[slots, :, cols] = keys[rows, :, src_cols]  # [N, kv_heads, dim]
            vbuf[slots, :, cols] = values[rows, :, src_cols]
            if self._span is None:
                return keys, values
            first, k, span = self._span
            return kbuf[first : first + k, :, :span], vbuf[first : first + k, :, :span]
        if self._decode is None:
            raise RuntimeError("SlotCache.update called without a mode")
        n, slot_ids, columns, width = self._decode
        kbuf[slot_ids, :, columns] = keys[:, :, 0]
        vbuf[slot_ids, :, columns] = values[:, :, 0]
        return kbuf[:n, :, :width], vbuf[:n, :, :width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly


class ModelCall:
    """Calls a causal LM with our cache and mask under whatever keyword names its
    ``transformers`` version uses; returns float logits of the last position ``[b, V]``.
    Decode steps and prefills take the lean paths of :mod:`dew.serving._decode` where
    the model has them (``lean=False``: always the model's own forward)."""

    def __init__(self, model: torch.nn.Module, *, lean: bool = True) -> None:
        attn = getattr(model.config, "_attn_implementation", None) or "eager"
        if attn not in MASKS:
            raise ValueError(
                f"model attention implementation {attn!r} is not supported; use one of "
                f"{sorted(MASKS)} (set attn_implementation when loading the model)"
            )
        layer_types = getattr(model.config, "layer_types", None) or ()
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(
                f"model has non-full attention layers {sorted(set(layer_types))}; the engine "
                "supports full causal attention only"
            )
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.keep_kw = next(
            (k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None
        )
        self.mask = MASKS[attn]
        self.model = model
        self.dtype = next(model.parameters()).dtype
        self.lean = lean_forward(model) if lean else None

    def decode(
        self, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, cache: SlotCache
    ) -> torch.Tensor:
        """One decode step (``ids`` [n, 1]): the lean path when the model has one."""
        if self.lean is None:
            return self(ids, positions, allowed, cache)
        return self.lean.decode(ids, positions, self.mask(allowed, self.dtype), cache)

    def prefill(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        lengths: torch.Tensor,
        allowed: torch.Tensor,
        cache: SlotCache,
    ) -> torch.Tensor:
        """A prefill of ``ids`` [k, T], row i left-padded to hold ``lengths[i]`` real
        tokens: the lean path (projections over the real tokens only) where the model
        has one."""
        if self.lean is None:
            return self(ids, positions, allowed, cache)
        width = ids.shape[1]
        real = torch.arange(width, device=ids.device) >= (width - lengths).unsqueeze(1)  # [k, T]
        return self.lean.prefill(ids, positions, real, self.mask(allowed, self.dtype), cache)

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, cache: SlotCache
    ) -> torch.Tensor:
        # ids, positions [b, q]; allowed [b, 1, q, kv] bool
        kwargs: dict[str, Any] = {
            "input_ids": ids,
            "position_ids": positions,
            "attention_mask": self.mask(allowed, self.dtype),
            self.cache_kw: cache,
            "use_cache": True,
        }
        if self.keep_kw is not None:
            kwargs[self.keep_kw] = 1
        logits = self.model(**kwargs).logits  # [b, q or 1, V]
        return logits[:, -1, :].float()


def forward_prefill(
    call: ModelCall, cache: SlotCache, seqs: list[list[int]], slots: list[int]
) -> torch.Tensor:
    """Run ``seqs`` (token ids, longest first) left-padded through the model, writing
    their keys/values into ``slots``; returns the last position's logits [k, V]."""
    device = cache.device
    width = len(seqs[0])
    cache.reserve(max(slots) + 1, width)
    lens = torch.tensor([len(s) for s in seqs], device=device)  # [k]
    ids = torch.tensor([[0] * (width - len(s)) + s for s in seqs], device=device)  # [k, T]
    col = torch.arange(width, device=device)  # [T]
    pad = (width - lens).unsqueeze(1)  # [k, 1]
    positions = (col.unsqueeze(0) - pad).clamp(min=0)  # [k, T]
    causal = col.unsqueeze(1) >= col.unsqueeze(0)  # [T, T] query >= key
    real_key = (col.unsqueeze(0) >= pad).unsqueeze(1)  # [k, 1, T]
    # Padded query rows attend to themselves so every row stays finite.
    eye = torch.eye(width, dtype=torch.bool, device=device)
    allowed = (causal & real_key) | eye  # [k, T, T]
    cache.set_prefill(slots, [len(s) for s in seqs], width)
    return call.prefill(ids, positions, lens, allowed.unsqueeze(1), cache)


def forward_decode(
    call: ModelCall, cache: SlotCache, last: list[int], columns: list[int]
) -> torch.Tensor:
    """One decode step of slots ``0 .. n-1``: token ``last[i]`` at column ``columns[i]``
    of slot ``i``; returns the next-token logits [n, V]."""
    device = cache.device
    n = len(last)
    width = max(columns) + 1
    cache.reserve(n, width)
    cols = torch.tensor(columns, device=device)  # [n]
    ids = torch.tensor(last, device=device).unsqueeze(1)  # [n, 1]
    key = torch.arange(width, device=device)  # [W]
    allowed = (key.unsqueeze(0) <= cols.unsqueeze(1))[:, None, None, :]  # [n, 1, 1, W]
    cache.set_decode(n, cols, width)
    return call.decode(ids, cols.unsqueeze(1), allowed, cache)  # [n, V]
