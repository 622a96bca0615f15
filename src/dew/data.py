"""Task datasets and the trainer's data stream.

A :class:`Dataset` is a table of equal-length columns read in batches. Its stream is
a pure function of ``(seed, position)``: batch ``p`` belongs to epoch
``p // batches_per_epoch`` and that epoch's shuffle is drawn from ``(seed, epoch)``,
so a checkpoint stores the data position as one integer and a resumed run reads
exactly the batches it would have read.

Processes of a multi-process trainer each read a *share* of every batch
(:meth:`Dataset.share`): the global batch ``p`` is the same on every process and
process ``k`` of ``n`` takes rows ``k::n`` of it.

:class:`Prefetch` is the trainer's look-ahead reader: it keeps ``depth`` batches read
beyond the one it hands out. It is a plain buffer, not a thread: reading a batch of
task ids is cheap, and what matters is *when* a batch is read, because a scheduler's
wrapped stream registers each batch the moment it is read.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

__all__ = ["Batch", "Dataset", "Prefetch"]

Batch = dict[str, np.ndarray]


def _columns(columns: Any) -> dict[str, np.ndarray]:
    # A Hugging Face datasets.Dataset exposes column_names and column access by name.
    if hasattr(columns, "column_names") and not isinstance(columns, Mapping):
        columns = {name: columns[name] for name in columns.column_names}
    if not isinstance(columns, Mapping) or not columns:
        raise ValueError(
            "columns must be a non-empty mapping of name -> array (or a datasets.Dataset)"
        )
    out = {str(k): np.asarray(v) for k, v in columns.items()}
    lengths = {k: len(v) for k, v in out.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"columns must have equal lengths, got {lengths}")
    return out


class Dataset:
    """Equal-length columns read in shuffled batches, epoch after epoch.

    ``columns`` is a mapping of name to array-like (or a ``datasets.Dataset``).
    Each epoch drops the last incomplete batch so every batch has ``batch_size`` rows.
    """

    def __init__(
        self,
        columns: Mapping[str, Any] | Any,
        *,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        self.columns = _columns(columns)
        self.rows = len(next(iter(self.columns.values())))
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if batch_size > self.rows:
            raise ValueError(f"batch_size={batch_size} exceeds the dataset's {self.rows} rows")
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self._share = (0, 1)
        self._on_open: Callable[[], None] | None = None
        self._on_read: Callable[[Batch], None] | None = None

    def __len__(self) -> int:
        return self.rows

    @property
    def batches_per_epoch(self) -> int:
        return self.rows // self.batch_size

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.rows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.rows)

    def batch(self, position: int) -> Batch:
        """Batch number ``position`` of the stream (this process's share of it)."""
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        epoch, i = divmod(position, self.batches_per_epoch)
        rows = self._order(epoch)[i * self.batch_size : (i + 1) * self.batch_size]
        index, count = self._share
        rows = rows[index::count]
        return {name: col[rows] for name, col in self.columns.items()}

    def stream(self, position: int = 0) -> Iterator[Batch]:
        """Batches from ``position`` on, forever."""
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        if self._on_open is not None:
            self._on_open()
        return self._iterate(position)

    def _iterate(self, position: int) -> Iterator[Batch]:
        while True:
            batch = self.batch(position)
            if self._on_read is not None:
                self._on_read(batch)
            yield batch
            position += 1

    def _copy(self) -> Dataset:
        other = object.__new__(Dataset)
        other.__dict__.update(self.__dict__)
        return other

    def share(self, index: int, count: int) -> Dataset:
        """The same stream where this reader takes rows ``index::count`` of every batch."""
        if count < 1 or not 0 <= index < count:
            raise ValueError(f"share index={index} must be in [0, count={count})")
        if self.batch_size % count:
            raise ValueError(f"batch_size={self.batch_size} is not divisible by count={count}")
        other = self._copy()
        other._share = (index, count)
        return other

    def observed(
        self, on_read: Callable[[Batch], None], on_open: Callable[[], None] | None = None
    ) -> Dataset:
        """A copy whose stream calls ``on_open()`` when opened and ``on_read(b)`` per batch."""
        other = self._copy()
        other._on_read = on_read
        other._on_open = on_open
        return other


class Prefetch:
    """Hands out batches of ``stream`` while keeping ``depth`` more already read."""

    def __init__(self, stream: Iterator[Batch], depth: int) -> None:
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        self._stream = stream
        self.depth = depth
        self._buffer: deque[Batch] = deque()

    def __iter__(self) -> Prefetch:
        return self

    def __next__(self) -> Batch:
        while len(self._buffer) <= self.depth:
            self._buffer.append(next(self._stream))
        return self._buffer.popleft()
