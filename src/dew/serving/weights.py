"""Weight transfer to engine processes: safetensors files and a broadcast group.

Two paths carry the trainer's state dict to every engine under a version number:

* **Files** (the path that works across machines with a shared filesystem, or through
  ``/dev/shm`` on one): :func:`write_weights` writes ``weights-v{version}.safetensors``
  atomically (a temp file in the same folder, fsync, ``os.replace``, fsync of the
  folder), so a reader sees the whole file or none. Its metadata holds ``dew_version``
  (the version, as a decimal string) and ``dew_sha256``: the hex SHA-256 over the
  tensors in sorted name order, each as ``name``, ``dtype`` (e.g. ``float32``) and the
  shape (comma-joined), each followed by a NUL byte, then the tensor's raw bytes.
  :func:`read_weights` checks that the header parses, every tensor reads, the version is
  a non-negative integer and the checksum matches; anything else raises
  :class:`WeightsError` naming the file and the problem. Tensors that share storage
  (tied embeddings) are written once under their first name; an engine's ``load``
  accepts a state dict with the tied duplicate left out.
* **Broadcast** (the path GPU peers use): the trainer opens a
  :class:`BroadcastGroup` as rank 0 of a ``torch.distributed`` group of its own (gloo
  on CPU, NCCL on GPU; the same code), each engine joins it with :func:`join_group` at
  its rank, and :meth:`BroadcastGroup.broadcast` sends the tensors in the order the
  engines were told (:func:`tensor_specs`), which :func:`receive_tensors` receives.
  Tensors that must be copied to reach the backend's device (a CPU state over NCCL)
  are copied and sent ``bucket_bytes`` at a time, never the whole model at once.
  The group is built from public ``torch.distributed`` pieces (a ``TCPStore`` and the
  backend's process group class) and never touches the default group, so a trainer
  already inside a ``torchrun`` group keeps it, and an engine process stays free of one.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import stat
import struct
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dew.core import as_int

if TYPE_CHECKING:
    import torch

__all__ = [
    "BroadcastGroup",
    "WeightsError",
    "WeightsFile",
    "checksum",
    "join_group",
    "open_weights",
    "read_weights",
    "receive_tensors",
    "tensor_specs",
    "weights_path",
    "write_weights",
]

_HEADER_LIMIT = 100 << 20  # safetensors' own bound on the JSON header


class WeightsError(ValueError):
    """A weights file (or a broadcast) that cannot be served: names the file and why."""


def weights_path(folder: str | os.PathLike[str], version: int) -> Path:
    """Where :func:`write_weights` puts ``version`` in ``folder``."""
    return Path(folder) / f"weights-v{int(version)}.safetensors"


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        shape = ",".join(str(d) for d in t.shape)
        h.update(f"{name}\0{_dtype_name(t)}\0{shape}\0".encode())
        flat = t.detach().contiguous().reshape(-1)
        if flat.numel():
            h.update(memoryview(flat.view(torch.uint8).numpy()))
    return h.hexdigest()


def _state_of(state: Any) -> Mapping[str, torch.Tensor]:
    import torch

    if isinstance(state, torch.nn.Module):
        return state.state_dict()
    if not isinstance(state, Mapping):
        raise ValueError(
            f"state must be an nn.Module or a mapping of tensors, got {type(state).__name__}"
        )
    return state


def _one_per_storage(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors; an exact alias of an earlier tensor is left out, and a
    different view of a storage already used is copied (safetensors refuses shared
    storage)."""
    import torch

    out: dict[str, torch.Tensor] = {}
    aliases: set[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]] = set()
    storages: set[int] = set()
    for name, t in state.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise ValueError(f"state[{name!r}] must be a tensor under a str name")
        t = t.detach()
        if t.numel():
            key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
            if key in aliases:
                continue  # tied: the same tensor under a second name
            aliases.add(key)
            storage = t.untyped_storage().data_ptr()
            shared = storage in storages
            storages.add(storage)
        else:
            shared = False
        t = t.to("cpu")
        out[name] = t.clone() if shared or not t.is_contiguous() else t
    return out


def write_weights(state: Any, folder: str | os.PathLike[str], version: int) -> Path:
    """Write ``state`` (a state dict or module) as ``folder/weights-v{version}.safetensors``
    atomically; returns the path. An existing file of that name is replaced whole."""
    from safetensors.torch import save_file

    version = as_int(version, "version", minimum=0)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = _one_per_storage(_state_of(state))
    metadata = {"dew_version": str(version), "dew_sha256": _checksum(tensors)}
    final = weights_path(folder, version)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{final.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; engines may run as others
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final


def _read_header(path: Path, f: Any, size: int) -> tuple[bytes, dict[str, str]]:
    """The header's bytes (its 8-byte length included) and its metadata, read before
    anything else and checked against the file's ``size``. Messages name the file and
    the problem, never its bytes."""
    if size < 8:
        raise WeightsError(f"{path}: truncated ({size} bytes; no safetensors header)")
    head = f.read(8)
    (n,) = struct.unpack("<Q", head)
    if n > _HEADER_LIMIT or 8 + n > size:
        raise WeightsError(f"{path}: not a safetensors file (its header length does not fit)")
    raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise WeightsError(f"{path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: corrupt header (not a JSON object)")
    try:
        end = max(
            (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
            default=0,
        )
    except (KeyError, TypeError, ValueError, IndexError):
        raise WeightsError(f"{path}: corrupt header (malformed data_offsets)") from None
    if 8 + n + end != size:
        raise WeightsError(f"{path}: truncated ({size} bytes, the header describes {8 + n + end})")
    meta = header.get("__metadata__")
    return head + raw, meta if isinstance(meta, dict) else {}


@dataclass(frozen=True)
class WeightsFile:
    """A checked weights file: its tensors, version and ``dew_sha256`` checksum."""

    tensors: dict[str, torch.Tensor]
    version: int
    checksum: str


def read_weights(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], int]:
    """Read and check a file :func:`write_weights` wrote; returns (tensors, version).

    See :func:`open_weights`, which also returns the checksum.
    """
    w = open_weights(path)
    return w.tensors, w.version


def checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    """The ``dew_sha256`` of ``tensors``, as :func:`write_weights` records it."""
    return _checksum(tensors)


def open_weights(
    path: str | os.PathLike[str],
    *,
    root: str | os.PathLike[str] | None = None,
    max_bytes: int | None = None,
) -> WeightsFile:
    """Read and check a file :func:`write_weights` wrote.

    Raises :class:`WeightsError` when the file is missing, truncated or corrupt, its
    checksum does not match, or it carries no valid version. The file is read once, so
    a writer replacing it meanwhile cannot mix two versions.

    For paths that others name (a server's clients): ``root``, the only folder whose
    files are read (links resolved first; a path outside is refused before it is
    looked at, so the refusal says nothing of what exists there); ``max_bytes``, the
    largest file read. Only regular files are read (a FIFO or a device is refused
    without blocking), the header before anything else, and no message quotes the
    file's bytes.
    """
    from safetensors.torch import load

    path = Path(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
    if root is not None:
        real = Path(os.path.realpath(path))
        if not real.is_relative_to(os.path.realpath(root)):
            raise WeightsError(f"{path}: weights are read only from {root}")
        path, flags = real, flags | getattr(os, "O_NOFOLLOW", 0)  # no link swapped in since
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise WeightsError(f"{path}: no such file") from None
    except OSError as exc:
        raise WeightsError(f"{path}: cannot be read ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise WeightsError(f"{path}: not a regular file")
        size = info.st_size
        if max_bytes is not None and size > max_bytes:
            raise WeightsError(f"{path}: {size} bytes, more than the {max_bytes} a push may hold")
        try:
            head, meta = _read_header(path, f, size)
            raw_version = meta.get("dew_version")
            if raw_version is None:
                raise WeightsError(f"{path}: no dew_version in the metadata")
            if not (raw_version.isascii() and raw_version.isdigit()):
                raise WeightsError(f"{path}: dew_version is not an integer >= 0")
            want = meta.get("dew_sha256")
            if not want:
                raise WeightsError(f"{path}: no dew_sha256 checksum in the metadata")
            data = head + f.read(size - len(head))
        except OSError as exc:
            raise WeightsError(f"{path}: cannot be read ({exc.strerror})") from None
    if len(data) != size:
        raise WeightsError(f"{path}: changed while it was read")
    try:
        tensors = load(data)
    except Exception:
        raise WeightsError(f"{path}: corrupt (its tensors do not read)") from None
    del data
    got = _checksum(tensors)
    if got != want:
        raise WeightsError(f"{path}: checksum mismatch (the data is not what the header says)")
    return WeightsFile(tensors, int(raw_version), got)


# --------------------------------------------------------------------------- broadcast


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))


def _process_group(backend: str, store: Any, rank: int, size: int, timeout: float) -> Any:
    import torch.distributed as dist

    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, _timeout(timeout))
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _timeout(timeout)
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")


def _connect(
    address: str, port: int, rank: int, world_size: int, backend: str, name: str, timeout: float
) -> tuple[Any, Any]:
    import torch.distributed as dist

    if world_size < 2 or not 0 <= rank < world_size:
        raise ValueError(
            f"need world_size >= 2 and 0 <= rank < world_size, got {rank}/{world_size}"
        )
    store = dist.TCPStore(
        address,
        port,
        world_size,
        is_master=rank == 0,
        timeout=_timeout(timeout),
        wait_for_workers=False,
    )
    group = _process_group(
        backend, dist.PrefixStore(f"dew/{name}", store), rank, world_size, timeout
    )
    return store, group


# How long, after its last tensor, a broadcast waits for gloo to let go of them all.
_RELEASE_SECONDS = 1.0


def _broadcast(group: Any, tensors: Sequence[torch.Tensor]) -> None:
    """Broadcast each tensor from rank 0, in order; return once gloo let go of them."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    held = [t._use_count() for t in tensors]
    for t in tensors:
        group.broadcast([t], opts).wait()
    # wait() returns when the data arrived, but gloo's worker thread drops its
    # references to the tensor a moment later. If the process exits in between, that
    # thread needs the GIL to free a tensor Python owned, the finalizing interpreter
    # ends it with pthread_exit, and the C++ runtime aborts the process ("terminate
    # called without an active exception"): a receiver that exits right after its last
    # tensor, or a trainer after its last publish, would die with SIGABRT. The wait is
    # bounded because another thread of the caller may take a reference meanwhile.
    deadline = time.monotonic() + _RELEASE_SECONDS
    for t, count in zip(tensors, held, strict=True):
        while t._use_count() > count and time.monotonic() < deadline:
            time.sleep(0.0001)


def _device_for(backend: str) -> str:
    return "cuda" if backend == "nccl" else "cpu"


# The bytes of copies a trainer's broadcast holds at once (a CPU state sent over NCCL
# is copied to the device tensor by tensor): past this, the copies made so far are
# sent and dropped before more are made, so no copy of the whole model ever exists.
_BUCKET_BYTES = 256 << 20


def _buckets(
    tensors: Iterable[torch.Tensor], device: str, bucket_bytes: int
) -> Iterator[list[torch.Tensor]]:
    """``tensors`` as the backend sends them (on ``device``, contiguous), in order, in
    runs whose copies add up to at least ``bucket_bytes`` (but the last); a tensor that
    needs no copy costs nothing."""
    bucket: list[torch.Tensor] = []
    copied = 0
    for t in tensors:
        bucket.append(t.to(device).contiguous())  # no local name: none outlives its bucket
        if bucket[-1] is not t:
            copied += bucket[-1].numel() * bucket[-1].element_size()
        if copied >= bucket_bytes:
            yield bucket
            bucket, copied = [], 0
    if bucket:
        yield bucket


def tensor_specs(state: Any) -> tuple[list[str], list[str], list[list[int]]]:
    """(names, dtypes, shapes) of ``state``, one entry per storage, in broadcast order:
    the body fields of ``/update_weights_from_distributed``."""
    tensors = _unique(_state_of(state))
    return (
        list(tensors),
        [_dtype_name(t) for t in tensors.values()],
        [list(t.shape) for t in tensors.values()],
    )


def _unique(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    for name, t in state.items():
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = t.detach()
    return out


class BroadcastGroup:
    """The trainer's end of a weight broadcast group: rank 0 of ``world_size`` ranks.

    Hosts the group's ``TCPStore`` on ``port`` of ``address`` (an address of this
    machine the engines reach). The constructor blocks until every engine has joined
    (:func:`join_group`, through ``/init_weights_update_group``), so ask the engines
    to join from another thread, or before, within ``timeout`` seconds.
    ``bucket_bytes`` bounds the copies a broadcast holds at once, where tensors must be
    copied to reach the backend's device (256 MiB by default).
    """

    def __init__(
        self,
        address: str,
        port: int,
        world_size: int,
        *,
        backend: str = "gloo",
        group_name: str = "dew",
        timeout: float = 300.0,
        bucket_bytes: int = _BUCKET_BYTES,
    ) -> None:
        bucket_bytes = as_int(bucket_bytes, "bucket_bytes")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
        self.backend = backend
        self.world_size = world_size
        self.bucket_bytes = bucket_bytes
        self._store, self._group = _connect(
            address, port, 0, world_size, backend, group_name, timeout
        )

    def broadcast(self, state: Any) -> None:
        """Send every tensor of ``state`` (in :func:`tensor_specs` order) to the engines;
        copies to the backend's device are made and dropped ``bucket_bytes`` at a time."""
        device = _device_for(self.backend)
        for bucket in _buckets(_unique(_state_of(state)).values(), device, self.bucket_bytes):
            _broadcast(self._group, bucket)
            del bucket  # before the next is made: at most one bucket of copies lives

    def close(self) -> None:
        """Drop the group; engines that still hold it fail their next receive."""
        self._group = None
        self._store = None


class JoinedGroup:
    """An engine's membership in a trainer's broadcast group (see :func:`join_group`)."""

    def __init__(self, store: Any, group: Any, backend: str, rank: int, world_size: int) -> None:
        self.store = store
        self.group = group
        self.backend = backend
        self.rank = rank
        self.world_size = world_size


def join_group(
    address: str,
    port: int,
    rank: int,
    world_size: int,
    *,
    backend: str = "gloo",
    group_name: str = "dew",
    timeout: float = 300.0,
) -> JoinedGroup:
    """Join the trainer's group (rank 0 at ``address:port``) as ``rank``; blocks until
    every rank has joined."""
    if rank == 0:
        raise ValueError("rank 0 is the trainer's; an engine joins at rank >= 1")
    store, group = _connect(address, port, rank, world_size, backend, group_name, timeout)
    return JoinedGroup(store, group, backend, rank, world_size)


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def receive_tensors(
    joined: JoinedGroup,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
) -> dict[str, torch.Tensor]:
    """Receive one broadcast per tensor from rank 0, in order, into fresh tensors (the
    engine copies them into its model between two iterations, as any load)."""
    import torch

    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}"
        )
    device = _device_for(joined.backend)
    kinds = [_torch_dtype(d) for d in dtypes]
    tensors = [
        torch.empty(tuple(int(d) for d in shape), dtype=dtype, device=device)
        for dtype, shape in zip(kinds, shapes, strict=True)
    ]
    _broadcast(joined.group, tensors)
    return dict(zip(names, tensors, strict=True))
