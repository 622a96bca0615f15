"""vLLM servers as dew engines.

* :class:`VLLMEngine`: the :class:`~dew.core.Engine` and
  :class:`~dew.core.Publisher` contract over one vLLM server (its module docstring
  says what the server must run with and how a weight push goes);
* :class:`VLLMProcess`: one local vLLM server started from a vLLM environment
  (:func:`vllm_python` finds its interpreter); ``EngineFleet.launch(n,
  engine="vllm", ...)`` starts and supervises several;
* :mod:`dew.serving.vllm.extension`: the worker extension the server loads
  (``--worker-extension-cls``) and, registered by it, dew's backend for vLLM's
  weight-transfer API (``_transfer``): the only parts that run inside vLLM.

:func:`server_args` lists the server flags the engine needs. Names load on first use:
importing this package inside a vLLM worker (for the extension) loads nothing else.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dew.serving.vllm._engine import ON_LOAD, VLLMEngine, server_args
    from dew.serving.vllm._process import VLLMProcess, vllm_python

__all__ = ["ON_LOAD", "VLLMEngine", "VLLMProcess", "server_args", "vllm_python"]

_WHERE = {
    "ON_LOAD": "dew.serving.vllm._engine",
    "VLLMEngine": "dew.serving.vllm._engine",
    "server_args": "dew.serving.vllm._engine",
    "VLLMProcess": "dew.serving.vllm._process",
    "vllm_python": "dew.serving.vllm._process",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
