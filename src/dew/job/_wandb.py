"""A Weights & Biases sink for ``dew train`` (the ``wandb`` extra; offline by default).

A W&B run can only be appended to, and a resumed run trains again the steps between its
checkpoint and the kill: continuing the same W&B run would show those steps twice (a
killed offline run keeps whatever it had flushed). So each start of a run folder is a
W&B run of its own, grouped under the folder's name, and a resumed one first logs the
history it resumes from (``records.jsonl``, as the checkpoint restored it): the newest
W&B run of a folder holds every step once, as recorded. Its id is kept in ``wandb_id``.
Offline runs are written under the run folder and can be sent later with ``wandb sync``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dew._sinks import flatten

__all__ = ["WandbSink"]

_SKIP = {"step", "position", "time"}


class WandbSink:
    def __init__(self, run: Path, *, project: str, mode: str, config: Mapping[str, Any]) -> None:
        import wandb

        self._records = run / "records.jsonl"
        self._replayed = False
        run_id = uuid.uuid4().hex[:12]
        (run / "wandb_id").write_text(run_id)
        self._run = wandb.init(
            project=project,
            dir=str(run),
            mode=mode,
            id=run_id,
            name=run.name,
            group=run.name,
            config=dict(config),
            settings=wandb.Settings(console="off", silent=True),
        )

    def __call__(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        if not self._replayed:  # a resumed run: the steps before the first new one
            self._replayed = True
            for earlier in _read(self._records):
                if int(earlier["step"]) < step:
                    self._log(earlier)
        self._log(record)

    def _log(self, record: Mapping[str, Any]) -> None:
        values = {k: v for k, v in flatten(record).items() if k not in _SKIP}
        self._run.log(values, step=int(record["step"]))

    def table(self, step: int, columns: Sequence[str], rows: list[list[Any]]) -> None:
        """A table (the step's samples) at ``step``, beside its record."""
        import wandb

        self._run.log({"samples": wandb.Table(columns=list(columns), data=rows)}, step=step)

    def close(self) -> None:
        self._run.finish()


def _read(path: Path) -> list[dict[str, Any]]:
    """The records of ``path`` (by the time of the first new step, ``fit`` has
    rewritten it to the checkpoint's records and appended that step)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a torn last line
            continue
    return out
