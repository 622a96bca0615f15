"""Packing: admitted rollout groups -> fixed-shape ``[rows, width]`` training arrays.

Each rollout is split into chains (:func:`dew.objectives.rl.chains.chains`); every
chain becomes one segment of one row, with positions counting from 0, so the model can
attend within a chain and never across. Groups are placed in the order given, by first
fit: each chain of a group takes the first row with room for it, and a group either goes
in whole or not at all (a partial group would leave its baseline without members). A
group that does not fit is *cut* and reported; the groups after it still get their try,
so one long group does not starve a batch.

Decisions the design leaves open, made here:

* Advantages are per rollout, from the group's *trained* members only: a masked
  truncation is packed (its completion tokens count in ``completion_mask``) but carries
  no loss and stays out of the baseline. ``group_std`` divides by the population standard
  deviation (``ddof=0``) so a group with one trained member gets advantage 0, not NaN.
* ``behavior_log_probs`` holds the sampled log-prob on every completion token, trained
  or not, so metrics can still compare engines on masked rollouts; ``advantages`` is 0
  wherever ``loss_mask`` is.
* ``rollout_index`` indexes the flattened ``groups`` argument (group by group, member by
  member), cut groups included, so it does not shift when a group is cut.
* Support sets are stored only for trained tokens (the only ones the loss renormalizes),
  so masked rollouts cost no support capacity. Every call of a rollout carries support or
  none does; a rollout mixing both is refused rather than misaligned.

All per-token work is numpy: Python runs once per group, rollout, chain and run, and
every field of the batch is written in one pass. First fit fills each row from slot 0
without gaps, so a row is its chains end to end followed by its padding: in row-major
order the batch is one sequence of pieces (runs and padding), and each field is one
concatenation or one ``np.repeat`` of per-piece values, with no masks or index arrays.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from dew.core import Rollout, Status, as_int
from dew.objectives.rl.chains import Run, chain_runs, trained_mask
from dew.objectives.rl.estimators import (
    DEFAULT_ESTIMATOR,
    ESTIMATORS,
    Estimator,
    advantage_estimator,
    advantages,
)
from dew.objectives.rl.truncation import (
    DEFAULT_TRUNCATION,
    Truncation,
    TruncationPolicy,
    policy_name,
    truncation_policy,
)

# The estimator registry is pack's to apply; it is re-exported here as pack's vocabulary.
__all__ = ["ESTIMATORS", "PackStats", "advantage_estimator", "pack"]

_NO_IDS = np.zeros(0, dtype=np.int64)
# Read per rollout: on Python 3.11 ``Status.COMPLETED`` costs a descriptor call each time.
_COMPLETED, _AGENT_ERROR, _TRUNCATED = Status.COMPLETED, Status.AGENT_ERROR, Status.TRUNCATED

# --------------------------------------------------------------------------- stats


@dataclass(frozen=True)
class PackStats:
    """What :func:`pack` did with the groups it was given.

    ``packed`` and ``cut`` are indices into ``groups``, in order; ``tokens`` counts
    non-padding slots, ``trained_tokens`` those with loss; ``padding_share`` is the
    share of the ``rows * width`` slots left empty.
    """

    packed: tuple[int, ...]
    cut: tuple[int, ...]
    trained_tokens: int
    tokens: int
    padding_share: float

    @property
    def groups_packed(self) -> int:
        return len(self.packed)

    @property
    def groups_cut(self) -> int:
        return len(self.cut)


# --------------------------------------------------------------------------- admission


def _admit(
    rollout: Rollout, policy: Callable[[Rollout], Truncation], name: str, cap: int | None
) -> tuple[bool, float, bool]:
    """(trained, reward, has_support) of one rollout under the truncation policy ``name``."""
    calls = rollout.calls
    if len(calls) == 1:  # the single-turn case: no mix of support and none is possible
        has_support = calls[0].support is not None
        flags = [has_support]
    else:
        flags = [c.support is not None for c in calls]
        has_support = any(flags)
    if has_support and cap is None:
        raise ValueError(
            f"{rollout.key}: its calls carry support but support_capacity is None; "
            "pass support_capacity to pack filtered-sampling rollouts"
        )
    if has_support and not all(flags):
        raise ValueError(
            f"{rollout.key}: calls[{flags.index(False)}] carries no support while other calls "
            "do; every call of a rollout must carry support or none may"
        )
    status = rollout.status
    if status is _COMPLETED or status is _AGENT_ERROR:
        if rollout.reward is None:
            raise ValueError(
                f"{rollout.key}: status {status.name} needs a reward to be packed, got None"
            )
        return True, float(rollout.reward), has_support
    if status is _TRUNCATED:
        verdict = policy(rollout)
        if verdict.resubmit is not None:
            raise ValueError(
                f"{rollout.key}: truncation={name!r} cannot admit this rollout "
                f"(resubmit: {verdict.resubmit}); it must run again, not be packed"
            )
        if not verdict.trained:
            return False, 0.0, has_support
        if verdict.reward is None:
            raise ValueError(f"{rollout.key}: truncation={name!r} trains it but gives no reward")
        return True, float(verdict.reward), has_support
    raise ValueError(
        f"{rollout.key}: status {status.name} is never scored and cannot be packed; "
        "only COMPLETED, AGENT_ERROR and TRUNCATED rollouts are admitted"
    )


def _rollout_support(rollout: Rollout) -> tuple[np.ndarray, np.ndarray]:
    """(counts [m], ids [sum(counts)]) over a rollout's m completion tokens, in call order.

    Read from the calls rather than from each chain's row tuple: a 2-D array of top-k
    ids then costs one reshape per call instead of one row object per token.
    """
    counts: list[np.ndarray] = []
    ids: list[np.ndarray] = []
    for call in rollout.calls:
        rows = call.support  # never None here: _admit refused rollouts mixing both
        if isinstance(rows, np.ndarray) and rows.ndim == 2:
            counts.append(np.full(rows.shape[0], rows.shape[1], dtype=np.int64))
            ids.append(rows.reshape(-1).astype(np.int64, copy=False))
        else:
            per_row = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
            counts.append(per_row)
            flat = itertools.chain.from_iterable(rows)
            ids.append(np.fromiter(flat, dtype=np.int64, count=int(per_row.sum())))
    return np.concatenate(counts), np.concatenate(ids)


# --------------------------------------------------------------------------- chains


class _Chain(NamedTuple):
    """One chain of a rollout, ready to place: its runs (as ``Run`` fields), its size,
    and with support, its per-token support counts and its ids."""

    runs: Sequence[Run]
    n: int  # tokens
    counts: np.ndarray | None  # [n] support ids per token (None: no support)
    ids: np.ndarray  # [k] the support ids, in token order


_tuple_new = tuple.__new__  # builds a named tuple without its Python-level __new__


def _chains(rollout: Rollout, with_support: bool) -> list[_Chain]:
    calls = rollout.calls
    if len(calls) == 1 and not with_support:
        # The single-turn case, once per rollout: the one chain of chain_runs (a prompt
        # run, then a completion run) built as plain tuples, without its merge loop.
        call = calls[0]
        prompt = np.asarray(call.prompt, dtype=np.int64)
        if prompt.ndim != 1:
            prompt = prompt.reshape(-1)
        completion = np.asarray(call.completion, dtype=np.int64)
        if completion.ndim != 1:
            completion = completion.reshape(-1)
        lp = np.asarray(call.log_probs, dtype=np.float64)
        if lp.ndim != 1:
            lp = lp.reshape(-1)
        v = call.version
        runs = ((prompt, False, None, v, None), (completion, True, lp, v, call.support))
        return [_tuple_new(_Chain, (runs, len(prompt) + len(completion), None, _NO_IDS))]
    out = []
    if with_support:
        # Chains hold the completions in call order, so each chain's support is the next
        # run of the rollout's per-token counts and ids.
        all_counts, all_ids = _rollout_support(rollout)
        id_ends = np.cumsum(all_counts)  # [m]
        tok_at = id_at = 0
    for runs in chain_runs(calls):
        n = sum(len(run.tokens) for run in runs)
        if with_support:
            flags = trained_mask(runs)  # [n]
            k = int(np.count_nonzero(flags))
            counts = np.zeros(n, dtype=np.int64)  # [n]
            counts[flags] = all_counts[tok_at : tok_at + k]
            id_end = int(id_ends[tok_at + k - 1])
            out.append(_Chain(runs, n, counts, all_ids[id_at:id_end]))
            tok_at, id_at = tok_at + k, id_end
        else:
            out.append(_Chain(runs, n, None, _NO_IDS))
    return out


# --------------------------------------------------------------------------- placement


class _Placed:
    """The placed chains and their runs, field by field, in placement order.

    Plain lists of numbers and arrays rather than a record per chain: a batch has tens
    of thousands of chains, and records that live until the batch is assembled would
    each be one more object for the cyclic collector to walk, pass after pass.
    """

    def __init__(self) -> None:
        # Per chain.
        self.flat: list[int] = []  # row * width + first slot
        self.length: list[int] = []  # tokens
        self.segment: list[int] = []
        self.rollout: list[int] = []  # index into the flattened groups
        self.trained: list[bool] = []
        self.advantage: list[float] = []
        self.runs: list[int] = []  # how many runs
        self.support_counts: list[np.ndarray | None] = []  # [length] each (None: zeros)
        self.support_ids: list[np.ndarray] = []
        self.support_flat: list[int] = []  # row * capacity + first support slot
        # Per run, chain after chain.
        self.tokens: list[np.ndarray] = []
        self.log_probs: list[np.ndarray | None] = []  # None: not a completion run
        self.version: list[int] = []


class _Rows:
    """Room left in each row; first fit with all-or-nothing placement of a group.

    First fit opens a row only when no earlier row has room, so rows ``used`` onward
    are still empty. Rooms only shrink, and every chain of a group has at least the
    group's shortest chain's tokens, so the rows any of them can take are the earlier
    rows with that much room left and then the empty ones, in order: one numpy query
    per group finds the former, and the group is placed among them in plain Python.
    """

    def __init__(self, rows: int, width: int, cap: int | None) -> None:
        self.rows = rows
        self.width = width
        self.cap = cap
        self.room = np.full(rows, width, dtype=np.int64)  # [rows] token slots left
        self.sroom = np.full(rows, cap or 0, dtype=np.int64)  # [rows] support slots left
        self.nseg = np.zeros(rows, dtype=np.int64)  # [rows] chains placed
        self.used = 0  # rows [used, rows) are empty

    @property
    def filled(self) -> int:
        return int(self.width * self.rows - self.room.sum())

    def place_group(
        self,
        chains: Sequence[list[_Chain]],
        trained: list[bool],
        adv: list[float],
        base: int,
        out: _Placed | None,
    ) -> bool:
        """Place every chain of a group (``chains[i]``: member i's) and record them in
        ``out``, or, leaving the rows and ``out`` untouched, return False."""
        cap, width = self.cap, self.width
        shortest = min((c.n for member in chains for c in member), default=width)
        at = np.flatnonzero(self.room[: self.used] >= shortest).tolist()  # candidate rows
        room = self.room[at].tolist()  # [len(at)], local until the whole group fits
        sroom = self.sroom[at].tolist()
        nseg = self.nseg[at].tolist()
        opened = self.used  # the next empty row
        flat: list[int] = []  # per chain of the group, in order
        segment: list[int] = []
        sflat: list[int] = []
        for member in chains:
            for chain in member:
                n, k = chain.n, len(chain.ids)
                for j, left in enumerate(room):
                    if left >= n and sroom[j] >= k:  # k is 0 without support
                        break
                else:
                    if opened == self.rows or n > width or k > (cap or 0):
                        return False
                    at.append(opened)
                    room.append(width)
                    sroom.append(cap or 0)
                    nseg.append(0)
                    opened += 1
                    j = len(at) - 1
                r = at[j]
                flat.append(r * width + width - room[j])
                nseg[j] += 1
                segment.append(nseg[j])
                if cap is not None:
                    sflat.append(r * cap + cap - sroom[j])
                room[j] -= n
                sroom[j] -= k
        self.room[at] = room
        self.sroom[at] = sroom
        self.nseg[at] = nseg
        self.used = opened
        if out is not None:
            _record(out, chains, trained, adv, base, flat, segment, sflat)
        return True


def _record(
    out: _Placed,
    chains: Sequence[list[_Chain]],
    trained: list[bool],
    adv: list[float],
    base: int,
    flat: list[int],
    segment: list[int],
    sflat: list[int],
) -> None:
    """Append a placed group's chains (at ``flat``, numbered ``segment``) to ``out``."""
    out.flat += flat
    out.segment += segment
    out.support_flat += sflat
    for mi, member in enumerate(chains):
        is_trained, advantage = trained[mi], adv[mi]
        for chain in member:
            out.length.append(chain.n)
            out.rollout.append(base + mi)
            out.trained.append(is_trained)
            out.advantage.append(advantage)
            out.runs.append(len(chain.runs))
            out.support_counts.append(chain.counts)
            out.support_ids.append(chain.ids)
            for tokens, _, log_probs, version, _ in chain.runs:
                out.tokens.append(tokens)
                out.log_probs.append(log_probs)  # None on prompt runs (Run.trained False)
                out.version.append(version)


def _never_fits(group: Sequence[Rollout], rows: int, width: int, cap: int | None) -> str:
    """Why ``group`` cannot be packed even into empty rows: its longest chain, its size."""
    lengths = [
        [sum(len(run.tokens) for run in runs) for runs in chain_runs(r.calls)] for r in group
    ]
    longest = max(range(len(group)), key=lambda i: max(lengths[i], default=0))
    total = sum(map(sum, lengths))
    where = f"rows={rows}, width={width}" + ("" if cap is None else f", support_capacity={cap}")
    return (
        f"rollout {group[longest].key}: its group can never be packed ({where}): its "
        f"chains are {lengths[longest]} tokens long (longest of the group: "
        f"{max(map(max, filter(None, lengths)), default=0)}), and the group's "
        f"{len(group)} rollouts need {total} tokens in all; every step would cut it. "
        "Raise width to at least the longest chain (prompt + completion tokens), "
        "rows so that a whole group fits, or lower the sampling's max_tokens"
    )


def _check_int(name: str, value: object) -> int:
    try:
        return as_int(value, name, minimum=1)
    except ValueError:  # pack's own wording, which callers match on
        raise ValueError(f"{name} must be a positive int, got {value!r}") from None


def pack(
    groups: Sequence[Sequence[Rollout]],
    *,
    rows: int,
    width: int,
    estimator: str | Estimator = DEFAULT_ESTIMATOR,
    truncation: str | TruncationPolicy = DEFAULT_TRUNCATION,
    support_capacity: int | None = None,
) -> tuple[dict[str, np.ndarray], PackStats]:
    """Pack admitted ``groups`` into ``[rows, width]`` arrays and compute advantages.

    Returns the batch (``tokens``, ``positions``, ``segments``, ``loss_mask``,
    ``completion_mask``, ``advantages``, ``behavior_log_probs``, ``proximal_log_probs``,
    ``versions``, ``rollout_index``, plus ``support`` and ``support_offsets`` when
    ``support_capacity`` is given) and its :class:`PackStats`.
    """
    rows = _check_int("rows", rows)
    width = _check_int("width", width)
    cap = None if support_capacity is None else _check_int("support_capacity", support_capacity)
    advantage_estimator(estimator)  # refuses a bad estimator before any work
    policy = truncation_policy(truncation)
    name = policy_name(truncation)

    space = _Rows(rows, width, cap)
    placed = _Placed()
    packed: list[int] = []
    cut: list[int] = []
    base = 0  # flat index of the group's first member
    for gi, group in enumerate(groups):
        verdicts = [_admit(r, policy, name, cap) for r in group]
        trained = [v[0] for v in verdicts]
        adv = advantages(
            estimator,
            np.array([v[1] for v in verdicts], dtype=np.float64),  # [n]
            np.array(trained, dtype=bool),  # [n]
        ).tolist()
        chains = [
            _chains(r, cap is not None and v[0] and v[2])
            for r, v in zip(group, verdicts, strict=True)
        ]
        if space.place_group(chains, trained, adv, base, placed):
            packed.append(gi)
        elif _Rows(rows, width, cap).place_group(chains, trained, adv, base, None):
            cut.append(gi)
        else:
            raise ValueError(_never_fits(group, rows, width, cap))
        base += len(group)

    batch, trained_tokens = _assemble(placed, space)
    tokens = space.filled
    stats = PackStats(
        packed=tuple(packed),
        cut=tuple(cut),
        trained_tokens=trained_tokens,
        tokens=tokens,
        padding_share=(rows * width - tokens) / (rows * width),
    )
    return batch, stats


# --------------------------------------------------------------------------- assembly


def _with_pads(values: list[Any], pad: float, p: int, dtype: type) -> np.ndarray:
    """[len(values) + p]: ``values``, then ``pad`` once per padding piece."""
    out = np.empty(len(values) + p, dtype=dtype)
    out[: len(values)] = values
    out[len(values) :] = pad
    return out


def _assemble(placed: _Placed, space: _Rows) -> tuple[dict[str, np.ndarray], int]:
    """The batch (and its trained tokens): every field written once, in row-major order.

    The pieces of the flat ``[rows * width]`` batch, in order, are the placed chains
    sorted by first slot with each row's padding after its last chain; a chain's runs
    are consecutive pieces too. A per-chain value is one ``np.repeat`` over the pieces'
    sizes, a per-run value one over the runs', tokens and log-probs one concatenation.
    """
    rows, width = space.rows, space.width
    size = rows * width
    pad_rows = np.flatnonzero(space.room)  # [p] rows with padding
    pad_len = space.room[pad_rows]  # [p]
    pad_flat = (pad_rows + 1) * width - pad_len  # [p] first padding slot of each
    c, p, u = len(placed.flat), len(pad_rows), len(placed.tokens)
    starts = np.empty(c + p, dtype=np.int64)  # [c + p] first slot of each piece
    starts[:c] = placed.flat
    starts[c:] = pad_flat
    order = np.argsort(starts, kind="stable")  # [c + p] pieces in row-major order
    lengths = np.concatenate([np.asarray(placed.length, dtype=np.int64), pad_len])[order]

    # Runs in row-major order: each chain's runs, and each row's padding as one run of
    # its own (numbered after the chains' u runs).
    nruns = _with_pads(placed.runs, 1, p, np.int64)[order]  # [c + p]
    first = np.empty(c + p, dtype=np.int64)  # [c + p] index of each piece's first run
    first[:c] = np.cumsum(placed.runs) - placed.runs
    first[c:] = np.arange(u, u + p)
    first = first[order]
    run_order = np.repeat(first - (np.cumsum(nruns) - nruns), nruns) + np.arange(
        int(nruns.sum())
    )  # [u + p]
    zeros = np.zeros(width, dtype=np.int64)
    tokens = placed.tokens + [zeros[:k] for k in pad_len.tolist()]
    log_probs = placed.log_probs + [None] * p
    ordered = run_order.tolist()
    pieces = [tokens[i] for i in ordered]
    run_len = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))  # [u + p]
    # A completion run is one with log-probs: prompt runs and padding carry None.
    completion = np.fromiter((lp is not None for lp in log_probs), dtype=bool, count=u + p)[
        run_order
    ]  # [u + p]
    versions = _with_pads(placed.version, -1, p, np.int64)[run_order]  # [u + p]
    trains = _with_pads(placed.trained, False, p, bool)[order]  # [c + p]
    loss = completion & np.repeat(trains, nruns)  # [u + p]
    adv = _with_pads(placed.advantage, 0.0, p, np.float64)[order]  # [c + p]
    run_adv = np.where(loss, np.repeat(adv, nruns), 0.0)  # [u + p]

    out: dict[str, np.ndarray] = {"tokens": np.empty(size, dtype=np.int64)}
    np.concatenate(pieces, out=out["tokens"])
    # Positions: 0, 1, ... along each chain, 0 on padding; one pass, from views.
    count = np.arange(width, dtype=np.int64)
    out["positions"] = np.empty(size, dtype=np.int64)
    ks = zip(order.tolist(), lengths.tolist(), strict=True)
    np.concatenate([(count if i < c else zeros)[:k] for i, k in ks], out=out["positions"])
    out["segments"] = np.repeat(_with_pads(placed.segment, 0, p, np.int64)[order], lengths)
    out["loss_mask"] = np.repeat(loss.astype(np.float32), run_len)
    out["completion_mask"] = np.repeat(completion, run_len)
    out["advantages"] = np.repeat(run_adv.astype(np.float32), run_len)
    out["behavior_log_probs"] = np.empty(size, dtype=np.float32)
    zero_lp: dict[int, np.ndarray] = {}  # log-probs of the runs without any, by size
    lp_pieces = []
    for i, k in zip(ordered, run_len.tolist(), strict=True):
        lp = log_probs[i]
        if lp is None:
            lp = zero_lp.get(k)
            if lp is None:
                lp = zero_lp[k] = np.zeros(k)
        lp_pieces.append(lp)
    np.concatenate(lp_pieces, out=out["behavior_log_probs"], casting="same_kind")
    out["proximal_log_probs"] = np.zeros(size, dtype=np.float32)
    out["versions"] = np.repeat(versions, run_len)
    out["rollout_index"] = np.repeat(_with_pads(placed.rollout, -1, p, np.int64)[order], lengths)
    batch = {k: v.reshape(rows, width) for k, v in out.items()}
    if space.cap is not None:
        batch.update(_assemble_support(placed, space, order, lengths))
    return batch, int(run_len[loss].sum())


def _assemble_support(
    placed: _Placed, space: _Rows, order: np.ndarray, lengths: np.ndarray
) -> dict[str, np.ndarray]:
    """``support`` and ``support_offsets``; ``order`` and ``lengths`` as in :func:`_assemble`.

    Support ids fill each row of ``support`` from slot 0 in placement order, as tokens
    fill the batch's rows; the slots after a row's last id hold -1.
    """
    rows, width, cap = space.rows, space.width, space.cap
    assert cap is not None
    c = len(placed.flat)
    # Per token: the chain's counts, zeros on chains without support and on padding.
    counts = placed.support_counts + [None] * (len(order) - c)
    zeros = np.zeros(width, dtype=np.int64)
    per_token = np.empty(rows * width, dtype=np.int64)
    np.concatenate(
        [
            zeros[:k] if counts[i] is None else counts[i]
            for i, k in zip(order.tolist(), lengths.tolist(), strict=True)
        ],
        out=per_token,
    )
    offsets = np.zeros((rows, width + 1), dtype=np.int64)  # [rows, width + 1]
    np.cumsum(per_token.reshape(rows, width), axis=1, out=offsets[:, 1:])
    # Each chain's ids go straight to their slots (row * cap + first slot), and only the
    # slots left over are set to -1: the buffer is large (rows x width x top-k ids), and
    # filling it first, or joining the ids before copying them, each cost a pass over it.
    support = np.empty((rows, cap), dtype=np.int64)  # [rows, cap]
    flat_support = support.reshape(-1)
    for at, chain_ids in zip(placed.support_flat, placed.support_ids, strict=True):
        flat_support[at : at + len(chain_ids)] = chain_ids
    used = (cap - space.sroom).tolist()  # [rows] ids in each row, from slot 0
    for r in range(rows):
        support[r, used[r] :] = -1
    return {"support": support, "support_offsets": offsets}
