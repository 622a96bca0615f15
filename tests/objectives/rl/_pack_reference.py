"""pack as it was before its row-major assembly (commit efa22a9), kept verbatim as the
reference that tests/objectives/rl/test_pack_reference.py holds the current pack to.

It placed chains with one numpy query per chain and wrote every field with a boolean
mask over the filled slots; slower, but each step is easy to check by eye. Not part of
the library: only the tests import it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from dew.core import Rollout, Status
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
    flags = [c.support is not None for c in rollout.calls]
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
    if status is Status.COMPLETED or status is Status.AGENT_ERROR:
        if rollout.reward is None:
            raise ValueError(
                f"{rollout.key}: status {status.name} needs a reward to be packed, got None"
            )
        return True, float(rollout.reward), has_support
    if status is Status.TRUNCATED:
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


# --------------------------------------------------------------------------- pack


@dataclass
class _Placed:
    """Placed chains, one entry per chain in placement order (within a row: slot order)."""

    runs: list[list[Run]] = field(default_factory=list)  # each chain as its runs
    lengths: list[int] = field(default_factory=list)  # tokens per chain
    flat: list[int] = field(default_factory=list)  # row * width + first slot
    segment: list[int] = field(default_factory=list)
    rollout: list[int] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)
    advantage: list[float] = field(default_factory=list)
    support_counts: list[np.ndarray] = field(default_factory=list)  # [len(chain)] each
    support_ids: list[np.ndarray] = field(default_factory=list)
    support_flat: list[int] = field(default_factory=list)  # row * capacity + first slot

    def extend(self, other: _Placed) -> None:
        for name in self.__dataclass_fields__:
            getattr(self, name).extend(getattr(other, name))


class _Rows:
    """Room left in each row; first fit with all-or-nothing placement of a group."""

    def __init__(self, rows: int, width: int, cap: int | None) -> None:
        self.width = width
        self.cap = cap
        self.room = np.full(rows, width, dtype=np.int64)  # [rows] token slots left
        self.sroom = np.full(rows, cap or 0, dtype=np.int64)  # [rows] support slots left
        self.nseg = np.zeros(rows, dtype=np.int64)  # [rows] chains placed

    @property
    def filled(self) -> int:
        return int(self.width * len(self.room) - self.room.sum())

    def place_group(
        self,
        group: Sequence[Rollout],
        trained: np.ndarray,
        supported: np.ndarray,
        adv: np.ndarray,
        base: int,
    ) -> _Placed | None:
        """Place every chain of ``group`` or, leaving the rows untouched, return None."""
        saved = (self.room.copy(), self.sroom.copy(), self.nseg.copy())
        out = _Placed()
        cap, width, room = self.cap, self.width, self.room
        for mi, rollout in enumerate(group):
            with_support = cap is not None and bool(trained[mi]) and bool(supported[mi])
            if with_support:
                # Chains hold the completions in call order, so each chain's support is
                # the next run of the rollout's per-token counts and ids.
                all_counts, all_ids = _rollout_support(rollout)
                id_ends = np.cumsum(all_counts)  # [m]
                tok_at = id_at = 0
            is_trained, advantage = bool(trained[mi]), float(adv[mi])
            for runs in chain_runs(rollout.calls):
                n = sum(len(run.tokens) for run in runs)
                fits = room >= n  # [rows]
                if with_support:
                    flags = trained_mask(runs)  # [n]
                    k = int(np.count_nonzero(flags))
                    counts = np.zeros(n, dtype=np.int64)  # [n]
                    counts[flags] = all_counts[tok_at : tok_at + k]
                    id_end = int(id_ends[tok_at + k - 1])
                    ids = all_ids[id_at:id_end]
                    tok_at, id_at = tok_at + k, id_end
                    fits &= self.sroom >= len(ids)
                else:
                    counts, ids = None, _NO_IDS
                r = int(fits.argmax())
                if not fits[r]:
                    self.room, self.sroom, self.nseg = saved
                    return None
                out.runs.append(runs)
                out.lengths.append(n)
                out.flat.append(r * width + width - int(room[r]))
                room[r] -= n
                self.nseg[r] += 1
                out.segment.append(int(self.nseg[r]))
                out.rollout.append(base + mi)
                out.trained.append(is_trained)
                out.advantage.append(advantage)
                if cap is not None:
                    out.support_counts.append(np.zeros(n, np.int64) if counts is None else counts)
                    out.support_ids.append(ids)
                    out.support_flat.append(r * cap + cap - int(self.sroom[r]))
                    self.sroom[r] -= len(ids)
        return out


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
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


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
        n = len(verdicts)
        trained = np.fromiter((v[0] for v in verdicts), dtype=bool, count=n)  # [n]
        rewards = np.fromiter((v[1] for v in verdicts), dtype=np.float64, count=n)  # [n]
        supported = np.fromiter((v[2] for v in verdicts), dtype=bool, count=n)  # [n]
        adv = advantages(estimator, rewards, trained)  # [n]
        got = space.place_group(group, trained, supported, adv, base)
        if got is None:
            if _Rows(rows, width, cap).place_group(group, trained, supported, adv, base) is None:
                raise ValueError(_never_fits(group, rows, width, cap))
            cut.append(gi)
        else:
            placed.extend(got)
            packed.append(gi)
        base += n

    batch = _assemble(placed, rows, width, cap)
    tokens = space.filled
    stats = PackStats(
        packed=tuple(packed),
        cut=tuple(cut),
        trained_tokens=int(batch["loss_mask"].sum()),
        tokens=tokens,
        padding_share=(rows * width - tokens) / (rows * width),
    )
    return batch, stats


def _assemble(placed: _Placed, rows: int, width: int, cap: int | None) -> dict[str, np.ndarray]:
    """Scatter the placed chains into the batch arrays in one pass per field."""
    size = rows * width
    out: dict[str, np.ndarray] = {
        "tokens": np.zeros(size, dtype=np.int64),
        "positions": np.zeros(size, dtype=np.int64),
        "segments": np.zeros(size, dtype=np.int64),
        "loss_mask": np.zeros(size, dtype=np.float32),
        "completion_mask": np.zeros(size, dtype=bool),
        "advantages": np.zeros(size, dtype=np.float32),
        "behavior_log_probs": np.zeros(size, dtype=np.float32),
        "proximal_log_probs": np.zeros(size, dtype=np.float32),
        "versions": np.full(size, -1, dtype=np.int64),
        "rollout_index": np.full(size, -1, dtype=np.int64),
    }
    if placed.runs:
        # First fit lays each row's chains end to end from slot 0, so the filled slots of
        # a row are exactly [0, fill): with the chains in row-major order, every field is
        # one boolean-mask assignment of the chains' concatenation (no index arrays), and
        # it concatenates the chains' runs (no per-chain arrays are built).
        flat = np.asarray(placed.flat, dtype=np.int64)  # [c]
        order = np.argsort(flat, kind="stable")  # [c] row-major
        lengths = np.asarray(placed.lengths, dtype=np.int64)[order]  # [c]
        fill = np.bincount(flat[order] // width, weights=lengths, minlength=rows)  # [rows]
        filled = (np.arange(width) < fill[:, None]).reshape(-1)  # [rows * width]
        starts = np.cumsum(lengths) - lengths  # [c] offset of each chain in the concatenation
        total = int(lengths.sum())
        local = np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)  # [T]
        runs = [run for i in order for run in placed.runs[i]]
        run_lengths = np.fromiter((len(r.tokens) for r in runs), np.int64, len(runs))  # [u]

        def per_chain(values: list[int] | list[bool] | list[float], dtype: type) -> np.ndarray:
            return np.repeat(np.asarray(values, dtype=dtype)[order], lengths)  # [T]

        def per_run(values: Iterable[int] | Iterable[bool], dtype: type) -> np.ndarray:
            return np.repeat(np.fromiter(values, dtype, len(runs)), run_lengths)  # [T]

        completion = per_run((r.trained for r in runs), bool)  # [T]
        loss = completion & per_chain(placed.trained, bool)
        behavior = np.zeros(total)  # [T]
        behavior[completion] = np.concatenate([r.log_probs for r in runs if r.trained])
        out["tokens"][filled] = np.concatenate([r.tokens for r in runs])
        out["positions"][filled] = local
        out["segments"][filled] = per_chain(placed.segment, np.int64)
        out["loss_mask"][filled] = loss
        out["completion_mask"][filled] = completion
        out["advantages"][filled] = np.where(loss, per_chain(placed.advantage, np.float64), 0.0)
        out["behavior_log_probs"][filled] = behavior
        out["versions"][filled] = per_run((r.version for r in runs), np.int64)
        out["rollout_index"][filled] = per_chain(placed.rollout, np.int64)
    batch = {k: v.reshape(rows, width) for k, v in out.items()}
    if cap is not None:
        batch.update(_assemble_support(placed, rows, width, cap, batch["loss_mask"].size))
    return batch


def _assemble_support(
    placed: _Placed, rows: int, width: int, cap: int, size: int
) -> dict[str, np.ndarray]:
    support = np.full(rows * cap, -1, dtype=np.int64)
    counts = np.zeros(size, dtype=np.int64)  # [rows * width] support ids per token
    if placed.runs:
        lengths = np.fromiter(
            (len(c) for c in placed.support_counts), dtype=np.int64, count=len(placed.runs)
        )
        starts = np.cumsum(lengths) - lengths
        dest = np.repeat(np.asarray(placed.flat, dtype=np.int64), lengths) + (
            np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)
        )
        counts[dest] = np.concatenate(placed.support_counts)
        nids = np.fromiter(
            (len(i) for i in placed.support_ids), dtype=np.int64, count=len(placed.runs)
        )
        if nids.sum():
            sstarts = np.cumsum(nids) - nids
            sdest = np.repeat(np.asarray(placed.support_flat, dtype=np.int64), nids) + (
                np.arange(int(nids.sum()), dtype=np.int64) - np.repeat(sstarts, nids)
            )
            support[sdest] = np.concatenate(placed.support_ids)
    counts = counts.reshape(rows, width)
    offsets = np.zeros((rows, width + 1), dtype=np.int64)  # [rows, width + 1]
    np.cumsum(counts, axis=1, out=offsets[:, 1:])
    return {"support": support.reshape(rows, cap), "support_offsets": offsets}
