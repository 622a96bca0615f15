"""A Weights & Biases sink for ``dew train`` (the ``wandb`` extra; offline by default).

One W&B run per run folder: its id is kept in ``wandb_id`` there, so ``--resume``
continues the same W&B run (``resume="allow"``). Steps are logged as they are trained
(``fit`` hands log callbacks only new records), so a resumed run logs no step twice.
Offline runs are written under the run folder and can be sent later with
``wandb sync``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dew._sinks import flatten

__all__ = ["WandbSink"]

_SKIP = {"step", "position", "time"}


class WandbSink:
    def __init__(self, run: Path, *, project: str, mode: str, config: Mapping[str, Any]) -> None:
        import wandb

        id_file = run / "wandb_id"
        if id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            run_id = uuid.uuid4().hex[:12]
            id_file.write_text(run_id)
        self._run = wandb.init(
            project=project,
            dir=str(run),
            mode=mode,
            id=run_id,
            name=run.name,
            resume="allow",
            config=dict(config),
            settings=wandb.Settings(console="off", silent=True),
        )

    def __call__(self, record: Mapping[str, Any]) -> None:
        values = {k: v for k, v in flatten(record).items() if k not in _SKIP}
        self._run.log(values, step=int(record["step"]))

    def close(self) -> None:
        self._run.finish()
