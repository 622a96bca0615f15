"""A local Ray cluster of real nodes for the Ray fleet tests: each node a ``ray start
--block`` process on 127.0.0.1 in a process group of its own (its raylet, its workers
and the engine servers they start), stopped by that pid and group, never by name."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO

RAY = str(Path(sys.executable).with_name("ray"))
STARTED = "Ray runtime started"


# One token for every cluster of this test process: Ray reads a client's token once,
# when it is first imported, so a second token would not reach the second cluster.
_TOKEN = secrets.token_hex(32)


def ray_env() -> dict[str, str]:
    """The environment of a test's Ray processes and of the test itself as a Ray client:
    token authentication with this process's own token (never ~/.ray's, never written
    there), and no usage report."""
    return {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": _TOKEN,
        "RAY_USAGE_STATS_ENABLED": "0",
    }


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RayNode:
    """One node: ``ray start --block`` with its own ports, CPUs and custom resources."""

    def __init__(self, args: list[str], name: str, env: Mapping[str, str]) -> None:
        self.name = name
        self.log: IO[bytes] = tempfile.TemporaryFile()
        ports = []
        for flag in (
            "--node-manager-port",
            "--object-manager-port",
            "--dashboard-agent-listen-port",
            "--dashboard-agent-grpc-port",
            "--metrics-export-port",
            "--runtime-env-agent-port",
        ):
            ports += [flag, str(free_port())]
        argv = [RAY, "start", "--block", "--node-ip-address", "127.0.0.1", *ports, *args]
        argv += ["--disable-usage-stats"]
        self.proc = subprocess.Popen(
            argv,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env},
            start_new_session=True,  # its raylet, workers and their servers: one group
        )

    def said(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def wait_started(self, within: float) -> None:
        deadline = time.monotonic() + within
        while STARTED not in self.said():
            if self.proc.poll() is not None:
                raise AssertionError(f"ray node {self.name} exited: {self.said()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"ray node {self.name} did not start: {self.said()[-3000:]}")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL the node's whole group: a machine that is gone."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, grace: float = 10.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of the group is left
        self.proc.wait()
        self.log.close()


def _resources(resources: Mapping[str, float]) -> list[str]:
    return ["--resources", json.dumps(dict(resources))]


@contextlib.contextmanager
def ray_cluster(
    env: Mapping[str, str], head: Mapping[str, float], *workers: Mapping[str, float], cpus: int = 2
) -> Iterator[tuple[str, list[RayNode]]]:
    """A head node offering ``head`` and one node per ``workers`` entry offering its
    resources (``cpus`` CPUs each), their processes in ``env`` (:func:`ray_env`);
    yields the cluster's address and the nodes."""
    port = free_port()
    nodes: list[RayNode] = []
    try:
        first = RayNode(
            ["--head", "--port", str(port), "--num-cpus", str(cpus), "--include-dashboard",
             "false", *_resources(head)],
            "head",
            env,
        )  # fmt: skip
        nodes.append(first)
        first.wait_started(120)
        address = f"127.0.0.1:{port}"
        for i, res in enumerate(workers):
            node = RayNode(
                ["--address", address, "--num-cpus", str(cpus), *_resources(res)],
                f"worker {i}",
                env,
            )
            nodes.append(node)
            node.wait_started(120)
        yield address, nodes
    finally:
        for node in reversed(nodes):
            node.stop()
