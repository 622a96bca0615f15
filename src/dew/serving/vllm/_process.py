"""One local vLLM server process, started from a vLLM environment's interpreter.

vLLM pins its own torch and transformers, so it lives in an environment of its own
(``make vllm-env`` builds one in ``.venv-vllm``): a :class:`VLLMProcess` runs that
environment's ``python -m vllm.entrypoints.openai.api_server`` with the flags and
environment a :class:`~dew.serving.vllm.VLLMEngine` needs, on 127.0.0.1 and a port
free when it starts (a restart takes a new one), and is ready once ``/health`` answers.

dew's worker extension must be importable there: the process gets a ``PYTHONPATH`` of
one private folder holding only a link to this dew package, so the server runs the
trainer's own extension without installing dew into the vLLM environment, and nothing
else of the trainer's environment shadows vLLM's packages.

vLLM runs its engine in child processes; the server is started in a session of its own
and stopped as a group (SIGTERM, SIGKILL after a grace period), so no engine process
outlives it. Only that group, whose id is the pid started here, is ever signalled.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from dew._watchdog import unwatch, watch
from dew.core import EngineError
from dew.serving.vllm._engine import free_port, server_args
from dew.serving.vllm.extension import WEIGHTS_DIR_ENV

__all__ = ["PYTHON_ENV", "VLLMProcess", "vllm_python"]

PYTHON_ENV = "DEW_VLLM_PYTHON"


def vllm_python(python: str | os.PathLike[str] | None = None) -> Path:
    """The vLLM environment's interpreter: ``python``, else ``$DEW_VLLM_PYTHON``."""
    chosen = python if python is not None else os.environ.get(PYTHON_ENV)
    if not chosen:
        raise ValueError(
            f"no vLLM environment: pass python= (its interpreter) or set {PYTHON_ENV}; "
            "`make vllm-env` builds one in .venv-vllm"
        )
    path = Path(chosen)
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ValueError(f"{path} is not an executable Python interpreter of a vLLM environment")
    return path


class VLLMProcess:
    """A vLLM server serving ``model`` (a Hugging Face folder) from the environment of
    ``python``; ``args`` are more server flags (``--dtype``, ``--max-model-len``, ...),
    ``env`` more environment variables, ``weights_dir`` the only folder its weight
    pushes may read, ``host`` the address it listens on. Same surface as the fleet's
    local ``dew serve`` processes: :meth:`start`, :meth:`alive`, :meth:`stop`,
    :meth:`reset`, :meth:`tail`, ``proc``."""

    def __init__(
        self,
        python: str | os.PathLike[str],
        model: str | os.PathLike[str],
        *,
        weights_dir: str | os.PathLike[str],
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.python = Path(python)
        self.host = host
        self.model = str(Path(model).resolve())
        self.args = [str(a) for a in args]
        self.env = dict(env or {})
        self.weights_dir = str(Path(weights_dir).resolve())
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: IO[bytes] | None = None
        self.dog: subprocess.Popen[bytes] | None = None  # ends it if this process dies
        self._path_dir: str | None = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, deadline: float, stopping: threading.Event) -> str:
        """Start the server; its URL once ``/health`` answers within ``deadline`` s."""
        port = free_port(self.host)
        self._path_dir = tempfile.mkdtemp(prefix="dew-vllm-path-")
        os.symlink(Path(__file__).resolve().parents[2], Path(self._path_dir) / "dew")
        argv = [str(self.python), "-m", "vllm.entrypoints.openai.api_server"]
        argv += ["--model", self.model, "--host", self.host, "--port", str(port)]
        argv += [*server_args(), *self.args]
        environ = {**os.environ, **self.env}
        environ["VLLM_SERVER_DEV_MODE"] = "1"
        environ["PYTHONPATH"] = self._path_dir
        environ[WEIGHTS_DIR_ENV] = self.weights_dir
        self.log = tempfile.TemporaryFile()  # a file: a chatty server never blocks on a pipe
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=environ,
            start_new_session=True,
        )
        unwatch(self.dog)
        self.dog = watch(self.proc.pid, group=True)  # vLLM's engine processes too
        url = f"http://{self.host}:{port}"
        end = time.monotonic() + deadline
        while not _healthy(url):
            if self.proc.poll() is not None:
                tail = self.tail()
                self.stop(0.0)
                raise EngineError(f"vLLM exited ({self.proc.returncode}): {tail}")
            if stopping.is_set() or time.monotonic() > end:
                tail = self.tail()
                self.stop(0.0)
                raise EngineError(f"vLLM did not answer /health within {deadline:g}s: {tail}")
            stopping.wait(0.2)
        return url

    def tail(self) -> str:
        if self.log is None or self.log.closed:
            return ""
        self.log.seek(0)
        return self.log.read()[-2000:].decode(errors="replace")

    def reset(self) -> None:
        self.stop(0.0)

    def stop(self, grace: float) -> None:
        """SIGTERM (and SIGCONT, so a stopped process can take it) to the server's
        group, SIGKILL to the group after ``grace`` seconds."""
        proc = self.proc
        if proc is not None:
            _stop_group(proc, grace)
        unwatch(self.dog)
        self.dog = None
        if self.log is not None:
            self.log.close()
        if self._path_dir is not None:
            shutil.rmtree(self._path_dir, ignore_errors=True)
            self._path_dir = None


def _stop_group(proc: subprocess.Popen[bytes], grace: float) -> None:
    def signal_group(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)

    if proc.poll() is None:
        signal_group(signal.SIGTERM)
        signal_group(signal.SIGCONT)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    signal_group(signal.SIGKILL)  # the engine's children too, even once the server is gone
    proc.wait()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2.0) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False
