"""``dew train CONFIG [--print-config] [--resume] [--section.field VALUE ...]``.

Exit status: 0 when the run finished (a summary follows, and ``plot.png`` when the
``plot`` extra is installed); 2 for every config problem, a bad override included (one
line on stderr naming it, and no run folder made: :mod:`dew.job.run` checks everything
first), a run folder that cannot be resumed from, or a disk that fills up (the
checkpoint or export being written is removed; the run resumes once there is room); 3
when training stalled (steps in a row trained nothing: the message names the cause and
the latest failed attempts); 130 on Ctrl-C or SIGTERM (continue with ``--resume``). Heavy
imports wait until a config has been read, so ``dew train --help`` is instant.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dew train",
        description="Train your own model on your own data and reward functions, as one "
        "TOML config says (see examples/ and the README). Any config field can be "
        "overridden as --section.field VALUE, e.g. --scheduler.ahead 2.",
        epilog="A config's sections: [model] [data] [[rewards]] [sampling] [scheduler] "
        "[objective] [training] [engine] [parallel] [output]. `dew train --fields` prints "
        "every field with its type, default and what it does.",
    )
    p.add_argument("config", metavar="CONFIG", nargs="?", help="the run's TOML config")
    p.add_argument(
        "--fields", action="store_true", help="print every config field (type, default, help)"
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--resume", action="store_true", help="continue the run in output.run_dir")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None, *, choose: Callable[..., Any] | None = None) -> int:
    """``dew train``; ``choose``: the planner's choice for ``scheduler.policy = "auto"``
    (see :func:`dew.job.run.train`)."""
    p = parser()
    args, overrides = p.parse_known_args(argv)
    if args.fields:
        from dew.job._fields import fields_text

        print(fields_text(), end="")
        return 0
    if args.config is None:
        p.error("CONFIG is required (or --fields)")
    from dew._checkpoint import NO_SPACE
    from dew.job.config import ConfigError, load_config
    from dew.train import CheckpointError, TrainingStalled

    config = None
    started = time.monotonic()
    try:
        config = load_config(args.config, overrides)
        if args.print_config:
            print(config.to_toml(), end="")
            return 0
        from dew.job.run import prepare, train

        prepared = prepare(config, resume=args.resume)
        train(prepared, resume=args.resume, progress=not args.no_progress, choose=choose)
    except (ConfigError, CheckpointError) as exc:  # the config or the run folder at fault
        print(f"dew train: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno not in NO_SPACE:
            raise
        # Records and logs written as the run goes: the run can resume once there is room.
        print(
            f"dew train: error: {exc.filename or ''}: no space left on the device; free "
            "some, then continue with --resume",
            file=sys.stderr,
        )
        return 2
    except TrainingStalled as exc:  # every rollout failing or masked: the data or rewards
        print(f"dew train: stopped: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (dew.cli): engines stopped on the way
        where = "" if config is None else f" ({config.output.run_dir})"
        print(
            f"dew train: interrupted; continue from the last checkpoint with --resume{where}",
            file=sys.stderr,
        )
        return 130
    if os.environ.get("RANK", "0") == "0":  # under torchrun: one summary for the job
        _summary(Path(config.output.run_dir), time.monotonic() - started)
    return 0


def _summary(run: Path, seconds: float) -> None:
    from dew.job._report import say, summary

    for line in summary(run, seconds):
        say(line)
    try:
        from dew.plot import plot_run

        drawn = f"plot in {plot_run(run)}"
    except ImportError:  # the plot extra is not installed
        drawn = "no plot (pip install 'dew[plot]' to draw one)"
    say(f"done; exported to {run / 'export'}; {drawn}")


if __name__ == "__main__":
    sys.exit(main())
