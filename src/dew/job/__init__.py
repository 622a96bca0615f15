"""``dew train``: a run of your own model, dataset and reward functions from one config.

:mod:`dew.job.config` is the config (TOML, checked whole, every field overridable on
the command line); :mod:`dew.job.data` loads and checks the dataset;
:mod:`dew.job.rewards` loads reward functions in TRL's signature or dew's, and runs
them in worker processes of their own; :mod:`dew.job.run` puts them together under the
scheduler and :func:`dew.train.fit`. Needs the ``train`` extra (pydantic, datasets).

Names load on first use, so a reward worker process that imports
:mod:`dew.job.rewards` does not pay for the config (pydantic, torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dew.job.config import ConfigError, JobConfig, load_config
    from dew.job.rewards import boxed_format, exact_answer

__all__ = ["ConfigError", "JobConfig", "boxed_format", "exact_answer", "load_config"]

_WHERE = {
    "ConfigError": "dew.job.config",
    "JobConfig": "dew.job.config",
    "load_config": "dew.job.config",
    "boxed_format": "dew.job.rewards",
    "exact_answer": "dew.job.rewards",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
