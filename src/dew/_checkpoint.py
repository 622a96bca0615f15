"""Atomic training checkpoints: written whole or not at all, verified before use.

A checkpoint is a folder ``<run>/checkpoints/step-<updates>`` holding

* ``model.safetensors``: the policy's parameters and buffers (shared tensors, such as
  tied embeddings, are stored once);
* ``optimizer.pt``: the optimizer's ``state_dict`` (loaded with ``weights_only=True``);
* ``rng.pt``: the torch CPU (and CUDA, when present) generator states;
* ``state.json``: updates, data position, the Python and numpy generator states and
  any extra JSON the caller adds;
* ``records.jsonl``: the run's record history up to this checkpoint;
* ``manifest.json``: size and SHA-256 of every other file. It is written last, so a
  folder without a manifest, or whose files disagree with it, is not a checkpoint.

Writing goes to a temporary folder in the same parent; every file and the folder are
fsynced, then one ``rename`` publishes it and the parent is fsynced. Until then the
previous checkpoint is untouched; older ones are pruned only after the new one is in
place, keeping the newest ``keep``. A process killed mid-write leaves a ``.tmp-*``
folder that the next save or load removes.

Verification refuses a checkpoint with :class:`CheckpointError` naming the file at
fault; :func:`latest` walks back to the newest checkpoint that verifies. A save that
runs out of space removes its temporary folder and raises :class:`DiskFull` (a
``CheckpointError``) saying how much room a run needs: ``keep + 1`` checkpoints at once,
since a new one is whole before the oldest is pruned.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "Checkpoints",
    "DiskFull",
    "LocalCheckpoints",
    "checkpoints",
    "fsync_dir",
    "fsync_file",
    "latest",
    "load",
    "prune",
    "resume_path",
    "rng_json",
    "save",
    "set_aside_newer",
    "set_rng_json",
    "sha256",
    "step_name",
    "step_of",
]

logger = logging.getLogger("dew.train")

_NAME = re.compile(r"^step-(\d+)$")
_FILES = ("model.safetensors", "optimizer.pt", "rng.pt", "state.json", "records.jsonl")
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint folder is missing, truncated or corrupt; the message names the file."""


class DiskFull(CheckpointError):
    """A checkpoint could not be written for want of space (its partial folder removed)."""


# The errnos of a write refused for want of space (the disk, or the user's quota).
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)

# torch's zip writer reports a short write as a RuntimeError that carries no errno; a
# disk with less than this left after such an error counts as full.
_NEARLY_FULL = 1 << 20


def is_disk_full(exc: BaseException, folder: Path) -> bool:
    """Whether ``exc``, raised while writing under ``folder``, means the disk is full."""
    if isinstance(exc, OSError) and exc.errno in NO_SPACE:
        return True
    if isinstance(exc, RuntimeError | OSError):
        try:
            return shutil.disk_usage(folder).free < _NEARLY_FULL
        except OSError:
            return False
    return False


def disk_full(folder: Path, writing: Path, keep: int) -> DiskFull:
    """The error for a checkpoint ``writing`` that did not fit (after its removal)."""
    free = shutil.disk_usage(folder).free
    sizes = [_bytes(p) for p in checkpoints(folder)]
    each = f", each about {_mib(sizes[-1])}" if sizes else ""
    return DiskFull(
        f"{writing}: no space left on the device ({_mib(free)} free in {folder}). A run "
        f"needs room for keep + 1 = {keep + 1} checkpoints at once{each} (keep={keep}: a "
        "new one is whole before the oldest is removed): free some (older checkpoints can "
        "go) or lower keep, then resume"
    )


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


@dataclass(frozen=True)
class Checkpoint:
    """What a verified checkpoint restores besides the model and optimizer."""

    path: Path
    updates: int
    position: int
    records: list[dict[str, Any]]
    extra: dict[str, Any]


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def rng_json() -> dict[str, Any]:
    version, state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(state), gauss],
        "numpy": [kind, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)],
    }


def set_rng_json(rng: Mapping[str, Any]) -> None:
    version, state, gauss = rng["python"]
    random.setstate((version, tuple(state), gauss))
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def step_name(updates: int) -> str:
    """The folder name of the checkpoint taken after ``updates`` updates."""
    return f"step-{updates:08d}"


def step_of(path: str | os.PathLike[str]) -> int | None:
    """The updates of a checkpoint folder named as :func:`step_name` names it, else None.

    The one parser of checkpoint names: any number of digits is read, so folders
    written with other zero padding still sort by their updates.
    """
    m = _NAME.match(Path(path).name)
    return None if m is None else int(m.group(1))


def checkpoints(folder: Path) -> list[Path]:
    """Published checkpoint folders under ``folder``, oldest first (unverified)."""
    if not folder.is_dir():
        return []
    found = [(n, p) for p in folder.iterdir() if (n := step_of(p)) is not None]
    return [p for _, p in sorted(found)]


def _clean_temporaries(folder: Path) -> None:
    for p in folder.glob(".tmp-*"):
        shutil.rmtree(p, ignore_errors=True)


def save(
    folder: Path,
    *,
    model: Any,
    optimizer: Any,
    updates: int,
    position: int,
    records: Sequence[Mapping[str, Any]],
    extra: Mapping[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step-<updates>`` under ``folder`` atomically; returns its path."""
    import torch
    from safetensors.torch import save_model

    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1")
    folder.mkdir(parents=True, exist_ok=True)
    _clean_temporaries(folder)
    final = folder / step_name(updates)
    tmp = folder / f".tmp-{final.name}-{os.getpid()}"
    tmp.mkdir()
    try:
        save_model(model, str(tmp / "model.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, tmp / "rng.pt")
        state = {
            "updates": updates,
            "position": position,
            "rng": rng_json(),
            "extra": dict(extra or {}),
        }
        (tmp / "state.json").write_text(json.dumps(state))
        with open(tmp / "records.jsonl", "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        manifest = {}
        for name in _FILES:
            fsync_file(tmp / name)
            manifest[name] = {"bytes": (tmp / name).stat().st_size, "sha256": sha256(tmp / name)}
        with open(tmp / MANIFEST, "w") as f:
            json.dump({"files": manifest}, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        if final.exists():  # a re-save of the same step (e.g. after a resume): replace it
            old = folder / f".tmp-old-{final.name}-{os.getpid()}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
        fsync_dir(folder)
    except BaseException as exc:
        full = is_disk_full(exc, folder)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise disk_full(folder, tmp.with_name(final.name), keep) from exc
        raise
    prune(folder, final, keep)
    return final


def _looks_complete(path: Path) -> bool:
    """A cheap check (no hashing): the manifest is there and every file it lists has the
    size it says."""
    try:
        files = manifest_files(path)
        return all((path / n).stat().st_size == f["bytes"] for n, f in files.items())
    except (CheckpointError, OSError, KeyError, TypeError):
        return False


def prune(folder: Path, newest: Path, keep: int) -> None:
    """After ``newest`` was published: keep it and the ``keep - 1`` latest complete
    checkpoints before it; remove the other older ones.

    Only complete-looking checkpoints count toward ``keep``, so a corrupt folder never
    pushes out a good one, and ``newest`` is never removed. Checkpoints numbered after
    ``newest`` (another history's) are left for :func:`latest` to judge.
    """
    step = step_of(newest)
    older = [p for p in checkpoints(folder) if (step_of(p) or 0) < (step or 0)]
    kept = 1
    for path in reversed(older):
        if kept < keep and _looks_complete(path):
            kept += 1
            continue
        shutil.rmtree(path, ignore_errors=True)


def manifest_files(path: Path) -> dict[str, Any]:
    """The files ``path``'s manifest lists (name -> bytes and sha256); CheckpointError when
    the manifest is missing or unreadable."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{manifest_path}: missing; the checkpoint was never completed")
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({exc})") from exc
    return dict(files)


def file_problem(path: Path, name: str, entry: Mapping[str, Any]) -> str:
    """What is wrong with file ``name`` of ``path`` against its manifest ``entry``, or ''."""
    file = path / name
    if not file.is_file():
        return f"{file}: missing"
    size = file.stat().st_size
    if size != entry["bytes"]:
        return f"{file}: {size} bytes, the manifest says {entry['bytes']} (truncated?)"
    if sha256(file) != entry["sha256"]:
        return f"{file}: contents do not match the manifest's SHA-256"
    return ""


def verify(path: Path) -> None:
    """Raise :class:`CheckpointError` unless every file of ``path`` matches its manifest."""
    files = manifest_files(path)
    for name in _FILES:
        if name not in files:
            raise CheckpointError(f"{path / MANIFEST}: does not list {name}")
        if problem := file_problem(path, name, files[name]):
            raise CheckpointError(problem)


def load(path: Path, *, model: Any, optimizer: Any) -> Checkpoint:
    """Verify ``path`` and restore model, optimizer and every RNG; returns the rest."""
    import torch
    from safetensors.torch import load_model

    path = Path(path)
    verify(path)
    try:
        state = json.loads((path / "state.json").read_text())
        records = [json.loads(line) for line in (path / "records.jsonl").read_text().splitlines()]
        rng = torch.load(path / "rng.pt", weights_only=True)
        opt_state = torch.load(path / "optimizer.pt", weights_only=True)
    except (ValueError, RuntimeError, OSError) as exc:
        raise CheckpointError(f"{path}: unreadable despite a matching manifest ({exc})") from exc
    load_model(model, str(path / "model.safetensors"))
    optimizer.load_state_dict(opt_state)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    set_rng_json(state["rng"])
    return Checkpoint(
        path=path,
        updates=int(state["updates"]),
        position=int(state["position"]),
        records=records,
        extra=dict(state.get("extra", {})),
    )


def latest(folder: Path) -> Path | None:
    """The newest checkpoint under ``folder`` that verifies; refused ones are logged."""
    if folder.is_dir():
        _clean_temporaries(folder)
    for path in reversed(checkpoints(folder)):
        try:
            verify(path)
        except CheckpointError as exc:
            logger.error("refusing checkpoint %s: %s; trying the previous one", path, exc)
            continue
        return path
    return None


class Checkpoints(Protocol):
    """How a trainer saves, finds and restores its checkpoints: one process's own
    (:class:`LocalCheckpoints`) or a pool's shards (``dew.pool.ShardedCheckpoints``).
    ``fit`` picks one when it starts and goes through it alone."""

    sharded: bool  # each checkpoint is written by several processes

    def latest(self, folder: Path) -> Path | None: ...

    def load(self, path: Path, *, model: Any, optimizer: Any) -> Checkpoint: ...

    def save(self, folder: Path, **state: Any) -> Path:
        """Write checkpoint ``step-<updates>``; ``state`` as :func:`save` takes it (model,
        optimizer, updates, position, records, extra, keep)."""
        ...


class LocalCheckpoints:
    """The checkpoints of a single process: this module's :func:`save`, :func:`load`
    and :func:`latest`."""

    sharded = False

    def latest(self, folder: Path) -> Path | None:
        return latest(folder)

    def load(self, path: Path, *, model: Any, optimizer: Any) -> Checkpoint:
        return load(path, model=model, optimizer=optimizer)

    def save(self, folder: Path, **state: Any) -> Path:
        return save(folder, **state)


def resume_path(
    run_dir: Path | None, resume: bool | str | os.PathLike[str], store: Checkpoints
) -> Path | None:
    """Which checkpoint a trainer restores: None for a fresh start. ``resume`` is False,
    True (the newest valid one of ``run_dir``, or None when nothing was saved yet) or a
    run folder or checkpoint folder; CheckpointError when it names nothing valid."""
    if resume is False:
        return None
    if resume is True:
        if run_dir is None:
            raise ValueError("resume=True needs run_dir (where the checkpoints are)")
        found = store.latest(run_dir / "checkpoints")
        if found is None and checkpoints(run_dir / "checkpoints"):
            raise CheckpointError(_nothing_valid(run_dir / "checkpoints", store.sharded))
        return found  # None: nothing saved yet, start fresh
    path = Path(resume)
    if not path.exists():
        raise CheckpointError(f"resume={str(path)!r}: no such run or checkpoint folder")
    if (path / "checkpoints").is_dir():  # a run folder
        found = store.latest(path / "checkpoints")
        if found is None:
            raise CheckpointError(_nothing_valid(path / "checkpoints", store.sharded))
        return found
    if not (path / MANIFEST).exists() and step_of(path) is None:
        raise CheckpointError(
            f"resume={str(path)!r}: holds no checkpoints/ folder and is not a checkpoint; "
            "nothing to resume (start a new run without resume to begin again)"
        )
    return path  # a checkpoint folder: verified (strictly) by load


def _nothing_valid(folder: Path, sharded: bool) -> str:
    """Why a resume from ``folder`` is refused: each checkpoint and what is wrong with it
    (a pool's sharded ones: their names; every process logged why)."""
    found = checkpoints(folder)
    if not found:
        return f"{folder}: no checkpoint to resume (the folder is empty)"
    reasons = []
    for path in found:
        if sharded:
            reasons.append(f"{path.name} (the log says why)")
            continue
        try:
            verify(path)
        except CheckpointError as exc:
            reasons.append(str(exc))
    return (
        f"{folder}: no valid checkpoint to resume; refused: " + "; ".join(reasons) + " "
        "(nothing was changed; start a new run to begin again)"
    )


def set_aside_newer(folder: Path, updates: int) -> None:
    """Rename the checkpoints of ``folder`` newer than ``updates`` so pruning never keeps
    them (a resume from an older checkpoint of the same run)."""
    for path in checkpoints(folder):
        step = step_of(path)
        if step is not None and step > updates:
            path.rename(path.with_name(f"refused-{path.name}-{int(time.time())}"))
