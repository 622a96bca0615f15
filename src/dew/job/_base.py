"""What every part of ``dew train``'s config shares: its error and its section base."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["ConfigError", "Section"]


class ConfigError(ValueError):
    """A config that cannot run; the message names the field and the problem."""


class Section(BaseModel):
    """A table of the config: unknown keys refused, types strict, values frozen."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
