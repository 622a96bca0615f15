"""Sharded checkpoints of a pool: ``torch.distributed.checkpoint`` shards, valid only whole.

A checkpoint is one folder ``<run>/checkpoints/step-<updates>`` on a filesystem every
process of the pool sees, holding

* the model's and optimizer's shards as torch's distributed checkpoint writes them
  (one ``__<rank>_*.distcp`` file per process and the ``.metadata`` file), so it can
  be loaded by a pool of another size along the data axis, and by
  ``torch.distributed.checkpoint`` itself;
* ``rank<r>/``: process ``r``'s own part: ``state.json`` (updates, data position,
  Python and numpy generator states, the caller's extra JSON), ``rng.pt`` (torch's
  generator states) and ``records.jsonl`` (its record history);
* ``manifest.json``: size and SHA-256 of every other file, and the mesh that wrote it.

Invariants:

* Written whole or not at all: every process writes into one temporary folder, fsyncs
  its files and hashes them; only when every process has reported its files does rank
  0 write the manifest and publish the folder with one ``rename``. A folder without a
  manifest, or with a file missing or differing from it, is not a checkpoint.
* Every step is a pool round or a collective every process makes, so a process that
  fails or dies while saving makes every process raise :class:`~dew.pool.PoolError`
  naming it, and the previous checkpoint stays untouched.
* Verification is shared: each process checks its slice of the manifest's files and
  the pool agrees, so a checkpoint is accepted or refused by all processes together.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from dew._checkpoint import (
    MANIFEST,
    Checkpoint,
    CheckpointError,
    checkpoints,
    file_problem,
    fsync_dir,
    fsync_file,
    manifest_files,
    prune,
    rng_json,
    set_rng_json,
    sha256,
    step_name,
)
from dew.pool._pool import Pool, PoolError

__all__ = ["ShardedCheckpoints", "latest", "load", "save", "verify"]

_OWN = ("state.json", "rng.pt", "records.jsonl")


def _round(pool: Pool, tag: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Exchange JSON payloads; PoolError on every process if any payload has an error."""
    got = [json.loads(p) for p in pool.exchange(tag, json.dumps(payload))]
    failed = {r: p["error"] for r, p in enumerate(got) if p.get("error")}
    if failed:
        raise PoolError(
            f"rank {pool.rank}: {tag} failed on "
            + "; ".join(f"rank {r} of {pool.world}: {e}" for r, e in failed.items()),
            sorted(failed),
            failed,
        )
    return got


def _file_entry(path: Path) -> dict[str, Any]:
    fsync_file(path)
    return {"bytes": path.stat().st_size, "sha256": sha256(path)}


def save(
    folder: Path,
    *,
    model: Any,
    optimizer: Any,
    pool: Pool,
    updates: int,
    position: int,
    records: list[dict[str, Any]],
    extra: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step-<updates>`` of the whole pool; every process calls it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1")
    final = folder / step_name(updates)
    tmp = folder / f".tmp-{final.name}"
    error = ""
    if pool.rank == 0:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for stale in folder.glob(".tmp-*"):  # a save some earlier run never finished
                shutil.rmtree(stale)
            tmp.mkdir()
        except OSError as exc:
            error = f"cannot make {tmp}: {exc}"
    _round(pool, "checkpoint-open", {"error": error})

    model_state, optim_state = get_state_dict(model, optimizer)
    with pool.collective("checkpoint save"):
        dcp.save(
            {"model": model_state, "optimizer": optim_state},
            storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
        )
    files: dict[str, Any] = {}
    try:
        own = tmp / f"rank{pool.rank}"
        own.mkdir()
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, own / "rng.pt")
        state = {
            "updates": updates,
            "position": position,
            "rng": rng_json(),
            "extra": dict(extra or {}),
        }
        (own / "state.json").write_text(json.dumps(state))
        with open(own / "records.jsonl", "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        mine = [own / name for name in _OWN] + sorted(tmp.glob(f"__{pool.rank}_*.distcp"))
        files = {str(p.relative_to(tmp)): _file_entry(p) for p in mine}
        fsync_dir(own)
    except OSError as exc:
        error = f"cannot write its part of {tmp}: {exc}"
    reports = _round(pool, "checkpoint-written", {"files": files, "error": error})

    if pool.rank == 0:
        try:
            manifest: dict[str, Any] = {}
            for report in reports:
                manifest.update(report["files"])
            for path in sorted(tmp.rglob("*")):  # what no process claimed: .metadata
                name = str(path.relative_to(tmp))
                if path.is_file() and name not in manifest:
                    manifest[name] = _file_entry(path)
            mesh = {"world": pool.world, "data": pool.data, "tensor": pool.tensor}
            with open(tmp / MANIFEST, "w") as f:
                json.dump({"files": manifest, "mesh": mesh, "updates": updates}, f)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            if final.exists():  # a re-save of the same step (after a resume): replace it
                old = folder / f".tmp-old-{final.name}"
                final.rename(old)
                tmp.rename(final)
                shutil.rmtree(old)
            else:
                tmp.rename(final)
            fsync_dir(folder)
            prune(folder, final, keep)
        except OSError as exc:
            error = f"cannot publish {final}: {exc}"
    _round(pool, "checkpoint-published", {"error": error})
    return final


def verify(path: Path, pool: Pool) -> None:
    """Raise CheckpointError on every process unless all of ``path`` matches its manifest.

    Each process hashes its own slice of the files; the pool agrees on the verdict.
    """
    problem = ""
    try:
        files = manifest_files(path)
    except CheckpointError as exc:
        problem = str(exc)
    else:
        if not any(name.startswith("rank0/") for name in files):
            problem = f"{path / MANIFEST}: lists no rank0/ state"
        for name in sorted(files)[pool.rank :: pool.world]:  # this process's slice
            problem = problem or file_problem(path, name, files[name])
    verdicts = [json.loads(p) for p in pool.exchange("checkpoint-verify", json.dumps(problem))]
    found = [v for v in verdicts if v]
    if found:
        raise CheckpointError(found[0])


def latest(folder: Path, pool: Pool) -> Path | None:
    """The newest checkpoint under ``folder`` that verifies, agreed by the whole pool.

    Refused ones are skipped. Raises PoolError when the processes see different
    checkpoints (``folder`` is not on a filesystem they all share).
    """
    import logging

    found = [p.name for p in checkpoints(folder)]
    views = [json.loads(p) for p in pool.exchange("checkpoint-list", json.dumps(found))]
    odd = [r for r, v in enumerate(views) if v != views[0]]
    if odd:
        causes = {r: f"sees checkpoints {views[r]}" for r in odd}
        raise PoolError(
            f"rank {pool.rank}: the processes see different checkpoints in {folder} (rank 0: "
            f"{views[0]}; " + "; ".join(f"rank {r}: {views[r]}" for r in odd) + "): the run "
            "folder must be on a filesystem every process shares",
            odd,
            causes,
        )
    for name in reversed(found):
        path = folder / name
        try:
            verify(path, pool)
        except CheckpointError as exc:
            logging.getLogger("dew.train").error(
                "refusing checkpoint %s: %s; trying the previous one", path, exc
            )
            continue
        return path
    return None


def load(path: Path, *, model: Any, optimizer: Any, pool: Pool) -> Checkpoint:
    """Verify ``path`` and restore the model's and optimizer's shards, this process's RNG,
    position and records; every process calls it.

    The pool may have another number of processes along the data axis than the one
    that wrote ``path``: torch's distributed checkpoint reshards model and optimizer.
    A process whose rank did not write the checkpoint takes rank 0's updates, data
    position (the same on every process) and random state, and starts its record
    history empty.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    verify(path, pool)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    with pool.collective("checkpoint load"):
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
    own = path / f"rank{pool.rank}"
    wrote = own.is_dir()
    if not wrote:
        own = path / "rank0"
    try:
        saved = json.loads((own / "state.json").read_text())
        lines = (own / "records.jsonl").read_text().splitlines() if wrote else []
        records = [json.loads(line) for line in lines]
        rng = torch.load(own / "rng.pt", weights_only=True)
    except (ValueError, RuntimeError, OSError) as exc:
        raise CheckpointError(f"{own}: unreadable despite a matching manifest ({exc})") from exc
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    set_rng_json(saved["rng"])
    return Checkpoint(
        path=path,
        updates=int(saved["updates"]),
        position=int(saved["position"]),
        records=records,
        extra=dict(saved.get("extra", {})),
    )


class ShardedCheckpoints:
    """The checkpoints of a pool: :func:`save`, :func:`load` and :func:`latest` over
    ``pool`` (every process calls each method together); the pool's side of
    :class:`dew._checkpoint.Checkpoints`."""

    sharded = True

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def latest(self, folder: Path) -> Path | None:
        return latest(folder, self.pool)

    def load(self, path: Path, *, model: Any, optimizer: Any) -> Checkpoint:
        return load(path, model=model, optimizer=optimizer, pool=self.pool)

    def save(self, folder: Path, **state: Any) -> Path:
        return save(folder, pool=self.pool, **state)
