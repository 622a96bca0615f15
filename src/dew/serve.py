"""``dew serve``: one engine process over HTTP (see :mod:`dew.serving.http_server`).

Loads a model (``--model`` a Hugging Face checkpoint folder, or ``--demo SIZE`` one of
``dew.demo``'s Qwen2 configs), wraps it in a :class:`~dew.serving.RolloutServer` and
serves it with uvicorn on a socket bound here (so ``--port 0`` works and the real port
is known). Once it listens it prints exactly one line to stdout,
``dew serve: listening on http://HOST:PORT``. SIGTERM or SIGINT aborts the in-flight
requests (each answers the abort shape), stops uvicorn, closes the engine and exits 0.

Binds 127.0.0.1 by default; any other host needs an API key (``--api-key`` or
``DEW_API_KEY``), else it prints one line to stderr and exits 2 before loading anything.
Importing this module is cheap: torch, transformers and fastapi load inside ``main``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from dew._devices import default_device, device_problem
from dew._net import API_KEY_ENV, bind, is_loopback, uvicorn_config, uvicorn_server

__all__ = ["main"]

_DTYPES = ("float32", "bfloat16", "float16")
# Seconds an idle connection stays open (uvicorn's default is 5): well past the clients'
# keep-alive (HTTPEngine lets an idle connection go before uvicorn's default would), since
# a client must never reuse a connection the server has just closed, which would fail a
# /generate it cannot safely resend.
_KEEPALIVE = 120
_GRACEFUL_SHUTDOWN = 10  # seconds the requests under way get once the server stops


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dew serve", description="Serve one continuous-batching engine over HTTP."
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="PATH", help="a Hugging Face checkpoint folder")
    src.add_argument("--demo", metavar="SIZE", help="a dew.demo Qwen2 model: tiny, small, base")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="TCP port; 0 picks a free one (default)")
    p.add_argument("--api-key", default=None, help="bearer token (default: env DEW_API_KEY)")
    p.add_argument(
        "--max-batch", type=int, default=None, help="active requests at most (engine default)"
    )
    p.add_argument("--max-len", type=int, default=None, help="prompt + completion tokens at most")
    p.add_argument("--seed", type=int, default=0, help="sampler seed (and --demo weights)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    p.add_argument("--dtype", default="float32", choices=_DTYPES, help="weights dtype")
    p.add_argument("--version", type=int, default=0, help="version of the initial weights")
    p.add_argument(
        "--weights-dir",
        default=None,
        metavar="PATH",
        help="the only folder weight pushes may read (default: where engines on this "
        "machine write, dew-weights-<uid> in /dev/shm or the temp folder)",
    )
    p.add_argument(
        "--group-timeout",
        type=float,
        default=30.0,
        help="seconds joining a trainer's broadcast group, and each receive in it, may wait "
        f"(default 30); SIGTERM stops the server within {_GRACEFUL_SHUTDOWN} s plus this",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=30.0,
        help="seconds a request may take to arrive whole; a slower client gets a 408 (default 30)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        help="open connections at most; past it a request gets a 503 (default 1024)",
    )
    return p


def _load_model(args: argparse.Namespace, device: str) -> tuple[Any, str, str | None, Any]:
    """(model on ``device``, model_path to report, tokenizer_path or None, the tokenizer
    or None)."""
    import torch

    dtype = getattr(torch, args.dtype)
    if args.demo is not None:
        from dew.demo.model import make_model, make_tokenizer

        model = make_model("qwen2", args.demo, seed=args.seed)
        where = f"dew-demo:qwen2-{args.demo}"
        return model.to(device=device, dtype=dtype), where, None, make_tokenizer()
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = os.path.abspath(args.model)
    if not os.path.isdir(path):
        raise ValueError(f"--model {args.model}: not a checkpoint folder")
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    kind = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", **{kind: dtype})
    has_tokenizer = any(
        os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")
    )
    tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer else None
    return model.to(device).eval(), path, path if has_tokenizer else None, tokenizer


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``dew serve`` with ``argv`` (without the program and subcommand names)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else 2
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if not is_loopback(args.host) and api_key is None:
        print(
            f"dew serve: refusing to bind {args.host}: a non-loopback host needs an API key "
            "(--api-key or DEW_API_KEY)",
            file=sys.stderr,
            flush=True,
        )
        return 2
    if not (args.read_timeout > 0 and args.group_timeout > 0) or args.max_connections < 1:
        print(
            f"dew serve: --read-timeout {args.read_timeout} and --group-timeout "
            f"{args.group_timeout} must be > 0, --max-connections {args.max_connections} >= 1",
            file=sys.stderr,
            flush=True,
        )
        return 2

    stopping: list[int] = []

    def early_stop(sig: int, frame: object) -> None:  # until uvicorn takes the signals
        del frame
        stopping.append(sig)

    previous = {s: signal.signal(s, early_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _serve(args, api_key, stopping)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _serve(args: argparse.Namespace, api_key: str | None, stopping: list[int]) -> int:
    from dew.serving.http_server import build_app
    from dew.serving.server import RolloutServer

    try:
        sock = bind(args.host, args.port, 2048)
    except OSError as exc:
        print(f"dew serve: cannot bind {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    try:
        device = args.device or default_device()
        problem = device_problem(device)
        if problem is not None:
            print(f"dew serve: error: --device {device}: {problem}", file=sys.stderr)
            return 2
        try:
            model, model_path, tokenizer_path, tokenizer = _load_model(args, device)
            # Only what was given: the engine's own defaults are written once, there.
            given = {"max_batch": args.max_batch} if args.max_batch is not None else {}
            engine = RolloutServer(
                model, version=args.version, max_len=args.max_len, seed=args.seed, **given
            )
        except (ValueError, OSError) as exc:
            print(f"dew serve: {exc}", file=sys.stderr)
            return 1
        state = None
        try:
            try:
                app, state = build_app(
                    engine,
                    api_key=api_key,
                    model_path=model_path,
                    tokenizer_path=tokenizer_path,
                    tokenizer=tokenizer,
                    reference=model.state_dict(),
                    weights_dir=args.weights_dir,
                    group_timeout=args.group_timeout,
                )
            except ValueError as exc:  # a default weights folder that is not ours
                print(f"dew serve: {exc}", file=sys.stderr)
                return 1
            del model  # the engine keeps its own copy
            if stopping:
                return 0
            host = f"[{args.host}]" if ":" in args.host else args.host
            url = f"http://{host}:{sock.getsockname()[1]}"

            config = uvicorn_config(
                app,
                read_timeout=args.read_timeout,
                max_connections=args.max_connections,
                graceful_shutdown=_GRACEFUL_SHUTDOWN,
                keep_alive=_KEEPALIVE,
            )
            server = uvicorn_server(
                config,
                on_listening=lambda: print(f"dew serve: listening on {url}", flush=True),
                # each in-flight request answers the abort shape
                on_shutdown=state.abort_all,
            )
            server.run(sockets=[sock])
        finally:
            if state is not None:
                state.close()  # a join under way ends within --group-timeout
            engine.close()
    finally:
        sock.close()
    return 0


def exit_now(code: int) -> None:
    """End the server's process once ``main`` has returned: everything it owns is
    closed by then, and the interpreter's teardown of its heap (the model's libraries)
    takes seconds that a supervisor's SIGTERM would otherwise wait for."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
