"""A TCP proxy in front of one real server, for faults a server cannot be asked for: it
cuts the connection of the next ``POST /generate`` (the server never sees it, and its
``/health`` still answers), and it can hold ``/health`` requests until released."""

from __future__ import annotations

import contextlib
import socket
import threading


class Proxy:
    """``127.0.0.1:port`` forwarding to ``upstream`` (host, port); threads owned and
    joined by :meth:`close`."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.cut_next_generate = threading.Event()
        self.health_open = threading.Event()
        self.health_open.set()
        self.healths = 0  # /health requests forwarded
        self.generates = 0  # /generate requests forwarded
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._spawn(self._accept)

    def _spawn(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(self.upstream)
            with self._lock:
                if self._closed:
                    client.close()
                    server.close()
                    return
                self._sockets += [client, server]
            self._spawn(self._pump, client, server, True)
            self._spawn(self._pump, server, client, False)

    def _pump(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if requests and data.startswith(b"POST /generate"):
                    if self.cut_next_generate.is_set():
                        self.cut_next_generate.clear()
                        break  # never forwarded: the client sees its connection end
                if requests:
                    with self._lock:
                        self.generates += data.count(b"POST /generate ")
                if requests and data.startswith(b"GET /health"):
                    self.health_open.wait(60)
                    with self._lock:
                        self.healths += 1
                dst.sendall(data)
        except OSError:
            pass  # the other side closed
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets, threads = list(self._sockets), list(self._threads)
        self.health_open.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept()
        self._listener.close()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(10)
        for s in sockets:
            s.close()
