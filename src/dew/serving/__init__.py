"""Engines: :class:`RolloutServer` generates for rollouts and takes weight pushes.

Every engine implements :class:`dew.core.Engine` (and :class:`dew.core.Publisher`), the
only thing sources know of it.
"""

from dew.serving.server import RolloutServer

__all__ = ["RolloutServer"]
