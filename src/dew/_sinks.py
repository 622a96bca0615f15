"""Where step records go: a JSONL file always, TensorBoard when it is installed.

A sink is a callable taking one record (a JSON-shaped dict) plus ``close()``. Users
plug anything else through ``fit(log=[...])``, which gets the same records.

The JSONL sink appends one line per record and flushes it, so a killed process loses
at most a torn last line; on open it rewrites the file to the records the run resumed
with (the checkpoint's history), atomically through a temporary file and a rename.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = ["JsonlSink", "Sink", "flatten", "tensorboard_sink"]


class Sink(Protocol):
    def __call__(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of ``record`` as ``{"a/b": value}`` (lists and strings skipped)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


class JsonlSink:
    """Appends records to ``path``, starting from exactly ``existing``."""

    def __init__(self, path: Path, existing: Sequence[Mapping[str, Any]]) -> None:
        self.path = path
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with open(tmp, "w") as f:
            for r in existing:
                f.write(json.dumps(r) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self._file = open(path, "a")

    def __call__(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class _TensorBoard:
    def __init__(self, folder: Path, purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(folder), purge_step=purge_step)

    def __call__(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        for name, value in flatten(record).items():
            if name not in ("step", "position", "time"):
                self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        self._writer.close()


def tensorboard_sink(folder: Path, *, resumed_at: int = 0) -> Sink | None:
    """A TensorBoard writer into ``folder``, or None when ``tensorboard`` is not installed.

    ``resumed_at``: the updates of the checkpoint a run starts from (0: none). The
    events an earlier process wrote for later steps (trained again now, as after a kill
    before the first checkpoint) are then purged, so TensorBoard shows every step once.
    """
    if importlib.util.find_spec("tensorboard") is None:
        return None
    return _TensorBoard(folder, resumed_at + 1)
