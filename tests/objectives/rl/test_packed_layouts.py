"""The packed forward's two layouts give the same log-probs and gradients.

``rows`` runs the packed rows in one forward under a block-diagonal mask; ``chains`` runs
each chain alone, one per row, in length buckets; ``auto`` picks by cost. Whatever runs,
every token gets the log-prob of its chain scored alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dew.objectives.rl._packed_forward import packed_forward_log_probs
from dew.objectives.rl.grpo import GRPOObjective

from .test_grpo import (
    ARCHS,
    add_support,
    alone_log_probs,
    pack_by_hand,
    random_chains,
    sharp_model,
    vocab_size,
)

# Long chains of mixed lengths, packed several to a row: the shape where the rows'
# attention costs most (each row's width squared) and the buckets least.
LENGTHS = [90, 12, 40, 150, 7, 33, 120, 64, 18, 101, 55]
LAYOUT = [[3, 4, 5], [6, 1, 2], [9, 8, 0], [10, 7]]
WIDTH = 224


def calls_of(model: torch.nn.Module) -> tuple[list[dict[str, object]], object]:
    """Record each model call's input shape and whether it got a mask."""
    calls: list[dict[str, object]] = []

    def grab(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        calls.append(
            {"shape": tuple(kwargs["input_ids"].shape), "mask": kwargs.get("attention_mask")}
        )

    return calls, model.register_forward_pre_hook(grab, with_kwargs=True)


def long_batch(model: torch.nn.Module) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
    chains = random_chains(LENGTHS, vocab_size(model), seed=4)
    return chains, pack_by_hand(chains, [*LAYOUT, []], width=WIDTH, seed=4)


def training_batch(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """A multi-turn step's shape: 24 wide rows of three chains, long to short."""
    rng = np.random.default_rng(5)
    spans = [(150, 180), (120, 150), (60, 100)]
    lengths = [int(rng.integers(*span)) for _ in range(24) for span in spans]
    chains = random_chains(lengths, vocab_size(model), seed=5)
    layout = [[3 * r, 3 * r + 1, 3 * r + 2] for r in range(24)]
    return pack_by_hand(chains, layout, width=448, seed=5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_chains_score_each_chain_as_it_scores_alone(arch: str, attn: str) -> None:
    model = sharp_model(arch, attn=attn)
    chains, batch = long_batch(model)
    calls, handle = calls_of(model)
    try:
        with torch.no_grad():
            got = packed_forward_log_probs(model, batch, layout="chains", temperature=0.7)
    finally:
        handle.remove()
    assert got.shape == (5, WIDTH)
    assert len(calls) > 1 and all(c["mask"] is None for c in calls)  # buckets, no mask
    assert sum(c["shape"][0] for c in calls) == len(chains)  # one row per chain
    covered = torch.zeros(5, WIDTH, dtype=torch.bool)
    for r, ids in enumerate(LAYOUT):
        col = 0
        for i in ids:
            n = len(chains[i])
            want = alone_log_probs(model, chains[i], temperature=0.7)
            torch.testing.assert_close(got[r, col + 1 : col + n], want, atol=1e-4, rtol=1e-5)
            assert got[r, col] == 0.0
            covered[r, col : col + n] = True
            col += n
    assert (got[~covered] == 0).all()


@pytest.mark.parametrize("support", [False, True])
def test_both_layouts_give_the_same_log_probs_and_gradients(support: bool) -> None:
    model = sharp_model("qwen2")
    _, batch = long_batch(model)
    if support:
        add_support(batch, {(0, 100): [11, 23, 37], (1, 20): [5, 6], (3, 150): [40, 41, 42]})
    weights = torch.from_numpy(np.random.default_rng(0).normal(size=(5, WIDTH))).float()
    out = {}
    for layout in ("rows", "chains"):
        model.zero_grad()
        logp = packed_forward_log_probs(model, batch, layout=layout)
        (logp * weights).sum().backward()
        out[layout] = (logp.detach(), [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(out["rows"][0], out["chains"][0], atol=1e-4, rtol=1e-5)
    for a, b in zip(out["rows"][1], out["chains"][1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_auto_takes_the_buckets_for_long_chains_and_the_rows_for_short_ones() -> None:
    model = sharp_model("qwen2")
    long = training_batch(model)
    short = pack_by_hand(random_chains([5, 6, 7], vocab_size(model), seed=2), [[0, 1], [2]], 14)
    calls, handle = calls_of(model)
    try:
        with torch.no_grad():
            packed_forward_log_probs(model, long)
            long_calls = list(calls)
            calls.clear()
            packed_forward_log_probs(model, short)
    finally:
        handle.remove()
    assert len(long_calls) > 1 and long_calls[0]["mask"] is None
    assert len(calls) == 1 and calls[0]["shape"] == (2, 14) and calls[0]["mask"] is not None


def test_a_batch_only_the_rows_can_score_keeps_the_rows() -> None:
    model = sharp_model("qwen2")
    _, batch = long_batch(model)
    batch["positions"][0, :90] += 3  # a chain whose positions do not start at 0
    calls, handle = calls_of(model)
    try:
        with torch.no_grad():
            got = packed_forward_log_probs(model, batch, layout="chains")
    finally:
        handle.remove()
    assert len(calls) == 1 and calls[0]["mask"] is not None  # scored as given, in rows
    with torch.no_grad():
        want = packed_forward_log_probs(model, batch, layout="rows")
    assert torch.equal(got, want)


def test_an_unknown_layout_is_refused() -> None:
    model = sharp_model("qwen2")
    _, batch = long_batch(model)
    with pytest.raises(ValueError, match="layout='packed'"):
        packed_forward_log_probs(model, batch, layout="packed")


@pytest.mark.timeout(120)
def test_a_model_sharded_on_a_mesh_always_takes_the_rows() -> None:
    """Every process of a sharded model must make the same calls (each one gathers the
    parameters), so it never takes a bucket plan that depends on its own rows."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    # one process, its store in memory: a real mesh without a port
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = sharp_model("qwen2")
        _, batch = long_batch(model)
        with torch.no_grad():
            want = packed_forward_log_probs(model, batch, layout="rows")
        fully_shard(model)
        calls, handle = calls_of(model)
        try:
            with torch.no_grad():
                got = packed_forward_log_probs(model, batch, layout="chains")
        finally:
            handle.remove()
        assert len(calls) == 1 and calls[0]["mask"] is not None
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    finally:
        dist.destroy_process_group()


def test_the_objective_scores_long_multi_chain_batches_in_buckets() -> None:
    model = sharp_model("llama")
    batch = training_batch(model)
    objective = GRPOObjective()
    calls, handle = calls_of(model)
    try:
        with torch.no_grad():
            objective.packed_log_probs(model, batch)
    finally:
        handle.remove()
    assert len(calls) > 1
