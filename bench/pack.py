"""Throughput of ``dew.objectives.rl.pack.pack`` on a realistic batch.

The batch: groups of 8 rollouts with lognormal prompt and completion lengths (a heavy
tail, as in RLVR traces), a mix of statuses (some length truncations, some agent
errors) and a share of multi-turn rollouts, most of whose later prompts extend the
chain (observation tokens in between) and some of which restart it. Token sequences are
built twice, as Python lists (what a JSON or HTTP engine hands over) and as numpy arrays
(what a tensor engine hands over), and each form is packed ``--number`` times per
repeat. The figure is non-padding tokens packed per second, median over ``--repeats``.

Run pinned to one core, as the target is stated per core::

    taskset -c 0 .venv/bin/python bench/pack.py --write

``--write`` replaces the ``## pack`` section of bench/RESULTS.md (other sections are
kept). ``--tiny`` packs a few rollouts once and writes nothing (a smoke test).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_results.py
import _results
from _results import machine, write_section, write_summary_row
from dew.core import Call, Rollout, RolloutKey, Status, Task
from dew.objectives.rl.chains import chains
from dew.objectives.rl.pack import pack

RESULTS = _results.RESULTS
GROUP = 8
VOCAB = 150_000
TARGET = 5_000_000  # tokens/s on one core, every form (DESIGN.md, performance targets)


def _lognormal(rng: np.random.Generator, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(np.clip(rng.lognormal(np.log(median), sigma), lo, hi))


def _seq(rng: np.random.Generator, n: int, as_list: bool) -> np.ndarray | list[int]:
    ids = rng.integers(0, VOCAB, n, dtype=np.int64)
    return ids.tolist() if as_list else ids


def _calls(
    rng: np.random.Generator,
    turns: int,
    max_chain: int,
    as_list: bool,
    top_k: int,
    srng: np.random.Generator,
) -> list[Call]:
    """One rollout's calls: later prompts mostly extend the chain, one in five restarts it.

    With ``top_k``, each completion token carries a ``[top_k]`` support row (the sampled
    id first), drawn from ``srng`` so the lengths match the runs without support.
    """
    calls: list[Call] = []
    history: np.ndarray = np.empty(0, dtype=np.int64)
    budget = max_chain  # keeps every chain within the row width
    for turn in range(turns):
        restart = turn > 0 and rng.random() < 0.2
        if turn == 0 or restart:
            history = np.empty(0, dtype=np.int64)
            budget = max_chain
            extra = _lognormal(rng, 256, 0.5, 16, 2048)  # system + user prompt
        else:
            extra = _lognormal(rng, 96, 0.8, 4, 1024)  # observation / tool result
        m = _lognormal(rng, 600 // turns, 1.0, 1, 8192)
        extra, m = min(extra, budget // 2), min(m, budget - min(extra, budget // 2))
        if m < 1:
            break
        budget -= extra + m
        prompt = np.concatenate([history, rng.integers(0, VOCAB, extra, dtype=np.int64)])
        completion = rng.integers(0, VOCAB, m, dtype=np.int64)
        log_probs = -rng.exponential(0.5, m)
        support = None
        if top_k:
            others = srng.integers(0, VOCAB, (m, top_k - 1), dtype=np.int64)
            support = np.concatenate([completion[:, None], others], axis=1)  # [m, top_k]
        calls.append(
            Call(
                prompt=prompt.tolist() if as_list else prompt,
                completion=completion.tolist() if as_list else completion,
                log_probs=log_probs.tolist() if as_list else log_probs,
                version=7 + int(rng.integers(0, 2)),
                finish_reason="stop",
                support=support,
            )
        )
        history = np.concatenate([prompt, completion])
    return calls


def make_groups(
    n_groups: int, width: int, *, seed: int, as_list: bool, top_k: int = 0
) -> list[list[Rollout]]:
    rng = np.random.default_rng(seed)
    srng = np.random.default_rng(seed + 1)
    task = Task("bench")
    groups: list[list[Rollout]] = []
    for g in range(n_groups):
        members: list[Rollout] = []
        for s in range(GROUP):
            turns = int(rng.choice([1, 2, 3, 5], p=[0.75, 0.1, 0.1, 0.05]))
            calls = _calls(rng, turns, width, as_list, top_k, srng)
            u = rng.random()
            key = RolloutKey(g, s, 0)
            reward = float(rng.random() < 0.5)
            if u < 0.08:
                members.append(
                    Rollout(key, task, Status.TRUNCATED, calls, reward=reward, truncation="length")
                )
            elif u < 0.12:
                members.append(Rollout(key, task, Status.AGENT_ERROR, calls, reward=0.0))
            else:
                members.append(Rollout(key, task, Status.COMPLETED, calls, reward=reward))
        groups.append(members)
    return groups


def measure(
    groups: list[list[Rollout]],
    rows: int,
    width: int,
    repeats: int,
    number: int,
    support_capacity: int | None = None,
) -> tuple[float, int, float, int]:
    """(median tokens/s, tokens per pack, padding share, groups cut)."""
    kw = {"rows": rows, "width": width, "support_capacity": support_capacity}
    batch, stats = pack(groups, **kw)
    del batch
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            pack(groups, **kw)
        rates.append(stats.tokens * number / (time.perf_counter() - t0))
    return statistics.median(rates), stats.tokens, stats.padding_share, stats.groups_cut


def _command() -> str:
    cmd = " ".join([".venv/bin/python", "bench/pack.py", *sys.argv[1:]])
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return f"taskset -c {cpus[0]} {cmd}" if len(cpus) == 1 else cmd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=64, help="groups of 8 rollouts (default 64)")
    ap.add_argument("--width", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--number", type=int, default=3, help="packs per repeat")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top-k", type=int, default=20, help="support size of the third run")
    ap.add_argument("--tiny", action="store_true", help="a few rollouts, one repeat, no write")
    ap.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args()
    if args.tiny:
        args.groups, args.width, args.repeats, args.number, args.write = 2, 8192, 1, 1, False

    lines = []
    measured: list[tuple[str, float]] = []
    forms = [("lists", True, 0), ("numpy arrays", False, 0)]
    if args.top_k:
        forms.append((f"numpy arrays + top-{args.top_k} support", False, args.top_k))
    for form, as_list, top_k in forms:
        groups = make_groups(args.groups, args.width, seed=args.seed, as_list=as_list, top_k=top_k)
        total = sum(len(ch.tokens) for g in groups for r in g for ch in chains(r.calls))
        rows = -(-int(total * 1.1) // args.width)  # room for everything, some padding
        multi = sum(len(r.calls) > 1 for g in groups for r in g)
        capacity = args.width * top_k if top_k else None  # room for a full row of tokens
        rate, tokens, padding, cut = measure(
            groups, rows, args.width, args.repeats, args.number, capacity
        )
        line = (
            f"{form}: {rate:,.0f} tokens/s ({args.groups * GROUP} rollouts, {multi} multi-turn, "
            f"{tokens:,} tokens into [{rows}, {args.width}], padding {padding:.1%}, "
            f"{cut} groups cut; median of {args.repeats} repeats x {args.number} packs)"
        )
        print(line, flush=True)
        lines.append(line)
        measured.append((form, rate))

    if args.write:
        host = machine(f"numpy {np.__version__}")
        date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
        body = "\n".join(f"- {line}" for line in lines)
        support = (
            f"; the third run adds a top-{args.top_k} support row per completion token "
            f"(support_capacity = width x {args.top_k})"
            if args.top_k
            else ""
        )
        write_section(
            "## pack\n\n"
            "`pack()` of groups of 8 rollouts with lognormal prompt/completion lengths and a "
            "share of multi-turn rollouts; non-padding tokens packed per second on one core "
            f"(target: {TARGET:,}). Token sequences handed over as Python lists and as numpy "
            f"arrays{support}.\n\n"
            f"- command: `{_command()}`\n"
            f"- machine: {host}\n"
            f"- date: {date}\n"
            f"{body}\n"
        )
        slowest = min(rate for _, rate in measured)
        write_summary_row(
            "pack",
            " / ".join(f"{form} {rate:,.0f}" for form, rate in measured) + " tokens/s on one core",
            f"{TARGET:,} tokens/s",
            "met" if slowest >= TARGET else f"NOT met ({slowest:,.0f})",
        )
        print(f"wrote the pack section of {RESULTS}")


if __name__ == "__main__":
    main()
