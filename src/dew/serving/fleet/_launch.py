"""The fleet's ways to start its own engines: local processes (:meth:`Launch.launch`)
or Ray actors across a cluster (:meth:`Launch.on_ray`), each started concurrently and
handed to the constructor, which then owns them."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dew._net import API_KEY_ENV
from dew.core import as_int
from dew.serving._folders import private_folder, release_folder
from dew.serving.fleet._parts import ENGINES, Process, local_processes
from dew.serving.fleet._router import RouterProcess

# Seconds an engine process (or the router) gets to start and listen, at launch and at
# each restart: it loads a model first, so far more than an engine's STARTUP_TIMEOUT,
# which waits for a server already started.
STARTUP_TIMEOUT = 120.0


class Launch:
    """Mixed into :class:`~dew.serving.fleet.EngineFleet`: its launching constructors."""

    @classmethod
    def launch(
        cls,
        count: int,
        *,
        demo: str | None = None,
        model: str | Path | None = None,
        seed: int = 0,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        startup_timeout: float = STARTUP_TIMEOUT,
        router: str | None = None,
        engine: str = "dew",
        python: str | Path | None = None,
        devices: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Start ``count`` local engine processes on 127.0.0.1 and return a fleet that
        owns them, with a supervisor restarting any that dies. ``env`` is added to this
        process's environment for them (e.g. ``OMP_NUM_THREADS``); ``kwargs`` go to the
        constructor.

        ``engine="dew"``: ``dew serve`` processes (``--demo SIZE`` or ``--model PATH``,
        ``--seed seed`` for all, so the demo weights agree, plus ``args``). ``router``:
        also start an sglang-router with this policy (``cache_aware``, ``round_robin``,
        ...) in front of them, owned by the fleet too; a worker then restarts on its
        port, so the router's list keeps its URL.

        ``engine="vllm"``: vLLM servers of the model folder ``model``, run by the vLLM
        environment's interpreter ``python`` (default ``$DEW_VLLM_PYTHON``), with
        ``--seed seed`` and ``args`` (``--dtype``, ``--max-model-len``, ...) after the
        flags dew needs; their weight pushes may read only the fleet's weights folder.

        ``devices``: one torch device per engine (``cuda:1``, ``cuda:2``, ...): a ``dew
        serve`` gets ``--device``, a vLLM server sees only that GPU
        (``CUDA_VISIBLE_DEVICES``). A restarted engine comes back on its own device.
        """
        count = as_int(count, "count")
        if count < 1 or (demo is None) == (model is None):
            raise ValueError("launch needs count >= 1 and exactly one of demo= or model=")
        if engine not in ENGINES:
            raise ValueError(f"engine={engine!r} is not one of {sorted(ENGINES)}")
        if kwargs.get("weights_dir") is None:  # the servers are told it: made first
            kwargs.update(weights_dir=private_folder("fleet-"), _own_dir=True)
        locals_ = local_processes(
            engine, count, demo=demo, model=model, seed=seed, args=args, env=env,
            python=python, router=router, weights_dir=kwargs.get("weights_dir"),
            devices=devices,
        )  # fmt: skip
        return cls._started(locals_, startup_timeout, router=router, engine=engine, **kwargs)

    @classmethod
    def on_ray(
        cls,
        count: int,
        *,
        demo: str | None = None,
        model: str | Path | None = None,
        engine: str = "dew",
        seed: int = 0,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        python: str | Path | None = None,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        resources: Mapping[str, float] | None = None,
        max_restarts: int = -1,
        address: str | None = None,
        startup_timeout: float = STARTUP_TIMEOUT,
        **kwargs: Any,
    ) -> Any:
        """Place ``count`` engines with Ray and return a fleet that owns them (see
        :mod:`dew.serving.fleet._ray`): each a Ray actor that starts ``dew serve`` (or,
        ``engine="vllm"``, a vLLM server) on its node, as :meth:`launch` does locally
        (``demo``, ``model``, ``seed``, ``args``, ``env``, ``python`` as there).

        Each actor asks Ray for ``num_cpus``, ``num_gpus`` (1 per engine on GPU nodes)
        and the custom ``resources``, and the actors are spread over the nodes (Ray's
        ``SPREAD``); Ray restarts a dead actor up to ``max_restarts`` times (-1:
        always). ``address``: the cluster to join (None: Ray's own rule, ``RAY_ADDRESS``
        or a cluster started on this machine, else a new local one); a fleet that
        connected closes the connection with itself. The servers listen on their node's
        address, behind ``api_key`` (in ``kwargs``; default: a new random key, given to
        them in their environment). ``weights_dir`` (in ``kwargs``)
        must be a folder every node reads at the same path; the default, a private
        folder in this machine's shared memory, serves only a cluster on this machine.
        """
        from dew.serving.fleet._ray import connect, ray_processes

        count = as_int(count, "count")
        if count < 1 or (demo is None) == (model is None):
            raise ValueError("on_ray needs count >= 1 and exactly one of demo= or model=")
        if engine not in ENGINES:
            raise ValueError(f"engine={engine!r} is not one of {sorted(ENGINES)}")
        if engine == "vllm" and demo is not None:
            raise ValueError("engine='vllm' serves a model folder (model=)")
        disconnect = connect(address)  # first: a cluster that does not answer leaves nothing
        if kwargs.get("weights_dir") is None:
            kwargs.update(weights_dir=private_folder("fleet-"), _own_dir=True)
        # Servers on other machines listen beyond loopback: never without a key.
        key = kwargs["api_key"] = kwargs.get("api_key") or secrets.token_urlsafe(24)
        env = {**(env or {}), API_KEY_ENV: key, "VLLM_API_KEY": key}
        processes = ray_processes(
            engine, count, demo=demo, model=model, seed=seed, args=args, env=env,
            python=python, weights_dir=kwargs["weights_dir"], num_cpus=num_cpus,
            num_gpus=num_gpus, resources=resources, max_restarts=max_restarts,
        )  # fmt: skip
        try:
            fleet = cls._started(processes, startup_timeout, engine=engine, **kwargs)
        except BaseException:
            disconnect()
            raise
        fleet._disconnect = disconnect
        return fleet

    @classmethod
    def _started(
        cls,
        processes: Sequence[Process],
        startup_timeout: float,
        *,
        engine: str,
        router: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """Start ``processes`` concurrently (and a router of policy ``router`` in front
        of them), then the fleet that owns them; on any failure, stop all of them."""
        never = threading.Event()
        urls: list[Future[str]] = []
        with ThreadPoolExecutor(max_workers=len(processes)) as pool:
            urls = [pool.submit(p.start, startup_timeout, never) for p in processes]
        front = None
        try:
            started = [u.result() for u in urls]
            if router is not None:
                for p, url in zip(processes, started, strict=True):
                    p.argv[-1] = url.rsplit(":", 1)[1]  # type: ignore[attr-defined]
                front = RouterProcess(started, policy=router)
                front.start(startup_timeout)
            return cls(
                started,
                startup_timeout=startup_timeout,
                router=None if front is None else front.url,
                engine=engine,
                _locals=processes,
                _router_process=front,
                **kwargs,
            )
        except BaseException:
            if front is not None:
                front.stop(5.0)
            for p in processes:
                p.stop(5.0)
            if kwargs.get("_own_dir"):
                release_folder(Path(kwargs["weights_dir"]))
            raise
