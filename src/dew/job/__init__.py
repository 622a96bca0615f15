"""``dew train``: a run of your own model, dataset and reward functions from one config.

:mod:`dew.job.config` is the config (TOML, checked whole, every field overridable on
the command line); :mod:`dew.job.data` loads and checks the dataset;
:mod:`dew.job.rewards` loads reward functions in TRL's signature or dew's;
:mod:`dew.job.run` puts them together under the scheduler and :func:`dew.train.fit`.
Needs the ``train`` extra (pydantic, datasets).
"""

from dew.job.config import ConfigError, JobConfig, load_config
from dew.job.rewards import boxed_format, exact_answer

__all__ = ["ConfigError", "JobConfig", "boxed_format", "exact_answer", "load_config"]
