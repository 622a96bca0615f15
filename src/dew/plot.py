"""Draw a run's records: reward, lag, waiting and throughput per step, into one PNG.

Reads ``records.jsonl`` of a run folder (as written by :func:`dew.train.fit`) and
writes ``plot.png`` beside it. Uses matplotlib's Agg backend, so it needs no display;
matplotlib is imported only when a plot is drawn.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["SERIES", "plot_run", "series"]

Record = Mapping[str, Any]


def _sched(name: str) -> Callable[[Record], float | None]:
    return lambda r: r.get("scheduler", {}).get(name)


def _metric(name: str) -> Callable[[Record], float | None]:
    return lambda r: r.get("scheduler", {}).get("metrics", {}).get(name)


def _throughput(r: Record) -> float | None:
    tokens, seconds = r.get("trained_tokens"), r.get("seconds")
    return None if tokens is None or not seconds else tokens / seconds


# panel title -> [(line label, how to read it from a record)]
SERIES: dict[str, list[tuple[str, Callable[[Record], float | None]]]] = {
    "reward": [("mean reward", _metric("reward/mean"))],
    "lag (updates)": [("oldest call", _sched("lag")), ("token mean", _metric("token_lag_mean"))],
    "waited (s)": [("trainer blocked", _sched("waited")), ("step", lambda r: r.get("seconds"))],
    "throughput (trained tokens/s)": [("tokens/s", _throughput)],
}


def series(
    records: Sequence[Record], read: Callable[[Record], float | None]
) -> tuple[list[int], list[float]]:
    """(steps, values) of the records where ``read`` has a value."""
    steps, values = [], []
    for r in records:
        value = read(r)
        if value is not None:
            steps.append(int(r["step"]))
            values.append(float(value))
    return steps, values


def _moving_mean(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_run(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Draw ``run_dir/records.jsonl`` into ``out`` (default ``run_dir/plot.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    path = run / "records.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no records to plot (is {run} a dew run folder?)")
    records = _read_jsonl(path)
    target = Path(out) if out is not None else run / "plot.png"
    fig, axes = plt.subplots(len(SERIES), 1, figsize=(8, 2.4 * len(SERIES)), sharex=True)
    window = max(1, len(records) // 20)
    for ax, (title, lines) in zip(axes, SERIES.items(), strict=True):
        for label, read in lines:
            steps, values = series(records, read)
            if not steps:
                continue
            (line,) = ax.plot(steps, values, alpha=0.35, linewidth=1)
            if window > 1:
                ax.plot(steps, _moving_mean(values, window), color=line.get_color(), label=label)
            else:
                line.set_label(label)
                line.set_alpha(1.0)
        if title == "reward":
            _evaluations(ax, run / "eval.jsonl")
        ax.set_ylabel(title, fontsize=8)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step (optimizer updates)")
    fig.suptitle(f"{run.name}: {len(records)} steps", fontsize=10)
    fig.tight_layout()
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target


def _evaluations(ax: Any, path: Path) -> None:
    """The evaluations of ``dew train`` (``eval.jsonl``), as points on the reward axis."""
    if not path.is_file():
        return
    evals = _read_jsonl(path)
    steps = [e["step"] for e in evals]
    ax.plot(steps, [e["reward/mean"] for e in evals], "o-", markersize=4, label="eval reward")
    for key in sorted({k for e in evals for k in e if k.startswith("pass@")}):
        ax.plot(steps, [e.get(key) for e in evals], "s--", markersize=4, label=f"eval {key}")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            break  # a torn last line from a killed writer
    return rows
