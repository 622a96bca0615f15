"""The planner's choice for a run in progress (``dew train``'s ``scheduler.policy =
"auto"``): fit the probe steps' records, rank the policies, return the one to adopt.

``dew train`` runs the first ``scheduler.probe_steps`` steps with the config's own
knobs, then calls :func:`choose_policy` on its run folder, writes what it returns to
``plan.json`` and goes on with the chosen knobs from the probe's last checkpoint. The
job package cannot import the planner (it stands a floor below), so the CLI hands this
function to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dew.plan._from_run import fit_lines, rank, table
from dew.plan.cli import default_policies
from dew.plan.fit import fit_run

__all__ = ["Adoption", "choose_policy"]


@dataclass(frozen=True)
class Adoption:
    """The policy to adopt (``knobs``: the scheduler fields it sets) and why."""

    policy: str
    knobs: dict[str, int | None]
    reason: list[str]  # the fit, the ranking and the choice, as ``dew plan`` prints them

    def to_json(self) -> dict[str, Any]:
        return {"policy": self.policy, "knobs": self.knobs, "reason": self.reason}


def choose_policy(run: str | Path, *, skip: int, max_bias: float = 0.02) -> Adoption:
    """Fit ``run``'s records (the first ``skip`` steps left out) and return the
    recommended policy of the planner's grid and the run's own; RunError when the
    records cannot be fitted."""
    fit = fit_run(run, skip=skip)
    ranked = rank(fit, default_policies(fit.tasks, fit.group), max_bias=max_bias)
    best, f = ranked.best, ranked.best_figures
    knobs = {
        "ahead": best.ahead,
        "max_lag": best.max_lag,
        "oversample": best.oversample,
        "admit": best.admit,
    }
    kept = best.name == fit.policy.name
    choice = (
        f"adopted {best.name}"
        + (" (the probe's own)" if kept else f" over the probe's {fit.policy.name}")
        + f": {f.samples_per_s:.3g} samples/s planned against "
        f"{ranked.own.samples_per_s:.3g}, {f.fraction:.2f} of the limit, lag {f.lag:.2f}, "
        f"length bias {f.length_bias:.3f}"
    )
    return Adoption(best.name, knobs, [*fit_lines(fit), *table(ranked, fit), choice])
