"""Engine benchmark: RolloutServer against ``model.generate`` on the same static batch.

Throughput: 64 prompts (random demo-vocabulary ids, 8-24 tokens) x 32 new tokens,
sampled at temperature 1 with no stop token, on two model sizes. ``model.generate`` gets
the batch left-padded in one call; the server gets it as 64 concurrent ``generate``
calls from 64 threads. Both are timed after a warm-up run, ``--repeats`` times, in
completion tokens per second. The headline figure is each side's best run: on a machine
shared with other jobs, background load only ever slows a run down, so the fastest run
is the closest to the code's own speed (the median and the range are printed beside it).

Latency: ``--long`` requests of ``--long-tokens`` tokens (default 16 of 400) run; once
all are decoding, a short request (8 tokens) is submitted. Reported: its latency beside
the long ones, its latency on an idle server, and the time the long batch takes to
finish (what a static batcher would make the short request wait first).

Lognormal batch (a heavy-tailed RL workload): 64 prompts (8-24 tokens) whose completion
lengths are lognormal (median 24, sigma 0.9, capped at 192); each request stops at its
own length (per-request ``max_tokens``). ``model.generate`` takes the batch in one call
and, padding every row to the longest, runs all rows to the longest length; both sides
are credited with the same useful tokens (the sum of the lengths). The server gets the
batch as 64 ``submit`` calls, as a source sends them.

GRPO groups: 8 prompts (32-64 tokens) x 8 samples, lognormal lengths as above, the 8
samples of a prompt submitted one after another with the same prompt (``affinity`` =
the group). Reported beside the tokens/s: the server's prompt tokens computed / served
(``RolloutServer.stats()``), with prefix sharing on and off.

Runs alternate (model.generate, then a fresh server, per repeat) so both see the same
background load on a shared machine; all torch work happens off the main thread (see
``_in_thread`` for why).

``--write`` replaces the ``## engine`` section of bench/RESULTS.md (other sections are
kept); ``--tiny`` is a seconds-long smoke run that writes nothing.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_results.py
import _results
from _results import command_line, machine, write_section, write_summary_row
from dew.core import SamplingParams
from dew.demo.model import make_model
from dew.serving import RolloutServer

RESULTS = _results.RESULTS
T = TypeVar("T")


def _prompts(count: int, vocab: int, seed: int, short: int, long: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(short, long + 1, (count,), generator=g).tolist()
    return [torch.randint(6, vocab, (n,), generator=g).tolist() for n in lens]


def _warm_up_prompts(prompts: list[list[int]], vocab: int) -> list[list[int]]:
    """Prompts of the same lengths that share no prefix with ``prompts``: each starts with
    a token none of them starts with. The server keeps finished requests' keys/values
    for later prompts that extend them, so a warm-up on the timed prompts themselves
    would leave the timed batch almost nothing to compute."""
    lead = min(set(range(6, vocab)) - {p[0] for p in prompts})  # a batch under vocab - 6
    return [[lead, *p[1:]] for p in prompts]


def _hf_generate(model: torch.nn.Module, prompts: list[list[int]], new: int) -> int:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # [b, T] left-padded
    mask = (
        torch.arange(width).unsqueeze(0)
        >= (width - torch.tensor([len(p) for p in prompts])).unsqueeze(1)
    ).long()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=True,
            temperature=1.0,
            top_k=None,
            top_p=None,
            pad_token_id=0,
        )
    return int(out[:, width:].numel())


def _server_generate(
    server: RolloutServer, prompts: list[list[int]], new: int
) -> tuple[int, float]:
    """(tokens, seconds): one thread per prompt, all released at once by an event."""
    counts = [0] * len(prompts)
    go = threading.Event()

    def one(i: int) -> None:
        go.wait()
        counts[i] = len(
            server.generate(
                prompts[i], SamplingParams(max_tokens=new, temperature=1.0, stop_ids=())
            ).completion
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    go.set()
    for t in threads:
        t.join()
    return sum(counts), time.perf_counter() - t0


def _timed(fn: Callable[[], int]) -> tuple[int, float]:
    t0 = time.perf_counter()
    tokens = fn()
    return tokens, time.perf_counter() - t0


def _in_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` on a short-lived thread and return its result.

    With GNU OpenMP every thread that runs parallel torch ops keeps its own worker team
    for life; two live teams on few cores throttle each other (workers sleep after every
    parallel region). The main thread therefore runs no torch work here: each measured
    path (model.generate, or the server's engine thread) owns the only live team, as a
    plain single-threaded script would.
    """
    out: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # re-raised on the calling thread below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return out[0]


def _hf_run(model: torch.nn.Module, prompts: list[list[int]], new: int) -> float:
    """tokens/s of one timed model.generate call after a warm-up one."""

    def run() -> float:
        _hf_generate(model, prompts, new)
        tokens, seconds = _timed(lambda: _hf_generate(model, prompts, new))
        return tokens / seconds

    return _in_thread(run)


def _server_run(model: torch.nn.Module, prompts: list[list[int]], new: int, seed: int) -> float:
    """tokens/s of one timed static batch on a fresh server after a warm-up batch of
    other prompts."""
    server = _in_thread(lambda: RolloutServer(model, max_batch=len(prompts), seed=seed))
    with server:
        _server_generate(server, _warm_up_prompts(prompts, model.config.vocab_size), new)
        tokens, seconds = _server_generate(server, prompts, new)
    return tokens / seconds


def _lognormal(count: int, seed: int, median: float, sigma: float, cap: int) -> list[int]:
    """Completion lengths: lognormal around ``median``, at least 1, at most ``cap``."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(count, generator=g).tolist()
    return [min(cap, max(1, round(median * math.exp(sigma * x)))) for x in z]


def _hf_lengths(model: torch.nn.Module, prompts: list[list[int]], lengths: list[int]) -> float:
    """Useful tokens/s of one timed model.generate call (after a warm-up): the batch runs
    to the longest length, and only each row's own length counts."""

    def run() -> float:
        _hf_generate(model, prompts, max(lengths))
        _, seconds = _timed(lambda: _hf_generate(model, prompts, max(lengths)))
        return sum(lengths) / seconds

    return _in_thread(run)


def _submit_all(
    server: RolloutServer, prompts: list[list[int]], lengths: list[int], groups: list[int]
) -> tuple[int, float]:
    """(tokens, seconds) of one batch sent as ``submit`` calls, each with its own length."""
    t0 = time.perf_counter()
    futures = [
        server.submit(p, SamplingParams(max_tokens=n, temperature=1.0, stop_ids=()), affinity=g)
        for p, n, g in zip(prompts, lengths, groups, strict=True)
    ]
    tokens = sum(len(f.result().completion) for f in futures)
    return tokens, time.perf_counter() - t0


def _server_lengths(
    model: torch.nn.Module,
    prompts: list[list[int]],
    lengths: list[int],
    groups: list[int],
    seed: int,
    share: bool = True,
) -> tuple[float, int, int]:
    """(tokens/s, prompt tokens computed, served) of one timed batch on a fresh server,
    after a warm-up batch of other prompts."""
    server = _in_thread(
        lambda: RolloutServer(model, max_batch=len(prompts), seed=seed, share_prefixes=share)
    )
    with server:
        warm = _warm_up_prompts(prompts, model.config.vocab_size)
        _submit_all(server, warm, lengths, groups)
        before = server.stats()
        tokens, seconds = _submit_all(server, prompts, lengths, groups)
        after = server.stats()
    assert tokens == sum(lengths), (tokens, sum(lengths))
    computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    return tokens / seconds, computed, after["prompt_tokens"] - before["prompt_tokens"]


def lognormal(
    size: str, batch: int, cap: int, repeats: int, seed: int
) -> tuple[list[float], list[float]]:
    """Per-repeat (model.generate, RolloutServer) useful tokens/s on the lognormal batch."""
    model = _in_thread(lambda: make_model("qwen2", size, seed=seed))
    prompts = _prompts(batch, model.config.vocab_size, seed, 8, 24)
    lengths = _lognormal(batch, seed, 24.0, 0.9, cap)
    hf, ours = [], []
    for _ in range(repeats):
        hf.append(_hf_lengths(model, prompts, lengths))
        ours.append(_server_lengths(model, prompts, lengths, list(range(batch)), seed)[0])
    return hf, ours


def grpo(
    size: str, prompts_n: int, group: int, cap: int, repeats: int, seed: int
) -> tuple[list[float], list[float], list[float], tuple[int, int], tuple[int, int]]:
    """Per-repeat tokens/s (model.generate, server without sharing, server), and the
    last repeat's (computed, served) prompt tokens without and with sharing."""
    model = _in_thread(lambda: make_model("qwen2", size, seed=seed))
    unique = _prompts(prompts_n, model.config.vocab_size, seed + 1, 32, 64)
    prompts = [p for p in unique for _ in range(group)]
    groups = [i for i in range(prompts_n) for _ in range(group)]
    lengths = _lognormal(len(prompts), seed + 1, 24.0, 0.9, cap)
    hf, plain, shared = [], [], []
    counts_plain = counts_shared = (0, 0)
    for _ in range(repeats):
        hf.append(_hf_lengths(model, prompts, lengths))
        rate, *counts = _server_lengths(model, prompts, lengths, groups, seed, share=False)
        plain.append(rate)
        counts_plain = (counts[0], counts[1])
        rate, *counts = _server_lengths(model, prompts, lengths, groups, seed)
        shared.append(rate)
        counts_shared = (counts[0], counts[1])
    return hf, plain, shared, counts_plain, counts_shared


def throughput(
    size: str, batch: int, new: int, repeats: int, seed: int
) -> tuple[list[float], list[float]]:
    """Per-repeat (model.generate tokens/s, RolloutServer tokens/s) on the same prompts.

    Runs alternate, so both see the same background load on a shared machine."""
    model = _in_thread(lambda: make_model("qwen2", size, seed=seed))
    prompts = _prompts(batch, model.config.vocab_size, seed, 8, 24)
    hf, ours = [], []
    for _ in range(repeats):
        hf.append(_hf_run(model, prompts, new))
        ours.append(_server_run(model, prompts, new, seed))
    return hf, ours


def _cell(rates: list[float]) -> str:
    return f"{max(rates):,.0f} (median {statistics.median(rates):,.0f}, min {min(rates):,.0f})"


def latency(size: str, long: int, long_tokens: int, seed: int) -> tuple[float, float, float]:
    """(short alone s, short beside long ones s, long batch s)."""
    model = _in_thread(lambda: make_model("qwen2", size, seed=seed))
    # the long requests, then three short prompts: a warm-up and one for each timing, so
    # no timed prompt is served from the keys/values an earlier request left behind
    prompts = _prompts(long + 3, model.config.vocab_size, seed, 8, 24)
    warm, short, short_beside = prompts[long:]
    short_tokens = 8
    with _in_thread(lambda: RolloutServer(model, max_batch=long + 1, seed=seed)) as server:
        server.generate(warm, SamplingParams(max_tokens=short_tokens, stop_ids=()))
        t0 = time.perf_counter()
        server.generate(short, SamplingParams(max_tokens=short_tokens, stop_ids=()))
        alone = time.perf_counter() - t0

        t0 = time.perf_counter()
        long_params = SamplingParams(max_tokens=long_tokens, stop_ids=())
        futures = [server.submit(p, long_params) for p in prompts[:long]]
        deadline = time.monotonic() + 120
        while server.stats()["active"] < long:  # wait until every long request decodes
            if time.monotonic() > deadline:
                raise RuntimeError("long requests never became active")
            time.sleep(0.001)
        s0 = time.perf_counter()
        server.generate(short_beside, SamplingParams(max_tokens=short_tokens, stop_ids=()))
        beside = time.perf_counter() - s0
        for f in futures:
            f.result()
        batch_time = time.perf_counter() - t0
    return alone, beside, batch_time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="small,base", help="demo model sizes (comma-separated)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new", type=int, default=32, help="new tokens per prompt")
    ap.add_argument("--long", type=int, default=16, help="long requests in the latency test")
    ap.add_argument("--long-tokens", type=int, default=400, help="tokens per long request")
    ap.add_argument("--cap", type=int, default=192, help="longest lognormal completion")
    ap.add_argument("--groups", type=int, default=8, help="GRPO prompts")
    ap.add_argument("--group-size", type=int, default=8, help="GRPO samples per prompt")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="tiny model, small batch, no write")
    ap.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args()
    if args.tiny:
        args.sizes, args.batch, args.new, args.long, args.repeats = "tiny", 8, 8, 2, 1
        args.long_tokens, args.cap, args.groups, args.group_size = 40, 32, 2, 4
        args.write = False
    sizes = [s for s in args.sizes.split(",") if s]

    load_before = os.getloadavg()[0]
    rows = []
    ratios: list[tuple[str, float]] = []
    for size in sizes:
        hf, ours = throughput(size, args.batch, args.new, args.repeats, args.seed)
        ratio = max(ours) / max(hf)
        rows.append(f"| {size} | {_cell(hf)} | {_cell(ours)} | {ratio:.2f}x |")
        ratios.append((size, ratio))
    table = (
        "| model | model.generate tokens/s | RolloutServer tokens/s | ratio of bests |\n"
        "|---|---:|---:|---:|\n" + "\n".join(rows)
    )
    rows = []
    lognormal_ratios: list[tuple[str, float]] = []
    for size in sizes:
        hf, ours = lognormal(size, args.batch, args.cap, args.repeats, args.seed)
        ratio = max(ours) / max(hf)
        rows.append(f"| {size} | {_cell(hf)} | {_cell(ours)} | {ratio:.2f}x |")
        lognormal_ratios.append((size, ratio))
    lengths = _lognormal(args.batch, args.seed, 24.0, 0.9, args.cap)
    log_table = (
        f"Lognormal batch: {args.batch} requests, completion lengths median "
        f"{statistics.median(lengths):.0f}, mean {statistics.mean(lengths):.1f}, max "
        f"{max(lengths)} (model.generate runs every row to {max(lengths)}); useful tokens/s.\n\n"
        "| model | model.generate tokens/s | RolloutServer tokens/s | ratio of bests |\n"
        "|---|---:|---:|---:|\n" + "\n".join(rows)
    )
    rows = []
    shares: list[tuple[str, int, int]] = []
    for size in sizes:
        hf, plain, shared, (c0, s0), (c1, s1) = grpo(
            size, args.groups, args.group_size, args.cap, args.repeats, args.seed
        )
        rows.append(
            f"| {size} | {_cell(hf)} | {_cell(plain)} | {_cell(shared)} | "
            f"{max(shared) / max(hf):.2f}x | {c0:,} / {s0:,} | {c1:,} / {s1:,} |"
        )
        shares.append((size, c1, s1))
    grpo_table = (
        f"GRPO groups: {args.groups} prompts (32-64 tokens) x {args.group_size} samples, "
        "lognormal lengths; useful tokens/s.\n\n"
        "| model | model.generate | RolloutServer, no sharing | RolloutServer | "
        "ratio of bests (server / generate) | prompt tokens computed / served, no sharing | "
        "computed / served, sharing |\n"
        "|---|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows)
    )
    lat_size = sizes[0]
    alone, beside, batch_time = latency(lat_size, args.long, args.long_tokens, args.seed)
    lat = (
        f"| short request (8 tokens), `{lat_size}` model | seconds |\n|---|---:|\n"
        f"| alone on an idle server | {alone:.3f} |\n"
        f"| submitted while {args.long} long requests ({args.long_tokens} tokens) decode "
        f"| {beside:.3f} |\n"
        f"| the long requests' total time (a static batch's wait) | {batch_time:.3f} |"
    )
    print(table)
    print()
    print(log_table)
    print()
    print(grpo_table)
    print()
    print(lat)
    if args.write:
        command = command_line("engine.py")
        host = machine(
            f"torch {torch.__version__} ({torch.get_num_threads()} threads)",
            f"transformers {transformers.__version__}",
        )
        write_section(
            "## engine\n\n"
            f"Command: `{command}`  \n"
            f"Machine: {host}  \n"
            f"Date: {datetime.date.today().isoformat()} (1-minute load average "
            f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after: a shared machine)\n\n"
            f"Static batch: {args.batch} prompts (8-24 tokens) x {args.new} new tokens, "
            f"temperature 1, qwen2 demo models. Each cell: best (median, min) of "
            f"{args.repeats} alternating runs, each after a warm-up; background load only "
            f"slows a run, so the best run is the figure. The server gets the "
            f"batch as {args.batch} concurrent `generate` calls; all torch work runs off the "
            f"main thread, so the measured path owns the process's only OpenMP team (two "
            f"live teams on 2 cores slow each other down).\n\n"
            f"{table}\n\n{log_table}\n\n{grpo_table}\n\n{lat}\n"
        )
        worst = min(r for _, r in ratios)
        worst_log = min(r for _, r in lognormal_ratios)
        shared_ok = all(c * args.group_size <= s for _, c, s in shares)
        missed = [
            *([f"fixed {worst:.2f}x"] if worst < 1.2 else []),
            *([f"lognormal {worst_log:.2f}x"] if worst_log < 3.0 else []),
            *(["prefix sharing"] if not shared_ok else []),
        ]
        write_summary_row(
            "engine",
            "RolloutServer / model.generate tokens/s: fixed-length batch "
            + ", ".join(f"{size} {r:.2f}x" for size, r in ratios)
            + "; lognormal batch "
            + ", ".join(f"{size} {r:.2f}x" for size, r in lognormal_ratios)
            + f"; GRPO {args.groups}x{args.group_size} prompt tokens computed / served "
            + ", ".join(f"{size} {c:,}/{s:,}" for size, c, s in shares),
            ">= 1.2x fixed, >= 3x lognormal, computed <= served / group size",
            "met" if not missed else f"NOT met ({', '.join(missed)})",
        )
        print(f"wrote the engine section of {RESULTS}")


if __name__ == "__main__":
    main()
