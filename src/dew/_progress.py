"""The progress bar of ``dew demo`` and ``dew train``: one tqdm bar fed by fit's records."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["progress_bar"]


def progress_bar(
    total: int, initial: int, desc: str
) -> tuple[Callable[[Mapping[str, Any]], None], Any]:
    """(a ``fit`` log callback, the bar to close): step, mean reward, lag and wait."""
    from tqdm import tqdm

    bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)

    def update(record: Mapping[str, Any]) -> None:
        sched = record.get("scheduler", {})
        reward = sched.get("metrics", {}).get("reward/mean", float("nan"))
        bar.set_postfix(
            step=record["step"],
            reward=f"{reward:.2f}",
            lag=sched.get("lag", "-"),
            wait=f"{sched.get('waited', 0.0):.2f}s",
            refresh=False,
        )
        bar.update(1)

    return update, bar
