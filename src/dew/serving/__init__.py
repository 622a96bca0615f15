"""Engines: where completions come from and where the trainer's weights go.

* :class:`RolloutServer`: the in-process continuous-batching engine;
* ``dew serve`` (:mod:`dew.serving.http_server`): that engine in its own process, over
  HTTP, speaking SGLang's native API where the two overlap;
* :class:`HTTPEngine` (:mod:`dew.serving.http_engine`): the client of one such server;
* :mod:`dew.serving.weights`: weights files (atomic safetensors with a checksum) and a
  ``torch.distributed`` broadcast path.

Every engine implements :class:`dew.core.Engine` and :class:`dew.core.Publisher`, the
only things sources and the scheduler know of it. Names load on first use, so
importing this package costs nothing until one is used (the HTTP parts need the
``serve`` extra).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dew.serving.http_engine import HTTPEngine
    from dew.serving.server import RolloutServer

__all__ = ["HTTPEngine", "RolloutServer"]

_WHERE = {"HTTPEngine": "dew.serving.http_engine", "RolloutServer": "dew.serving.server"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
