"""Engines placed by Ray (:meth:`EngineFleet.on_ray`): each engine server is started and
owned by a Ray actor, on the node Ray placed that actor on.

Ray does what a cluster manager does: it places each actor where its resources are
(``num_gpus=1`` per engine on GPU nodes, custom resources anywhere), spreads the actors
over the nodes, restarts an actor whose process died (``max_restarts``), and gives the
cluster one address. The fleet keeps its own rules on top, unchanged: routing, the
publish sequence, take-out, and bringing a member to the fleet's version before it
gets work.

One :class:`RayProcess` per member stands where a launched fleet has a local process
(the fleet's ``Process`` protocol). Its actor, :class:`EngineHost`, starts ``dew serve``
(or a vLLM server) on its node's address, with the same command line a launched fleet
uses, at normal priority where it may (Ray's workers run at nice 15), and reports the
URL; a watchdog ends that server if the actor's process dies.

* The supervisor finds a member dead when its actor says its server is gone, or Ray
  says the actor is gone or restarting. It then asks the actor for a new server:
  Ray's restarted actor (its calls wait while Ray restarts it), the same actor if only
  the server died, or a new actor once Ray gave this one up (its restarts used, its
  node gone), placed by Ray wherever the resources are. A new actor that Ray cannot
  place (no node offers its resources) fails that restart after the fleet's startup
  timeout: the member stays out, its reason says so, and it is tried again later.
* Weights: the fleet writes each push to ``weights_dir`` and every server reads it
  from there, so on several machines it must be storage every node mounts at the same
  path (a cluster's shared file system, a Kubernetes ReadWriteMany volume).
* Ray is imported only here, only when a Ray fleet is made (the ``ray`` extra).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dew.core import EngineError

__all__ = ["NAMESPACE", "EngineHost", "RayProcess", "connect", "ray_processes"]

NAMESPACE = "dew"  # the Ray namespace of the engines' actors (``ray list actors``)
_ASK = 5.0  # seconds an actor gets to answer a question about its server
_POLL = 0.2  # seconds between looks at a server that is starting


class EngineHost:
    """A Ray actor's body: one engine server on this node (made with ``spec``, the
    keywords of the fleet's ``local_processes`` for one engine)."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        self._spec = dict(spec)
        self._process: Any = None
        self._url: str | None = None
        self._lock = threading.Lock()  # serve and stop one at a time; alive reads only

    def serve(self, timeout: float) -> dict[str, Any]:
        """This node's server, started now unless it runs already: its URL, the node
        Ray placed this actor on, and the actor's and the server's pids."""
        import ray

        from dew.serving.fleet._parts import local_processes

        with self._lock:
            if self._process is None or not self._process.alive():
                if self._process is not None:
                    self._process.reset()
                _normal_priority()
                (self._process,) = local_processes(**self._spec, count=1, host=_node_address())
                self._url = self._process.start(timeout, threading.Event())
            proc = self._process.proc
            return {
                "url": self._url,
                "node": ray.get_runtime_context().get_node_id(),
                "actor_pid": os.getpid(),
                "server_pid": None if proc is None else proc.pid,
            }

    def alive(self) -> bool:
        process = self._process
        return process is not None and process.alive()

    def stop(self, grace: float) -> None:
        with self._lock:
            if self._process is not None:
                self._process.stop(grace)
            self._process = self._url = None

    def tail(self) -> str:
        process = self._process
        return "" if process is None else process.tail()


class RayProcess:
    """One member's engine under a Ray actor (see the module docstring); ``options``
    are the actor's Ray options (resources, strategy, restarts)."""

    proc = None  # no process of this machine: the server runs under the actor

    def __init__(self, spec: Mapping[str, Any], options: Mapping[str, Any], name: str) -> None:
        self._spec = dict(spec)
        self._options = dict(options)
        self._base = name
        self._made = 0  # actors made: each a name of its own (a dead one's may linger)
        self.name: str | None = None  # the Ray actor's, in the namespace NAMESPACE
        self._actor: Any = None
        self.node: str | None = None  # the Ray node of the last server started
        self.server_pid: int | None = None
        self.actor_pid: int | None = None
        self._said = ""  # the last server's output, kept for tail() after its actor died

    def _host(self) -> Any:
        if self._actor is None:
            import ray

            self._made += 1
            self.name = f"{self._base}.{self._made}"
            host = ray.remote(EngineHost).options(
                **self._options, name=self.name, namespace=NAMESPACE
            )
            self._actor = host.remote(self._spec)
        return self._actor

    def start(self, deadline: float, stopping: threading.Event) -> str:
        """Start (or find) the server under this member's actor and return its URL; a
        new actor when Ray gave the old one up; EngineError when none serves within
        ``deadline`` seconds."""
        import ray
        from ray.exceptions import RayActorError

        end = time.monotonic() + deadline
        failed = 0
        while True:
            actor = self._host()
            try:
                where = self._wait(actor.serve.remote(deadline), end, stopping)
            except RayActorError as exc:
                # A call that was running when the actor died fails even while Ray
                # restarts it (the next one waits for the restart); one that fails
                # again finds it dead for good: a new actor, placed anew.
                failed += 1
                if time.monotonic() > end:
                    raise EngineError(f"the engine's Ray actor died: {_first(exc)}") from None
                if failed >= 2:
                    self._give_up()
                    failed = 0
                continue
            except ray.exceptions.RayTaskError as exc:  # the server itself did not start
                raise EngineError(_first(exc.cause if exc.cause else exc)) from None
            self.node, self.actor_pid = where["node"], where["actor_pid"]
            self.server_pid = where["server_pid"]
            return str(where["url"])

    def _give_up(self) -> None:
        import ray

        actor, self._actor = self._actor, None
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # gone already
            pass

    def _wait(self, ref: Any, end: float, stopping: threading.Event) -> Any:
        import ray

        while True:
            ready, _ = ray.wait([ref], timeout=_POLL)
            if ready:
                return ray.get(ref)
            if stopping.is_set() or time.monotonic() > end:
                need = self._options.get("resources") or {}
                gpus = self._options.get("num_gpus")
                raise EngineError(
                    "no engine under Ray served in time: its actor was not placed (no node "
                    f"offers num_gpus={gpus or 0}, resources={need}) or its server did not "
                    "start"
                )

    def alive(self) -> bool:
        """Whether the actor answers that its server runs; a slow answer counts as
        alive (the fleet's health checks judge a server that hangs)."""
        if self._actor is None:
            return False
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            return bool(ray.get(self._actor.alive.remote(), timeout=_ASK))
        except GetTimeoutError:
            return True
        except Exception:  # the actor died, is restarting, or its node is gone
            return False

    def reset(self) -> None:
        """Stop a dead server's leftovers at its actor, which stays (a restarted actor
        has none: a failed ask is fine)."""
        self._ask("stop", 0.0)

    def stop(self, grace: float) -> None:
        """Stop the server (SIGTERM, SIGKILL after ``grace``), then end the actor for
        good (no Ray restart)."""
        actor = self._actor
        if actor is None:
            return
        self._said = self.tail()
        self._ask("stop", grace, wait=grace + _ASK)
        self._give_up()

    def tail(self) -> str:
        said = self._ask("tail")
        if isinstance(said, str):
            self._said = said
        return self._said

    def _ask(self, method: str, *args: Any, wait: float = _ASK) -> Any:
        if self._actor is None:
            return None
        import ray

        try:
            return ray.get(getattr(self._actor, method).remote(*args), timeout=wait)
        except Exception:  # a dead or restarting actor has nothing to say
            return None


def ray_processes(
    engine: str,
    count: int,
    *,
    demo: str | None,
    model: str | os.PathLike[str] | None,
    seed: int,
    args: Sequence[str],
    env: Mapping[str, str] | None,
    python: str | os.PathLike[str] | None,
    weights_dir: str | os.PathLike[str],
    num_cpus: float,
    num_gpus: float,
    resources: Mapping[str, float] | None,
    max_restarts: int,
) -> list[RayProcess]:
    """``count`` members placed by Ray (:meth:`EngineFleet.on_ray`'s docstring)."""
    spec = {
        "engine": engine,
        "demo": demo,
        "model": None if model is None else os.fspath(model),
        "seed": seed,
        "args": list(args),
        "env": None if env is None else dict(env),
        "python": None if python is None else os.fspath(python),
        "router": None,
        "weights_dir": os.fspath(weights_dir),
    }
    options: dict[str, Any] = {
        "num_cpus": num_cpus,
        "num_gpus": num_gpus,
        "max_restarts": max_restarts,
        "max_task_retries": 0,  # a call to a dead actor fails; the supervisor decides
        "max_concurrency": 4,  # alive() answers while serve() starts a server
        "scheduling_strategy": "SPREAD",  # engines on as many nodes as can take them
    }
    if resources:
        options["resources"] = dict(resources)
    fleet = uuid.uuid4().hex[:8]
    return [RayProcess(spec, options, f"dew-engine-{fleet}-{i}") for i in range(count)]


def connect(address: str | None) -> Callable[[], None]:
    """Join the Ray cluster at ``address`` (None: ``RAY_ADDRESS``, else a cluster
    started on this machine, else a new local one) unless this process is connected
    already; returns what undoes it (nothing, for a connection made elsewhere)."""
    try:
        import ray
    except ImportError:
        raise ImportError("Ray fleets need Ray: pip install 'dew[ray]'") from None
    if ray.is_initialized():
        return lambda: None
    _answers(address)
    try:
        ray.init(address=address, logging_level="WARNING", log_to_driver=False)
    except Exception as exc:  # an address no cluster answers, a refused token, ...
        where = address or "the default address ($RAY_ADDRESS or this machine's)"
        raise EngineError(f"cannot join the Ray cluster at {where}: {_first(exc)}") from None
    return ray.shutdown


def _answers(address: str | None) -> None:
    """EngineError unless something listens at a ``host:port`` address: Ray's own
    connect retries an address where nothing listens for many minutes."""
    host, sep, port = (address or "").rpartition(":")
    if not sep or "/" in address or not port.isdigit():  # None, "auto", "local", "ray://..."
        return
    try:
        socket.create_connection((host, int(port)), timeout=_ASK).close()
    except OSError as exc:
        raise EngineError(
            f"cannot join the Ray cluster at {address}: nothing answers there ({exc})"
        ) from None


def _normal_priority() -> None:
    """Ray runs its workers at a low priority (nice 15), which the server would inherit
    and lose every core it shares to the rest of the node: back to 0 where this process
    may raise its priority (root, CAP_SYS_NICE), else as Ray left it."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError:
        pass


def _node_address() -> str:
    """This node's address as the cluster knows it (what ``ray start
    --node-ip-address`` set), where its engine listens."""
    import ray

    me = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == me:
            return str(node["NodeManagerAddress"])
    return str(ray.util.get_node_ip_address())


def _first(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
