"""The engine of a ``dew train`` run: its ``[engine]`` section, and the engine (or
fleet) built from it: in process, launched ``dew serve`` or vLLM processes (each on
its own device), or servers at URLs that the run holds while it pushes to them."""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from dew._devices import DEVICE_PATTERN, device_problem
from dew._net import API_KEY_ENV
from dew.job._base import ConfigError, Section

__all__ = ["EngineSection", "check_devices", "make_engine"]


class EngineSection(Section):
    kind: Literal["in-process", "fleet", "urls", "vllm", "ray"] = "in-process"  # where rollouts run
    engines: int = 2  # kind = "fleet", "vllm" or "ray": engine processes to start
    urls: tuple[str, ...] = ()  # kind = "urls": dew serve servers; "vllm": vLLM servers
    # kind = "vllm" only: the vLLM environment's interpreter for launched servers (none:
    # $DEW_VLLM_PYTHON), more vLLM server flags, and what a weight push does to the
    # requests in flight (none: VLLMEngine's default).
    python: str | None = None
    args: tuple[str, ...] = ()  # kind = "vllm": more vLLM server flags
    on_load: Literal["recompute", "keep"] | None = None  # kind = "vllm": see above
    # Where weight pushes are written for engine processes to read (none: a private
    # folder in shared memory); servers started elsewhere must be able to read it (a vLLM
    # server reads only its DEW_VLLM_WEIGHTS_DIR, when set).
    weights_dir: str | None = None
    # The servers' API key, for urls: read from this file (none: from $DEW_API_KEY, if
    # set). The key itself is never a field, so it is never printed or saved with the run.
    api_key_file: str | None = None
    # kind = "fleet" only: an sglang-router in front of the engines, with this policy
    # ("cache_aware", "round_robin", ...; the router extra), started and owned by the run.
    router: str | None = None
    # Servers at urls (dew serve or vLLM): push to ones another run holds (one killed
    # before it released them); that run's next push is then refused.
    takeover: bool = False
    # Where the engines run: one torch device per launched engine (kind = "fleet" or
    # "vllm": ["cuda:1", "cuda:2"]), or the in-process engine's (["cuda:1"]); none:
    # with the trainer's model (in-process), or each server's own default.
    devices: tuple[str, ...] = ()
    # kind = "fleet" or "urls": each group's requests in one /generate (SGLang's batch
    # form): faster for short generations, but a group's answers come when its last does.
    batch_groups: bool = False
    # kind = "ray" (dew serve engines placed by Ray): the cluster to join (none:
    # $RAY_ADDRESS, else one started on this machine, else a new local one; "local": a
    # new one on this machine, stopped with the run).
    address: str | None = None
    # kind = "ray": what each engine asks of its node, CPU and GPU counts and custom
    # resources (none: one CPU); weights_dir must then be a folder every node reads.
    resources: dict[str, float] = Field(default_factory=dict)

    @field_validator("engines")
    @classmethod
    def _some(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be >= 1")
        return value

    @model_validator(mode="after")
    def _urls_for_urls(self) -> EngineSection:
        if self.kind == "urls" and not self.urls:
            raise ValueError('kind = "urls" needs urls = ["http://host:port", ...]')
        vllm_only = {"python": self.python, "args": self.args, "on_load": self.on_load}
        stray = [name for name, value in vllm_only.items() if value and self.kind != "vllm"]
        if stray:
            raise ValueError(f'{", ".join(stray)} apply to kind = "vllm" only')
        if self.kind == "vllm" and self.urls and (self.python or self.args):
            raise ValueError("python and args launch vLLM servers; with urls none is launched")
        self._check_devices()
        if self.batch_groups and (self.kind not in ("fleet", "urls", "ray") or self.router):
            raise ValueError(
                'batch_groups is for dew serve engines, not behind a router: kind = "fleet", '
                '"urls" or "ray"'
            )
        if self.takeover and not self.urls:
            raise ValueError("takeover is for servers at urls")
        if self.router is not None and self.kind != "fleet":
            raise ValueError('router puts a launched fleet behind sglang-router: kind = "fleet"')
        if self.weights_dir and self.kind == "in-process":
            raise ValueError("weights_dir is for engine processes; in-process needs none")
        if self.api_key_file is not None:
            if not self.urls:
                raise ValueError("api_key_file is for servers at urls (launched ones need none)")
            self.api_key()  # a missing or empty file, said before anything runs
        if (self.address is not None or self.resources) and self.kind != "ray":
            raise ValueError('address and resources place engines with Ray: kind = "ray"')
        if any(not (v >= 0) for v in self.resources.values()):
            raise ValueError("resources: every amount must be a number >= 0")
        if self.kind == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError("kind = \"ray\" needs Ray: pip install 'dew[ray]'")
        if self.kind == "vllm" and not self.urls:
            from dew.serving.vllm import vllm_python

            vllm_python(self.python)  # a missing vLLM environment, said before anything runs
        return self

    def _check_devices(self) -> None:
        if not self.devices:
            return
        bad = [d for d in self.devices if not DEVICE_PATTERN.fullmatch(d)]
        if bad:
            raise ValueError(f"devices: {bad[0]!r} is not a device name (cpu, cuda, cuda:N)")
        if self.urls:
            raise ValueError("devices place launched engines; servers at urls place themselves")
        if self.kind == "ray":
            raise ValueError("devices: Ray places the engines (resources = { GPU = 1 } each)")
        want = 1 if self.kind == "in-process" else self.engines
        if len(self.devices) != want:
            raise ValueError(
                f"devices: {len(self.devices)} given, one per engine: {want} "
                f"({'in-process' if self.kind == 'in-process' else 'engines'})"
            )

    def api_key(self) -> str | None:
        """The key for the servers at ``urls``: ``api_key_file``'s content, else
        ``$DEW_API_KEY``, else none."""
        if self.api_key_file is None:
            return os.environ.get(API_KEY_ENV) or None
        path = Path(self.api_key_file).expanduser()
        try:
            key = path.read_text().strip()
        except OSError as exc:
            raise ValueError(f"api_key_file: {path} cannot be read ({exc.strerror})") from None
        if not key or "\n" in key:
            raise ValueError(f"api_key_file: {path} must hold the key alone, on one line")
        return key


def check_devices(trainer: str | None, engine: EngineSection) -> None:
    """ConfigError for a device this machine does not have: the trainer's
    (``training.device``), or an engine's where they are launched here."""
    named = [("training.device", trainer)]
    named += [("engine.devices", d) for d in engine.devices]
    for field, device in named:
        problem = None if device is None else device_problem(device)
        if problem is not None:
            raise ConfigError(f"{field}: {device}: {problem}")


def make_engine(
    e: EngineSection,
    *,
    model: Any,
    model_path: str,
    seed: int,
    max_batch: int,
    stack: ExitStack,
    run: Path,
) -> Any:
    """The run's engine (closed by ``stack``); servers at ``urls`` that cannot be driven,
    or that another live run holds, are a ConfigError."""
    from dew.core import EngineError

    at = _At(model, model_path, seed, max_batch, _run_id(run))
    try:
        engine = _KINDS[e.kind](e, at)
    except (EngineError, ValueError) as exc:
        if e.kind == "ray":  # the cluster, not this run, is at fault: say so in one line
            raise ConfigError(f'engine (kind = "ray"): {_first_line(exc)}') from None
        if not e.urls:
            raise
        why = _first_line(exc)
        if "API key" in why:
            why += f" (the key comes from engine.api_key_file, else ${API_KEY_ENV})"
        raise ConfigError(f"engine.urls: {why}") from None
    stack.callback(engine.close)
    if e.urls and not e.takeover:
        for member in engine.members():
            if member.held_by not in (None, at.run_id):
                raise ConfigError(
                    f"engine.urls: {member.url} is held by run {member.held_by!r}, which "
                    "has not released it: stop that trainer, or set engine.takeover = true "
                    "to take the server over"
                )
    return engine


def _run_id(run: Path) -> str:
    """The run's name on the servers it pushes to: the same on a resume, so a resumed
    run takes its servers back; another folder (or machine) is another run."""
    return f"{socket.gethostname()}:{run.resolve()}"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


@dataclass(frozen=True)
class _At:
    """What every kind of engine is built from."""

    model: Any  # the trainer's model (the in-process engine copies it)
    model_path: str  # its folder (engine processes load it)
    seed: int
    max_batch: int
    run_id: str


def _in_process(e: EngineSection, at: _At) -> Any:
    from dew.serving import RolloutServer

    device = e.devices[0] if e.devices else None
    return RolloutServer(at.model, max_batch=at.max_batch, seed=at.seed, device=device)


def _fleet(e: EngineSection, at: _At) -> Any:
    from dew.serving.fleet import EngineFleet

    return EngineFleet.launch(
        e.engines,
        model=at.model_path,
        seed=at.seed,
        args=["--max-batch", str(at.max_batch)],
        weights_dir=e.weights_dir,
        router=e.router,
        devices=e.devices or None,
        engine_options={"batch_groups": e.batch_groups},
    )


def _urls(e: EngineSection, at: _At) -> Any:
    from dew.serving.fleet import EngineFleet

    return EngineFleet(
        list(e.urls),
        api_key=e.api_key(),
        weights_dir=e.weights_dir,
        engine_options={"run": at.run_id, "takeover": e.takeover, "batch_groups": e.batch_groups},
    )


def _vllm(e: EngineSection, at: _At) -> Any:
    """vLLM servers at ``urls``, or ``engines`` launched from the vLLM environment."""
    from dew.serving.fleet import EngineFleet

    options = {} if e.on_load is None else {"on_load": e.on_load}
    if e.urls:
        return EngineFleet(
            list(e.urls),
            api_key=e.api_key(),
            engine="vllm",
            engine_options={**options, "run": at.run_id, "takeover": e.takeover},
            weights_dir=e.weights_dir,
        )
    return EngineFleet.launch(
        e.engines,
        model=at.model_path,
        engine="vllm",
        python=e.python,
        args=e.args,
        seed=at.seed,
        engine_options=options,
        weights_dir=e.weights_dir,
        devices=e.devices or None,
    )


def _ray(e: EngineSection, at: _At) -> Any:
    """dew serve engines placed by Ray, one actor each (EngineFleet.on_ray)."""
    from dew.serving.fleet import EngineFleet

    custom = {k: v for k, v in e.resources.items() if k not in ("CPU", "GPU")}
    return EngineFleet.on_ray(
        e.engines,
        model=at.model_path,
        seed=at.seed,
        args=["--max-batch", str(at.max_batch)],
        num_cpus=e.resources.get("CPU", 1.0),
        num_gpus=e.resources.get("GPU", 0.0),
        resources=custom or None,
        address=e.address,
        weights_dir=e.weights_dir,
        engine_options={"batch_groups": e.batch_groups},
    )


# engine.kind -> how that kind is built
_KINDS: dict[str, Callable[[EngineSection, _At], Any]] = {
    "in-process": _in_process,
    "fleet": _fleet,
    "urls": _urls,
    "vllm": _vllm,
    "ray": _ray,
}
