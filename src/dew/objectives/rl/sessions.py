"""Sessions as the scheduler admits them: the protocol and the truncation policies.

A session (:class:`Session`, started by a :class:`SessionSource`) resolves to a
:class:`dew.core.Rollout`; how a ``TRUNCATED`` one trains is its truncation policy
(:mod:`dew.objectives.rl.truncation`): ``mask`` (the default) trains none of its tokens
and keeps it out of its group's baseline, ``score`` trains it on its verifier reward
(one without a reward runs again as a failed attempt, cause ``unscored``), ``zero``
trains it with reward 0. A function ``fn(rollout) -> Truncation`` works wherever a
name does.

The records themselves live in :mod:`dew.core`, chains in
:mod:`dew.objectives.rl.chains`, the per-call figures in :mod:`dew.objectives.rl.metrics`.
"""

from dew.core import Session, SessionSource
from dew.objectives.rl.truncation import TRUNCATION_POLICIES, Truncation, truncation_policy

__all__ = ["TRUNCATION_POLICIES", "Session", "SessionSource", "Truncation", "truncation_policy"]
