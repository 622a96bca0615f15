"""``dew train CONFIG [--print-config] [--resume] [--section.field VALUE ...]``.

Every config problem, a bad override included, is one line on stderr naming it, exit
status 2, and no run folder made (:mod:`dew.job.run` checks everything first). So is
a run folder that cannot be resumed from, or a disk that fills up (the checkpoint or
export being written is removed; the run resumes once there is room). Heavy
imports wait until a config has been read, so ``dew train --help`` is instant.
"""

from __future__ import annotations

import argparse
import errno
import sys
from collections.abc import Sequence

__all__ = ["main"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dew train",
        description="Train your own model on your own data and reward functions, as one "
        "TOML config says (see examples/ and the README). Any config field can be "
        "overridden as --section.field VALUE, e.g. --scheduler.ahead 2.",
    )
    p.add_argument("config", metavar="CONFIG", help="the run's TOML config")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--resume", action="store_true", help="continue the run in output.run_dir")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args, overrides = parser().parse_known_args(argv)
    from dew.job.config import ConfigError, load_config
    from dew.train import CheckpointError

    config = None
    try:
        config = load_config(args.config, overrides)
        if args.print_config:
            print(config.to_toml(), end="")
            return 0
        from dew.job.run import prepare, train

        prepared = prepare(config)
        train(prepared, resume=args.resume, progress=not args.no_progress)
    except (ConfigError, CheckpointError) as exc:  # the config or the run folder at fault
        print(f"dew train: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # Records and logs written as the run goes: the run can resume once there is room.
        print(
            f"dew train: error: {exc.filename or ''}: no space left on the device; free "
            "some, then continue with --resume",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (dew.cli): engines stopped on the way
        where = "" if config is None else f" ({config.output.run_dir})"
        print(
            f"dew train: interrupted; continue from the last checkpoint with --resume{where}",
            file=sys.stderr,
        )
        return 130
    print(f"dew train: done; exported to {config.output.run_dir}/export", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
