"""In-process serving: :class:`RolloutServer` generates for rollouts and takes weight pushes."""

from dew.serving.server import Aborted, RolloutServer

__all__ = ["Aborted", "RolloutServer"]
