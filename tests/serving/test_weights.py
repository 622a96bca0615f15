"""Weights files (round trip, atomicity, refusals) and the broadcast group, across processes."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dew.demo.model import make_model
from dew.serving import RolloutServer
from dew.serving.weights import (
    BroadcastGroup,
    WeightsError,
    join_group,
    open_weights,
    read_weights,
    tensor_specs,
    weights_path,
    write_weights,
)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(4, 3, generator=g),
        "b.bias": torch.randn(5, generator=g).to(torch.bfloat16),
        "c.count": torch.tensor(7, dtype=torch.int64),
        "d.empty": torch.zeros(0, 2),
    }


@pytest.mark.timeout(60)
def test_round_trip(tmp_path: Path) -> None:
    state = _state()
    path = write_weights(state, tmp_path, 3)
    assert path == weights_path(tmp_path, 3) == tmp_path / "weights-v3.safetensors"
    got, version = read_weights(path)
    assert version == 3
    assert set(got) == set(state)
    for name, t in state.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left


@pytest.mark.timeout(60)
def test_overwrite_is_atomic_no_partial_file_visible(tmp_path: Path) -> None:
    """A reader polling the path while it is rewritten sees the old or the new file, whole."""
    big = {"w": torch.randn(512, 1024)}  # 2 MiB: long enough to be caught mid-write
    write_weights(big, tmp_path, 1)
    path = weights_path(tmp_path, 1)
    stop = threading.Event()
    seen: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            try:
                _, v = read_weights(path)
                seen.append(f"ok{v}")
            except WeightsError as exc:
                seen.append(f"bad: {exc}")

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(20):
            write_weights({"w": big["w"] + i}, tmp_path, 1)
    finally:
        stop.set()
        thread.join()
    assert seen and all(s == "ok1" for s in seen), [s for s in seen if s != "ok1"][:3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


@pytest.mark.timeout(60)
def test_failed_write_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must be a tensor"):
        write_weights({"a": torch.zeros(2), "b": "not a tensor"}, tmp_path, 1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_truncated_file_refused(tmp_path: Path) -> None:
    path = write_weights(_state(), tmp_path, 2)
    data = path.read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 20, 4, 0):
        path.write_bytes(data[:cut])
        with pytest.raises(WeightsError, match=r"truncated|corrupt") as info:
            read_weights(path)
        assert str(path) in str(info.value)


@pytest.mark.timeout(60)
def test_one_flipped_byte_refused(tmp_path: Path) -> None:
    path = write_weights(_state(), tmp_path, 2)
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    for at in (8 + n, len(data) - 1, 8 + n + 17):  # tensor bytes: first, last, inside
        flipped = bytearray(data)
        flipped[at] ^= 0x01
        path.write_bytes(bytes(flipped))
        with pytest.raises(WeightsError, match="checksum mismatch") as info:
            read_weights(path)
        assert str(path) in str(info.value)
    header = bytearray(data)
    header[8] ^= 0xFF  # the header's first byte: no longer JSON
    path.write_bytes(bytes(header))
    with pytest.raises(WeightsError, match="header is not JSON"):
        read_weights(path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("metadata", "problem"),
    [
        (None, "no dew_version"),
        ({"dew_sha256": "00"}, "no dew_version"),
        ({"dew_version": "seven", "dew_sha256": "00"}, "not an integer"),
        ({"dew_version": "-1", "dew_sha256": "00"}, "not an integer"),
        ({"dew_version": "4"}, "no dew_sha256"),
        ({"dew_version": "4", "dew_sha256": "abc"}, "checksum mismatch"),
    ],
)
def test_bad_metadata_refused(
    tmp_path: Path, metadata: dict[str, str] | None, problem: str
) -> None:
    path = tmp_path / "w.safetensors"
    save_file({"x": torch.ones(3)}, str(path), metadata=metadata)
    with pytest.raises(WeightsError, match=problem):
        read_weights(path)


@pytest.mark.timeout(60)
def test_a_file_named_by_others_is_read_only_if_it_is_a_small_regular_file_under_root(
    tmp_path: Path,
) -> None:
    root = tmp_path / "weights"
    good = write_weights(_state(), root, 3)
    assert open_weights(good, root=root, max_bytes=good.stat().st_size).version == 3
    secret = tmp_path / "secret"
    secret.write_bytes(b"root:*:20000:0:99999:7:::\n" * 10)
    (root / "link").symlink_to(secret)
    fifo = root / "fifo"
    os.mkfifo(fifo)
    outside = [secret, tmp_path / "missing", tmp_path, root / "link", root / ".." / "secret"]
    outside += [Path("/etc/shadow"), Path("/proc/self/environ"), Path("/dev/zero")]
    for path in outside:  # one answer, whether or not the path exists
        with pytest.raises(WeightsError, match=f"weights are read only from {root}$"):
            open_weights(path, root=root)
    with pytest.raises(WeightsError, match="not a regular file"):  # at once: no writer
        open_weights(fifo, root=root)
    with pytest.raises(WeightsError, match="not a regular file"):
        open_weights("/dev/zero")
    with pytest.raises(WeightsError, match="more than the 100 a push may hold"):
        open_weights(good, root=root, max_bytes=100)
    # A file that is not a weights file: the refusal quotes none of its bytes.
    inside = root / "notes.safetensors"
    for content in (b"root:*:20000:0:99999:7:::\n" * 10, b"\x10\0\0\0\0\0\0\0\xffroot:*:2000"):
        inside.write_bytes(content)
        with pytest.raises(WeightsError) as info:
            open_weights(inside, root=root)
        message = str(info.value).removeprefix(str(inside))
        assert "root" not in message and "2000" not in message and "\\x" not in message, message


@pytest.mark.timeout(60)
def test_missing_file_refused(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="no such file") as info:
        read_weights(tmp_path / "nope.safetensors")
    assert isinstance(info.value, ValueError)


@pytest.mark.timeout(60)
def test_tied_weights_written_once_and_load_into_an_engine(tmp_path: Path) -> None:
    model = make_model("qwen2", "tiny", seed=4)
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    path = write_weights(model, tmp_path, 9)
    got, version = read_weights(path)
    assert version == 9
    assert len(got) == len(state) - 1  # the tied duplicate is left out
    kept = "model.embed_tokens.weight" if "model.embed_tokens.weight" in got else "lm_head.weight"
    assert torch.equal(got[kept], state[kept])
    # an engine serving another model takes the file, ties included
    with RolloutServer(make_model("qwen2", "tiny", seed=5)) as engine:
        engine.load(got, version)
        assert engine.version == 9
    names, dtypes, shapes = tensor_specs(model)
    assert sorted(names) == sorted(got)
    assert dtypes == ["float32"] * len(names)
    assert shapes[names.index(kept)] == list(state[kept].shape)


@pytest.mark.timeout(60)
def test_views_of_one_storage_are_saved_apart(tmp_path: Path) -> None:
    base = torch.arange(12.0)
    state = {"first": base[:6], "second": base[6:].view(2, 3), "same": base}
    got, _ = read_weights(write_weights(state, tmp_path, 0))
    for name, t in state.items():
        assert torch.equal(got[name], t)


_RECEIVER = """
import json, sys, torch
from dew.serving.weights import join_group, receive_tensors
port, specs = int(sys.argv[1]), json.loads(sys.argv[2])
joined = join_group("127.0.0.1", port, 1, 2, backend="gloo", group_name="t", timeout=60)
got = receive_tensors(joined, specs["names"], specs["dtypes"], specs["shapes"])
print(json.dumps({k: v.double().flatten().tolist() for k, v in got.items()}))
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(120)
def test_broadcast_between_processes(tmp_path: Path) -> None:
    state = {"w": torch.randn(3, 4), "tied": torch.arange(5.0), "half": torch.ones(2).half()}
    state["alias"] = state["tied"]
    names, dtypes, shapes = tensor_specs(state)
    assert names == ["w", "tied", "half"] and dtypes == ["float32", "float32", "float16"]
    port = _free_port()
    specs = json.dumps({"names": names, "dtypes": dtypes, "shapes": shapes})
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _RECEIVER, str(port), specs],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        group = BroadcastGroup("127.0.0.1", port, 2, group_name="t", timeout=60)
        group.broadcast(state)
        group.close()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    got = json.loads(out.strip().splitlines()[-1])
    for name in names:
        assert got[name] == state[name].double().flatten().tolist()


@pytest.mark.timeout(120)
def test_a_finished_broadcast_holds_no_reference_to_its_tensor() -> None:
    # gloo's worker thread lets go of a tensor a moment after wait() returns; a process
    # that exits in that moment aborts (SIGABRT), as a receiver printing its last tensor
    # did in CI. So each broadcast returns only once gloo let go. Without that wait,
    # about a third of these 200 come back still held, on either end.
    from dew.serving import weights

    port = _free_port()
    held: dict[str, list[int]] = {"sent": [], "received": []}
    failed: list[BaseException] = []

    def receive() -> None:
        try:
            joined = join_group("127.0.0.1", port, 1, 2, group_name="r", timeout=60)
            for _ in range(200):
                t = torch.empty(3)
                weights._broadcast(joined.group, [t])
                held["received"].append(t._use_count())
        except BaseException as exc:  # re-raised below, on the test's thread
            failed.append(exc)

    receiver = threading.Thread(target=receive)
    receiver.start()
    try:
        group = BroadcastGroup("127.0.0.1", port, 2, group_name="r", timeout=60)
        for i in range(200):
            t = torch.full((3,), float(i))
            weights._broadcast(group._group, [t])
            held["sent"].append(t._use_count())
        group.close()
    finally:
        receiver.join(timeout=90)
    assert not receiver.is_alive() and not failed, failed
    assert held == {"sent": [1] * 200, "received": [1] * 200}


def test_buckets_hold_copies_up_to_the_budget_and_skip_what_needs_none() -> None:
    from dew.serving.weights import _buckets

    # [8, 4] float32 transposed: not contiguous, so each costs a 128-byte copy
    copies = [torch.arange(32.0).reshape(8, 4).t() + i for i in range(5)]
    plain = torch.ones(1000)  # contiguous on the device already: sent as it is, free
    tensors = [copies[0], plain, copies[1], copies[2], copies[3], copies[4]]
    out = list(_buckets(tensors, "cpu", 256))
    assert [len(b) for b in out] == [3, 2, 1]  # 256 bytes of copies close a bucket
    sent = [t for b in out for t in b]
    assert sent[1] is plain and all(t.is_contiguous() for t in sent)
    assert all(torch.equal(a, b) for a, b in zip(sent, tensors, strict=True))
    # a tensor past the budget on its own is a bucket of its own
    assert [len(b) for b in _buckets(copies[:3], "cpu", 1)] == [1, 1, 1]
    with pytest.raises(ValueError, match="bucket_bytes=0 must be >= 1"):
        BroadcastGroup("127.0.0.1", 1, 2, bucket_bytes=0)
    with pytest.raises(ValueError, match="bucket_bytes must be an int, got True"):
        BroadcastGroup("127.0.0.1", 1, 2, bucket_bytes=True)


@pytest.mark.timeout(120)
def test_a_broadcast_copies_one_bucket_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # A state that needs copies (here: non-contiguous tensors; on a GPU: a CPU state over
    # NCCL) is copied and sent bucket_bytes at a time: when a bucket goes out, no copy of
    # an earlier one is alive, so the whole model is never copied at once.
    import weakref

    from dew.serving import weights

    state = {f"w{i}": torch.randn(8, 4).t() for i in range(6)}  # 128 bytes to copy each
    names, dtypes, shapes = tensor_specs(state)
    sent: list[int] = []
    alive: list[int] = []
    earlier: list[weakref.ref[torch.Tensor]] = []
    real = weights._broadcast
    sender = threading.get_ident()

    def spy(group: object, tensors: list[torch.Tensor]) -> None:
        if threading.get_ident() == sender:
            alive.append(sum(r() is not None for r in earlier))
            sent.append(len(tensors))
            earlier.extend(weakref.ref(t) for t in tensors)
        real(group, tensors)

    # and when a copy is made, none of a bucket already sent is alive either
    at_copy: list[int] = []
    unique = weights._unique

    class Watched(dict[str, torch.Tensor]):
        def values(self) -> Iterator[torch.Tensor]:  # type: ignore[override]
            for t in super().values():
                at_copy.append(sum(r() is not None for r in earlier))
                yield t

    monkeypatch.setattr(weights, "_broadcast", spy)
    monkeypatch.setattr(weights, "_unique", lambda state: Watched(unique(state)))
    port = _free_port()
    got: dict[str, torch.Tensor] = {}
    failed: list[BaseException] = []

    def receive() -> None:
        try:
            joined = join_group("127.0.0.1", port, 1, 2, group_name="b", timeout=60)
            got.update(weights.receive_tensors(joined, names, dtypes, shapes))
        except BaseException as exc:  # re-raised below, on the test's thread
            failed.append(exc)

    receiver = threading.Thread(target=receive)
    receiver.start()
    try:
        group = BroadcastGroup("127.0.0.1", port, 2, group_name="b", timeout=60, bucket_bytes=256)
        assert group.bucket_bytes == 256
        group.broadcast(state)
        group.close()
    finally:
        receiver.join(timeout=90)
    assert not receiver.is_alive() and not failed, failed
    assert sent == [2, 2, 2] and alive == [0, 0, 0] and at_copy == [0] * 6
    assert all(torch.equal(got[n], state[n]) for n in names)
