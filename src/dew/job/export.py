"""The exports of a ``dew train`` run: ``save_pretrained`` folders that
``transformers`` loads as they are, written whole or not at all."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dew._checkpoint import NO_SPACE
from dew.job.config import ConfigError, JobConfig

__all__ = ["export", "exporter"]


def export(model: Any, tokenizer: Any, folder: Path, config: JobConfig, pool: Any = None) -> None:
    """``save_pretrained`` of the model and its tokenizer (with its chat template); with
    LoRA the merged model there and the adapter in ``adapter/``. A sharded model is
    gathered to rank 0, which writes (every process calls this).

    Whole or not at all, as checkpoints are: it is written into ``.tmp-NAME`` beside
    ``folder`` and renamed into place, so a kill inside it leaves ``folder`` as it was
    (absent, or the previous export) and a temporary folder the next export removes."""
    writer = pool is None or pool.rank == 0
    tmp = folder.with_name(f".tmp-{folder.name}")
    if writer:
        shutil.rmtree(tmp, ignore_errors=True)  # a killed export's
        tmp.mkdir(parents=True)
    try:
        if pool is not None:
            from dew.pool import save_pretrained

            save_pretrained(model, tmp, pool, tokenizer=tokenizer)
        elif config.model.lora_rank > 0:
            from dew.job import lora

            lora.export(model, tokenizer, config.model.path, tmp)
        else:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    except OSError as exc:
        if writer:  # a half export is no export: the folder stays as it was
            shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno in NO_SPACE:
            raise ConfigError(
                f"{folder}: no space left on the device for the export "
                f"({shutil.disk_usage(folder.parent).free / (1 << 20):.1f} MiB free)"
            ) from exc
        raise
    if writer:
        _publish(tmp, folder)


def _publish(tmp: Path, folder: Path) -> None:
    """Put the whole folder ``tmp`` in ``folder``'s place (the old one goes)."""
    old = folder.with_name(f".old-{folder.name}")
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def exporter(
    model: Any, tokenizer: Any, run: Path, every: int | None, config: JobConfig, pool: Any
) -> Callable[[Mapping[str, Any]], None]:
    """A ``fit`` log callback: an export to ``exports/step-N`` every ``every`` steps."""

    def maybe(record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        if every and step % every == 0:
            export(model, tokenizer, run / "exports" / f"step-{step}", config, pool)

    return maybe
