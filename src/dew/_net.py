"""Binding a listening socket, shared by the HTTP servers dew starts (``dew serve``, the
recording gateway). Imports nothing of dew."""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["bind", "is_loopback"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (``localhost`` counts; other names do not,
    since a name may resolve anywhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int, backlog: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: a free port) and listening; the caller
    owns it. Bound here rather than by uvicorn so that the real port is known."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock
