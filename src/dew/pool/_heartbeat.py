"""Tell a hung process from a slow one: a heartbeat per process, watched by every other.

A pool's rounds and collectives wait on the slowest process, and a slow step is no
fault: a process may compute or sample for as long as it needs. A process that has
stopped running (SIGSTOP, a frozen host, a debugger) looks the same to a waiting peer
until a timeout of minutes. So each process runs one side thread, apart from the
training thread, that

* **beats**: writes a counter under ``beat/<rank>`` in the rendezvous store every
  ``interval`` seconds, whatever the training thread is doing; a process whose whole
  body has stopped stops beating, a slow one does not;
* **watches**: reads every peer's counter in the same tick and notes, on its own
  ``time.monotonic()`` clock, when each last changed (clocks of different hosts are
  never compared); a peer silent for ``hang_after`` seconds is *hung*;
* **frees**: once a peer is hung, shuts down this process's TCP connections to it
  (the addresses the peer publishes under ``ends/<rank>``), so a collective blocked on
  it fails at once with a transport error instead of waiting for the group's
  timeout; the pool's post-mortem round then names it (see :mod:`dew.pool._pool`).

A process that leaves the pool writes ``closed`` as its beat: it is gone, not hung.

Invariants:

* :class:`HangWatch`, the bookkeeping, is a plain state machine fed observations; it
  owns no thread and reads no clock. A rank is named hung only once its counter has
  looked unchanged for ``hang_after`` seconds of observations; a change is seen at
  most one look late, so a process that beats at least once every ``hang_after``
  minus one look interval is never named (a live one beats every tenth of it).
* :class:`Heartbeat` owns exactly one thread, started by :meth:`Heartbeat.start` and
  joined by :meth:`Heartbeat.close`; it talks to the store through its own client
  (``store.clone()``), never the training thread's. Store errors in the thread are
  logged once and end the beating (the training thread's next round then reports the
  lost store itself); nothing broader than ``Exception`` is caught.
* Connections are only ever shut down (``shutdown(2)``), never closed: the file
  descriptors stay owned by the library that opened them.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

__all__ = ["CLOSED", "HangWatch", "Heartbeat", "own_endpoints", "sever"]

logger = logging.getLogger("dew.pool")

CLOSED = "closed"  # the beat of a process that left the pool


class HangWatch:
    """Which ranks have stopped beating, from observations of their counters.

    ``observe(now, beats)`` takes every rank's latest beat (a counter string,
    ``CLOSED``, or ``None`` if the rank never beat) and the observer's monotonic time.
    """

    def __init__(self, world: int, rank: int, hang_after: float, now: float) -> None:
        if not hang_after > 0:
            raise ValueError(f"hang_after={hang_after!r} must be a positive number of seconds")
        self.world = world
        self.rank = rank
        self.hang_after = hang_after
        self._last: list[str | None] = [None] * world
        self._since = [now] * world  # when each rank's beat last changed (or watching began)
        self.hung: dict[int, float] = {}  # rank -> seconds silent when first named
        self.closed: set[int] = set()

    def observe(self, now: float, beats: Sequence[str | None]) -> dict[int, float]:
        """Record one look at every beat; returns the ranks newly found hung."""
        if len(beats) != self.world:
            raise ValueError(f"beats: {len(beats)} values for a pool of {self.world}")
        new: dict[int, float] = {}
        for r, beat in enumerate(beats):
            if r == self.rank or r in self.hung or r in self.closed:
                continue
            if beat == CLOSED:
                self.closed.add(r)
                continue
            if beat != self._last[r]:
                self._last[r] = beat
                self._since[r] = now
                continue
            silent = now - self._since[r]
            if silent >= self.hang_after:
                new[r] = silent
        self.hung.update(new)
        return new


# -- this process's connections ---------------------------------------------------------

Endpoint = tuple[str, int]  # (address, port)


def _address(hex_address: str) -> Endpoint:
    """An ``ADDR:PORT`` field of ``/proc/net/tcp{,6}`` as (address, port)."""
    addr, port = hex_address.split(":")
    raw = bytes.fromhex(addr)
    # The kernel prints each 32-bit word in host byte order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


def _sockets() -> list[tuple[int, Endpoint, Endpoint, str]]:
    """This process's TCP sockets: (fd, local, remote, state); empty off Linux."""
    inodes: dict[int, int] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return []
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if link.startswith("socket:["):
            inodes[int(link[8:-1])] = int(fd)
    found = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            inode = int(fields[9])
            if inode in inodes:
                found.append((inodes[inode], _address(fields[1]), _address(fields[2]), fields[3]))
    return found


_LISTEN, _ESTABLISHED = "0A", "01"


def own_endpoints() -> list[Endpoint]:
    """The local addresses of this process's TCP sockets: what a peer sees as remote."""
    return sorted({local for _, local, _, state in _sockets() if state in (_LISTEN, _ESTABLISHED)})


def sever(peer: Sequence[Endpoint]) -> int:
    """Shut down this process's connections to ``peer``'s endpoints; how many.

    A connection is the peer's when its remote end is one of the peer's own local
    addresses (its listening ports or the ports it connected from).
    """
    targets = set(peer)
    count = 0
    for fd, _, remote, state in _sockets():
        if state != _ESTABLISHED or remote not in targets:
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # closed or reused since the listing
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass  # already shut down or not connected any more
        finally:
            sock.detach()  # the fd stays its owner's
    return count


# -- the thread -------------------------------------------------------------------------


class Heartbeat:
    """One process's beating and watching thread (see the module's invariants)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world: int,
        hang_after: float,
        *,
        endpoints: Callable[[], list[Endpoint]] = own_endpoints,
    ) -> None:
        self.store = store  # a client of its own: store.clone() of the pool's
        self.endpoints = endpoints  # what this process publishes for peers to sever
        self.rank = rank
        self.world = world
        self.hang_after = hang_after
        # Ten looks per bound: a hang is named at most a tenth late.
        self.interval = min(max(hang_after / 10, 0.05), 1.0)
        self._watch = HangWatch(world, rank, hang_after, time.monotonic())
        self._lock = threading.Lock()  # guards _watch and _severed
        self._severed: dict[int, int] = {}  # rank -> connections shut down
        # Called each tick, with the thread's store client, while a peer is hung or
        # gone: the pool's rounds decide the round this process waits in.
        self.on_gone: Callable[[Any], None] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fds: frozenset[int] = frozenset()  # this process's open files, last look
        # A store whose host stopped must not hold this thread (or close()) for the
        # store's own timeout, which is the pool's collective bound.
        store.set_timeout(timedelta(seconds=max(hang_after, 5.0)))

    def start(self) -> None:
        self._beat(0)
        self._publish_endpoints()
        self._thread = threading.Thread(
            target=self._loop, name=f"dew-heartbeat-{self.rank}", daemon=True
        )
        self._thread.start()

    def hung(self) -> dict[int, float]:
        """Peers found hung so far: rank -> seconds silent when found."""
        with self._lock:
            return dict(self._watch.hung)

    def gone(self) -> dict[int, str]:
        """Peers known hung or gone, each with why: what a waiting round names."""
        with self._lock:
            hung = dict(self._watch.hung)
            closed = set(self._watch.closed)
        causes = {
            r: f"has not beaten for {s:.0f} s: dead, hung or stopped (its heartbeat, a "
            "thread that runs whatever the process is doing, went silent)"
            for r, s in hung.items()
        }
        causes.update({r: "left the pool (closed it) before this round" for r in closed})
        return causes

    def severed(self) -> dict[int, int]:
        """Peers whose connections this process shut down: rank -> how many."""
        with self._lock:
            return dict(self._severed)

    def close(self) -> None:
        """Stop the thread, join it, and tell the peers this process left."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            self.store.set(f"beat/{self.rank}", CLOSED)
        except Exception:  # the store's host may be gone; nobody is left to tell
            logger.debug("rank %d: could not write its closed beat", self.rank, exc_info=True)

    def _beat(self, n: int) -> None:
        self.store.set(f"beat/{self.rank}", str(n))

    def _publish_endpoints(self) -> None:
        # Re-published whenever this process's set of sockets changes: process groups
        # made after the pool (and their connections) are covered too.
        try:
            fds = frozenset(int(fd) for fd in os.listdir("/proc/self/fd"))
        except OSError:
            return
        if fds == self._fds:
            return
        self._fds = fds
        ends = [f"{a}|{p}" for a, p in self.endpoints()]
        self.store.set(f"ends/{self.rank}", json.dumps(ends))

    def _loop(self) -> None:
        n = 0
        keys = [f"beat/{r}" for r in range(self.world)]
        try:
            while not self._stop.wait(self.interval):
                n += 1
                self._beat(n)
                self._publish_endpoints()
                beats = self._read(keys)
                with self._lock:
                    new = self._watch.observe(time.monotonic(), beats)
                    gone = bool(self._watch.hung or self._watch.closed)
                if new:
                    self._found(new)
                if gone and self.on_gone is not None:
                    self.on_gone(self.store)
        except Exception as exc:  # the store is gone: the training thread's rounds say so
            logger.warning(
                "rank %d: heartbeat stopped (is the rendezvous store gone?): %s: %s",
                self.rank,
                type(exc).__name__,
                exc,
            )

    def _read(self, keys: list[str]) -> list[str | None]:
        # Every key exists once every process has started: one request from then on.
        if self.store.check(keys):
            return [v.decode() for v in self.store.multi_get(keys)]
        return [self.store.get(k).decode() if self.store.check([k]) else None for k in keys]

    def _found(self, new: dict[int, float]) -> None:
        for r, silent in new.items():
            logger.error(
                "rank %d: rank %d of %d has not beaten for %.0f s: dead, hung or stopped",
                self.rank,
                r,
                self.world,
                silent,
            )
            raw = self.store.get(f"ends/{r}").decode() if self.store.check([f"ends/{r}"]) else "[]"
            ends = [(a, int(p)) for a, p in (e.rsplit("|", 1) for e in json.loads(raw))]
            count = sever(ends)
            with self._lock:
                self._severed[r] = count
