"""The ``dew`` command: ``dew demo`` trains the example task, ``dew plot`` redraws a run,
``dew plan`` predicts how each scheduling policy would use an engine, ``dew serve`` runs
an engine process over HTTP.

Parsing imports nothing heavy: torch, transformers and matplotlib load only inside
the command that needs them, so ``dew --help`` answers at once.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

__all__ = ["main", "parser"]


def _demo(args: argparse.Namespace) -> int:
    from dew.demo.run import DemoConfig, DemoError, run_demo
    from dew.train import CheckpointError

    overrides = {
        name: getattr(args, name)
        for name in (
            "steps",
            "seed",
            "size",
            "lr",
            "group_size",
            "batch_size",
            "max_tokens",
            "engines",
            "harness_processes",
            "tensor",
            "ahead",
            "max_lag",
            "oversample",
            "admit",
        )
        if getattr(args, name) is not None
    }
    try:
        config = DemoConfig.for_task(args.task, **overrides)
        result = run_demo(
            config if args.resume is None or overrides else None,
            run_dir=args.run_dir,
            resume=args.resume,
            progress=not args.no_progress,
        )
    except (ValueError, DemoError, CheckpointError) as exc:  # a config or run folder at fault
        print(f"dew demo: error: {exc}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":  # under torchrun: one summary for the job
        print(result.summary())
    return 0


def _plot(args: argparse.Namespace) -> int:
    from dew.plot import plot_run

    try:
        print(plot_run(args.run_dir, args.out))
    except FileNotFoundError as exc:
        raise SystemExit(f"dew plot: error: {exc}") from None
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dew",
        description="dew: asynchronous RL post-training of language models.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="train a tiny model on an example task (GRPO with the RolloutScheduler)",
        description="Train a tiny model from scratch on an example task with GRPO, the "
        "RolloutScheduler (ahead 1) and the in-process RolloutServer. Writes a run folder "
        "with records.jsonl, the checkpoint and plot.png.",
    )
    demo.add_argument(
        "--task",
        default="single",
        help="single (single-turn verifiable task, default), guess (multi-turn "
        "environment), agent (an OpenAI-client harness through the gateway), tail (the "
        "heavy-tailed workload: long-tailed answer lengths, slow verifiers) or tail-turns "
        "(its multi-turn variant, with slow tool calls between turns)",
    )
    demo.add_argument("--run-dir", default=None, help="run folder (default runs/demo-<time>)")
    demo.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue this run")
    demo.add_argument("--steps", type=int, default=None, help="total optimizer updates")
    demo.add_argument("--seed", type=int, default=None)
    demo.add_argument("--size", default=None, help="model size: tiny, small or base")
    demo.add_argument("--lr", type=float, default=None, help="learning rate")
    demo.add_argument("--group-size", type=int, default=None, help="rollouts per task")
    demo.add_argument("--batch-size", type=int, default=None, help="tasks per step")
    demo.add_argument("--max-tokens", type=int, default=None, help="completion token limit")
    demo.add_argument(
        "--engines",
        type=int,
        default=None,
        help="serve rollouts from a fleet of N local `dew serve` processes (default: one "
        "engine in this process)",
    )
    demo.add_argument(
        "--harness-processes",
        type=int,
        default=None,
        help="agent task: run the agent in N harness processes (the task's default: 1; "
        "0 runs it on the source's threads in this process)",
    )
    demo.add_argument(
        "--tensor",
        type=int,
        default=None,
        help="under torchrun: processes that split each layer (tensor parallelism); the "
        "others form the data axis, along which the model is sharded (default 1)",
    )
    demo.add_argument(
        "--ahead", type=int, default=None, help="task batches in flight ahead of the trainer"
    )
    demo.add_argument(
        "--max-lag", type=int, default=None, help="oldest weights a trained rollout may use"
    )
    demo.add_argument(
        "--oversample", type=int, default=None, help="extra samples per group; the slowest are cut"
    )
    demo.add_argument(
        "--admit", type=int, default=None, help="groups admitted per step; the rest are cut"
    )
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(run=_demo)

    plot = sub.add_parser("plot", help="redraw a run's plot.png from its records.jsonl")
    plot.add_argument("run_dir", metavar="RUN_DIR")
    plot.add_argument("--out", default=None, help="output file (default RUN_DIR/plot.png)")
    plot.set_defaults(run=_plot)

    plan = sub.add_parser(
        "plan",
        add_help=False,  # `dew plan --help` is the planner's own help
        help="predict each scheduling policy's throughput and lag (dew plan --help)",
    )
    plan.add_argument("args", nargs=argparse.REMAINDER)  # main() hands these to the planner

    serve = sub.add_parser(
        "serve",
        add_help=False,  # `dew serve --help` is the server's own help
        help="serve a model's continuous-batching engine over HTTP (dew serve --help)",
    )
    serve.add_argument("args", nargs=argparse.REMAINDER)  # main() hands these to dew.serve

    train = sub.add_parser(
        "train",
        add_help=False,  # `dew train --help` is the job's own help
        help="train your own model, data and rewards from a TOML config (dew train --help)",
    )
    train.add_argument("args", nargs=argparse.REMAINDER)  # main() hands these to dew.job
    return p


def main(argv: Sequence[str] | None = None) -> int:
    program = argv is None  # run as the program (dew, python -m dew.cli), not called
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        # argparse cannot hand a subcommand's leading options through untouched.
        from dew.plan.cli import main as plan_main

        return plan_main(argv[1:])
    if argv[:1] == ["serve"]:
        from dew.serve import exit_now
        from dew.serve import main as serve_main

        code = serve_main(argv[1:])
        if program:
            exit_now(code)
        return code
    if argv[:1] == ["train"]:
        from dew.job.cli import main as train_main

        with _terminate_as_interrupt():
            return train_main(argv[1:], choose=_choose_policy)
    args = parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    with _terminate_as_interrupt():
        return run(args)


def _choose_policy(run: object, *, skip: int) -> object:
    """The planner's choice for ``dew train``'s ``scheduler.policy = "auto"`` (the job
    package stands below the planner, so the command hands it over)."""
    from dew.plan.auto import choose_policy

    return choose_policy(run, skip=skip)  # type: ignore[arg-type]


@contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (what a cluster scheduler sends) ends a run as Ctrl-C does: the engines
    it launched are stopped and its weights folder removed on the way out."""

    def interrupt(sig: int, frame: object) -> None:
        del sig, frame
        raise KeyboardInterrupt("SIGTERM")

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
