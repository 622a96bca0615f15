"""The weight-push endpoints of ``dew serve`` (see :mod:`dew.serving.http_server`).

``/update_weights_from_disk`` loads a file :func:`dew.serving.weights.write_weights`
wrote; ``/init_weights_update_group`` and ``/update_weights_from_distributed`` take a
broadcast from a trainer; ``/dew/release`` lets a run's hold go. Pushes run one at a
time under the state's weights lock, the blocking work on a worker thread, and a
refused push leaves the served weights (and the run holding them) as they were.

Which run may push is :mod:`dew.serving._claim`'s rule. A push that begins a new
version sequence (a new run, or a run resumed) is loaded whatever its version, with
the kept prefixes forgotten; one that takes the server from a run still holding it
first aborts every request in flight (they are that run's, and its weights' version
numbers mean nothing to the new one: their clients see an abort).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from dew.serving._claim import ClaimRefused
from dew.serving._http_common import (
    FromDiskBody,
    FromDistributedBody,
    InitGroupBody,
    PushBody,
    ReleaseBody,
    ServeState,
    parse_body,
    refused,
)
from dew.serving.weights import (
    WeightsError,
    checksum,
    join_group,
    open_weights,
    receive_tensors,
)

__all__ = ["from_disk", "from_distributed", "init_group", "release"]


# --------------------------------------------------------------------------- weights


def _check_newer(state: ServeState, version: int, digest: str | None) -> bool:
    """Whether a push of ``version`` (weights ``digest``) must be loaded; refuses a stale one.

    A version newer than the served one loads. The served version again loads only as
    the first push to a fresh server (which serves its initial weights unpublished, so
    a trainer's first push at that number goes through), and is a no-op when it carries
    the very weights already served (a trainer re-publishing after a resume). Anything
    else is refused: an older version, or other weights under the served number.
    """
    served = state.engine.version
    if version > served:
        return True
    if version == served and state.published is None:
        return True
    if version == served and digest is not None and digest == state.published:
        return False
    raise refused(
        f"dew_version {version} is not newer than the served version {served}", "dew_version"
    )


def _new_sequence(state: ServeState, req: PushBody) -> bool:
    """Whether ``req`` begins a new version sequence; 409 when its run may not push."""
    try:
        return state.claim.check(
            req.dew_run, restart=req.dew_restart, takeover=req.dew_takeover, now=time.monotonic()
        )
    except ClaimRefused as exc:
        raise refused(str(exc), "dew_run", 409) from None


def _took(state: ServeState, req: PushBody) -> None:
    """The push of ``req`` went through: its run holds the server now."""
    state.claim.took(req.dew_run, time.monotonic())


async def from_disk(state: ServeState, request: Request) -> Response:
    state.authorize(request)
    req = await parse_body(request, FromDiskBody)
    async with state.weights_lock:
        fresh = _new_sequence(state, req)
        if not fresh and req.dew_version < state.engine.version:  # stale: refuse unread
            _check_newer(state, req.dew_version, None)
        try:
            weights = await asyncio.to_thread(
                open_weights,
                req.model_path,
                root=state.weights_dir,
                max_bytes=state.max_weights_bytes,
            )
        except WeightsError as exc:
            raise refused(str(exc), "model_path") from None
        version = weights.version
        if version != req.dew_version:
            raise refused(
                f"{req.model_path} holds dew_version {version}, the request says {req.dew_version}",
                "dew_version",
            )
        if fresh or _check_newer(state, version, weights.checksum):
            await _load(state, req, weights.tensors, "model_path", restart=fresh)
            state.published = weights.checksum
        _took(state, req)
    return JSONResponse(
        {"success": True, "message": f"serving {req.model_path}", "dew_version": version}
    )


async def _load(
    state: ServeState, req: PushBody, tensors: Mapping[str, Any], param: str, *, restart: bool
) -> None:
    if state.claim.held_by not in (None, req.dew_run):  # a takeover: what runs is theirs
        state.abort_all()
    load = functools.partial(state.engine.load, tensors, req.dew_version, restart=restart)
    try:
        await asyncio.to_thread(load)
    except ValueError as exc:
        raise refused(f"the weights do not fit the model: {exc}", param) from None
    except RuntimeError as exc:
        raise refused(f"the engine is not serving: {exc}", param, 503) from None


async def init_group(state: ServeState, request: Request) -> Response:
    state.authorize(request)
    req = await parse_body(request, InitGroupBody)
    if req.backend not in ("gloo", "nccl"):
        raise refused(f"backend must be 'gloo' or 'nccl', got {req.backend!r}", "backend")
    if req.world_size < 2:
        raise refused(f"world_size must be >= 2, got {req.world_size}", "world_size")
    if not 1 <= req.rank_offset < req.world_size:
        raise refused(
            f"rank_offset must be in [1, world_size), got {req.rank_offset}", "rank_offset"
        )
    if not 0 < req.master_port < 65536:
        raise refused(f"master_port must be a TCP port, got {req.master_port}", "master_port")
    if state.joining:
        raise refused("a group join is already under way; retry once it ended", "group_name", 409)
    state.joining = True
    try:
        # On a thread of its own: a join waits on a peer that may never come, and must
        # not hold a thread that generation or pushes need.
        joined = await asyncio.get_running_loop().run_in_executor(
            state.join_executor,
            functools.partial(
                join_group,
                req.master_address,
                req.master_port,
                req.rank_offset,
                req.world_size,
                backend=req.backend,
                group_name=req.group_name,
                timeout=state.group_timeout,
            ),
        )
    except Exception as exc:  # the peer is gone or never came, or the backend is missing
        message = _first_line(exc)
        raise refused(f"could not join the group: {message}", "master_address") from None
    finally:
        state.joining = False
    state.groups[req.group_name] = joined
    return JSONResponse({"success": True, "message": f"joined {req.group_name!r}"})


async def release(state: ServeState, request: Request) -> Response:
    """``dew_run`` lets the server go: its weights keep serving, and another run may
    push without taking it over."""
    state.authorize(request)
    req = await parse_body(request, ReleaseBody)
    async with state.weights_lock:
        if state.claim.release(req.dew_run):
            return JSONResponse({"success": True, "message": f"released by {req.dew_run!r}"})
    held = state.claim.held_by
    return JSONResponse(
        {"success": False, "message": f"not held by {req.dew_run!r} (held by {held!r})"}
    )


def _first_line(exc: BaseException) -> str:
    """torch.distributed's errors carry C++ backtraces: their first line says it."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _check_specs(state: ServeState, req: FromDistributedBody) -> None:
    if not len(req.names) == len(req.dtypes) == len(req.shapes):
        raise refused(
            f"names, dtypes and shapes differ in length: {len(req.names)}, "
            f"{len(req.dtypes)}, {len(req.shapes)}",
            "names",
        )
    import torch

    for i, d in enumerate(req.dtypes):
        if not isinstance(getattr(torch, d.removeprefix("torch."), None), torch.dtype):
            raise refused(f"dtypes[{i}] = {d!r} is not a torch dtype", "dtypes")
    if state.shapes is None:
        return
    for name, shape in zip(req.names, req.shapes, strict=True):
        want = state.shapes.get(name)
        if want is None:
            raise refused(f"names: {name!r} is not a tensor of the model", "names")
        if tuple(shape) != want:
            raise refused(f"shapes: {name!r} is {tuple(shape)}, the model has {want}", "shapes")


async def from_distributed(state: ServeState, request: Request) -> Response:
    state.authorize(request)
    req = await parse_body(request, FromDistributedBody)
    joined = state.groups.get(req.group_name)
    if joined is None:
        raise refused(f"no weights update group named {req.group_name!r}", "group_name")
    _check_specs(state, req)
    async with state.weights_lock:
        # Strictly newer only: the digest of a broadcast is known only once it arrived,
        # and a refusal after joining would strand the sender (a first publish at the
        # initial version goes by file).
        fresh = _new_sequence(state, req)
        if not fresh and req.dew_version <= state.engine.version:
            raise refused(
                f"dew_version {req.dew_version} is not newer than the served version "
                f"{state.engine.version}",
                "dew_version",
            )
        try:
            tensors = await asyncio.to_thread(
                receive_tensors, joined, req.names, req.dtypes, req.shapes
            )
        except Exception as exc:  # a broken group cannot be trusted again
            state.groups.pop(req.group_name, None)
            raise refused(f"the broadcast failed: {_first_line(exc)}", "group_name") from None
        await _load(state, req, tensors, "names", restart=fresh)
        state.published = await asyncio.to_thread(checksum, tensors)
        _took(state, req)
    return JSONResponse(
        {"success": True, "message": "serving the broadcast", "dew_version": req.dew_version}
    )
