"""Advantage estimators: a group's rewards -> per-member advantages.

An estimator is a pure function ``fn(rewards, trained) -> advantages`` over one group:
``rewards`` [n] float64 (each member's reward; a member that does not train, such as a
masked truncation, has some placeholder), ``trained`` [n] bool, result [n]. Members
that do not train stay out of the baseline and get advantage 0. Registered by name in
:data:`ESTIMATORS`:

* ``group``: reward minus the mean over the group's trained members;
* ``group_std``: that, divided by the trained members' population standard deviation
  (plus a small epsilon), as the original GRPO paper does;
* ``rloo``: reward minus the mean of the *other* trained members (leave-one-out).

A user's function with the same signature works wherever a name does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import numpy as np

from dew.objectives.rl._registry import display_name, resolve

__all__ = [
    "DEFAULT_ESTIMATOR",
    "ESTIMATORS",
    "Estimator",
    "advantage_estimator",
    "advantages",
    "estimator_name",
]

_STD_EPS = 1e-6


def _group(rewards: np.ndarray, trained: np.ndarray) -> np.ndarray:
    # rewards, trained: [n] -> [n]. Run once per group of every batch, so the mean is
    # taken as ndarray.mean takes it (a pairwise sum over the count) without its Python
    # wrapper, and the count with count_nonzero.
    k = np.count_nonzero(trained)
    if k == 0:
        return np.zeros(len(rewards))
    mean = np.add.reduce(rewards[trained]) / k
    return np.where(trained, rewards - mean, 0.0)


def _group_std(rewards: np.ndarray, trained: np.ndarray) -> np.ndarray:
    # rewards, trained: [n] -> [n]
    if not trained.any():
        return np.zeros(len(rewards))
    std = rewards[trained].std()  # population std: defined for a single member
    return _group(rewards, trained) / (std + _STD_EPS)


def _rloo(rewards: np.ndarray, trained: np.ndarray) -> np.ndarray:
    # rewards, trained: [n] -> [n]; baseline of member i is the mean of the other trained ones
    k = int(trained.sum())
    if k < 2:
        return np.zeros(len(rewards))
    total = rewards[trained].sum()
    return np.where(trained, rewards - (total - rewards) / (k - 1), 0.0)


Estimator = Callable[[np.ndarray, np.ndarray], np.ndarray]

DEFAULT_ESTIMATOR = "group"  # the scheduler's and pack's default

ESTIMATORS: Mapping[str, Estimator] = MappingProxyType(
    {"group": _group, "group_std": _group_std, "rloo": _rloo}
)


def advantage_estimator(estimator: str | Estimator) -> Estimator:
    """The estimator registered under a name, or ``estimator`` itself when callable."""
    return resolve(ESTIMATORS, estimator, "estimator", "fn(rewards, trained) -> advantages")


def estimator_name(estimator: str | Estimator) -> str:
    """How messages name an estimator: its registered name or its function name."""
    return display_name(estimator)


def advantages(estimator: str | Estimator, rewards: np.ndarray, trained: np.ndarray) -> np.ndarray:
    """``estimator``'s advantages for one group, checked: shape [n], finite, and 0 on
    members that do not train (a user's function is held to what the built-ins do)."""
    # rewards: [n] float64, trained: [n] bool -> [n] float64
    fn = advantage_estimator(estimator)
    out = np.asarray(fn(rewards, trained), dtype=np.float64)
    if out.shape != rewards.shape:
        raise ValueError(
            f"estimator {estimator_name(estimator)!r} returned shape {out.shape} for a group "
            f"of {len(rewards)}; expected {rewards.shape}"
        )
    if not np.logical_and.reduce(np.isfinite(out), axis=None):  # .all(), without its wrapper
        raise ValueError(
            f"estimator {estimator_name(estimator)!r} returned a non-finite advantage: {out}"
        )
    return np.where(trained, out, 0.0)
