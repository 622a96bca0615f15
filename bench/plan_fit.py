"""Fit ``dew plan``'s engine model to the in-process RolloutServer on this machine.

``dew plan`` models one engine iteration as ``a + b * active`` seconds. This script
measures it: for each count of concurrent requests it times a short and a long decode
(same prompts, no stop token) on a fresh server, three times each, so that the
difference of the fastest of each is pure decode iterations, and divides by the extra
tokens per request. A least-squares line through
those per-iteration times gives ``a`` (the fixed cost: Python, kernel launches, the
weights read once per step) and ``b`` (the cost of one more sequence in the batch).

It prints the points, the fit and the ``--a/--b`` flags to pass to ``dew plan``; it
writes nothing (``--tiny``: two points, seconds). All
torch work runs on one short-lived thread (see ``bench/engine.py``'s ``_in_thread``).

    .venv/bin/python bench/plan_fit.py --size tiny
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np

from dew.core import SamplingParams
from dew.demo.model import make_model
from dew.serving import RolloutServer


def _decode(server: RolloutServer, prompts: list[list[int]], tokens: int) -> float:
    """Seconds for every prompt to generate ``tokens`` tokens, all submitted at once."""
    params = SamplingParams(max_tokens=tokens, temperature=1.0, stop_ids=())
    t0 = time.perf_counter()
    calls = [server.submit(p, params) for p in prompts]
    for c in calls:
        c.result(timeout=600)
    return time.perf_counter() - t0


def iteration_seconds(size: str, active: int, short: int, long: int, seed: int) -> float:
    """Seconds per decode iteration with ``active`` sequences in the batch."""
    rng = np.random.default_rng(seed)
    model = make_model(size=size, seed=seed, max_positions=64 + long)
    vocab = int(model.config.vocab_size)
    prompts = [rng.integers(4, vocab, size=16).tolist() for _ in range(active)]
    with RolloutServer(model, max_batch=max(active, 1), seed=seed) as server:
        _decode(server, prompts, short)  # warm-up
        shorts, longs = [], []
        for _ in range(3):  # alternating, so both see the same background load
            shorts.append(_decode(server, prompts, short))
            longs.append(_decode(server, prompts, long))
    # The fastest of each, not the fastest difference: a difference whose short decode
    # was slowed by other work comes out too small, on a loaded machine even negative.
    return (min(longs) - min(shorts)) / (long - short)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="tiny", help="demo model size")
    ap.add_argument("--active", default="1,4,16,64", help="concurrent requests per point")
    ap.add_argument("--short", type=int, default=8, help="tokens of the short decode")
    ap.add_argument("--long", type=int, default=72, help="tokens of the long decode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="two points, short decodes")
    args = ap.parse_args()
    if args.tiny:
        args.active, args.short, args.long = "1,4", 4, 12
    if not 0 < args.short < args.long:
        raise SystemExit(f"need 0 < --short < --long, got {args.short} and {args.long}")
    counts = [int(x) for x in args.active.split(",")]
    times: list[float] = []

    def run() -> None:
        for n in counts:
            times.append(iteration_seconds(args.size, n, args.short, args.long, args.seed))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if len(times) != len(counts):
        raise SystemExit("the measurement failed (see the traceback above)")
    b, a = np.polyfit(counts, times, 1)
    for n, t in zip(counts, times, strict=True):
        print(f"active {n:>4}: {t * 1e3:7.3f} ms per iteration (fit {(a + b * n) * 1e3:7.3f})")
    print(f"a = {a:.3g} s per iteration, b = {b:.3g} s per active sequence")
    print(f"dew plan ... --a {a:.3g} --b {b:.3g}")


if __name__ == "__main__":
    main()
