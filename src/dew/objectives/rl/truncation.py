"""Truncation policies: what a TRUNCATED rollout trains on.

A policy is a pure function of the rollout returning a :class:`Truncation`. Three are
registered by name in :data:`TRUNCATION_POLICIES`:

* ``mask`` (the scheduler's default): admitted, trains no token, stays out of its
  group's baseline. For agentic limits (context, turns, wall clock), which say nothing
  about the quality of the answer;
* ``score``: trains on its verifier reward; one without a reward cannot be admitted
  and runs again as a failed attempt (cause ``unscored``). For single-turn RLVR, where
  the verifier can judge a cut answer;
* ``zero``: trains with reward 0, a length penalty.

Anywhere a name is accepted, a function with the same signature works too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from dew.core import Rollout
from dew.objectives.rl._registry import display_name, resolve

__all__ = [
    "DEFAULT_TRUNCATION",
    "TRUNCATION_POLICIES",
    "Truncation",
    "TruncationPolicy",
    "policy_name",
    "truncation_policy",
]


@dataclass(frozen=True)
class Truncation:
    """What a truncation policy makes of one TRUNCATED rollout.

    ``trained``: its tokens carry loss and it joins its group's baseline.
    ``reward``: the reward it trains on. ``resubmit``: a cause (``"unscored"``) when
    it cannot be admitted at all and must run again as a failed attempt.
    """

    trained: bool
    reward: float | None
    resubmit: str | None = None


def _mask(r: Rollout) -> Truncation:
    return Truncation(trained=False, reward=r.reward)


def _score(r: Rollout) -> Truncation:
    if r.reward is None:
        return Truncation(trained=False, reward=None, resubmit="unscored")
    return Truncation(trained=True, reward=r.reward)


def _zero(r: Rollout) -> Truncation:
    return Truncation(trained=True, reward=0.0)


TruncationPolicy = Callable[[Rollout], Truncation]

DEFAULT_TRUNCATION = "mask"  # the scheduler's and pack's default

# mask: agentic limits (context, turns, wall clock) say nothing about the policy's answer.
# score: single-turn RLVR, where the verifier can judge a cut answer.
# zero: a length penalty.
TRUNCATION_POLICIES: Mapping[str, TruncationPolicy] = MappingProxyType(
    {"mask": _mask, "score": _score, "zero": _zero}
)


def truncation_policy(policy: str | TruncationPolicy) -> TruncationPolicy:
    """The policy registered under a name, or ``policy`` itself when it is callable.

    A policy of your own is a function ``fn(rollout) -> Truncation`` called once per
    TRUNCATED rollout at admission and again when it is packed; it must be pure.
    """
    return resolve(TRUNCATION_POLICIES, policy, "truncation", "fn(rollout) -> Truncation")


def policy_name(policy: str | TruncationPolicy) -> str:
    """How messages name a truncation policy: its registered name or its function name."""
    return display_name(policy)
