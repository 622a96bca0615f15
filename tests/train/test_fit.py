"""fit(): the loop with a plain-function rollout, checkpoints, resume and bad input."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dew import _checkpoint
from dew.data import Batch, Dataset
from dew.demo.model import make_model
from dew.objectives.rl.grpo import GRPOObjective
from dew.train import (
    CheckpointError,
    PlainRollout,
    TrainingStalled,
    fit,
    latest_checkpoint,
    read_records,
)

WIDTH = 12


def rollout(model: Any, batch: Batch, *, updates: int) -> Batch:
    """Random tokens and advantages from all three global RNGs, so resume must restore them."""
    rows = len(batch["task_id"])
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (rows, WIDTH)).numpy()  # [rows, width]
    advantages = np.repeat(np.random.randn(rows, 1), WIDTH, axis=1)  # [rows, width]
    advantages *= random.uniform(0.5, 1.5)
    out = {
        "tokens": tokens,
        "positions": np.tile(np.arange(WIDTH), (rows, 1)),
        "segments": np.ones((rows, WIDTH), dtype=np.int64),
        "loss_mask": np.concatenate(
            [np.zeros((rows, 1)), np.ones((rows, WIDTH - 1))], axis=1
        ).astype(np.float32),
        "advantages": advantages.astype(np.float32),
    }
    with torch.no_grad():
        logp = GRPOObjective().packed_log_probs(model, out).numpy()
    out["behavior_log_probs"] = logp
    out["proximal_log_probs"] = logp
    return out


def dataset() -> Dataset:
    return Dataset({"task_id": np.arange(40)}, batch_size=4, seed=3)


def parts(seed: int = 0) -> tuple[Any, Any]:
    model = make_model(size="tiny", seed=seed, max_positions=64)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def run(run_dir: Path | None, steps: int, *, seed: int = 0, **kw: Any) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    model, opt = parts(seed)
    result = fit(
        model, opt, dataset(), rollout, GRPOObjective(), steps=steps, run_dir=run_dir, **kw
    )
    return model, result


def same_weights(a: Any, b: Any) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def strip(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    drop = {"time", "seconds", "rollout_seconds", "train_seconds"}
    return [{k: v for k, v in r.items() if k not in drop} for r in records]


def test_fit_writes_records_and_a_final_checkpoint(tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []
    model, result = run(tmp_path, 3, checkpoint_every=None, log=[seen.append])
    records = read_records(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["position"] for r in records] == [0, 1, 2]
    assert strip(seen) == strip(records)
    assert all(np.isfinite(r["loss"]) and "clip_fraction" in str(r["metrics"]) for r in records)
    # the plain rollout has no last_tasks: the batch's ids are what it trained
    assert records[0]["tasks"]["trained"] == [str(i) for i in dataset().batch(0)["task_id"]]
    assert result.updates == 3 and result.checkpoint == tmp_path / "checkpoints/step-00000003"
    assert latest_checkpoint(tmp_path) == result.checkpoint
    assert any(p.requires_grad for p in model.parameters())


def test_resume_reproduces_an_uninterrupted_run_bit_for_bit(tmp_path: Path) -> None:
    straight, _ = run(tmp_path / "a", 6, checkpoint_every=2)
    run(tmp_path / "b", 5, checkpoint_every=2)
    # The run died after step 5 but before its checkpoint: only step-4 survives.
    shutil.rmtree(tmp_path / "b/checkpoints/step-00000005")
    assert len(read_records(tmp_path / "b")) == 5
    resumed, second = run(tmp_path / "b", 6, seed=99, checkpoint_every=2, resume=True)
    assert second.resumed_from == tmp_path / "b/checkpoints/step-00000004"
    assert same_weights(straight, resumed)
    assert strip(read_records(tmp_path / "a")) == strip(read_records(tmp_path / "b"))
    # keep=2: only the two newest checkpoints stay
    names = [p.name for p in _checkpoint.checkpoints(tmp_path / "b/checkpoints")]
    assert names == ["step-00000004", "step-00000006"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest"])
def test_a_corrupt_checkpoint_is_refused_and_the_previous_one_used(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    run(tmp_path, 4, checkpoint_every=2)
    newest = tmp_path / "checkpoints/step-00000004"
    target = newest / ("manifest.json" if damage == "manifest" else "model.safetensors")
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        target.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    else:
        target.unlink()
    model, opt = parts()
    with pytest.raises(CheckpointError, match=str(target.name)):
        _checkpoint.load(newest, model=model, optimizer=opt)
    with pytest.raises(CheckpointError, match=str(target.name)):
        fit(model, opt, dataset(), rollout, GRPOObjective(), steps=4, resume=newest)
    _, result = run(tmp_path, 4, checkpoint_every=2, resume=True)
    assert result.resumed_from == tmp_path / "checkpoints/step-00000002"
    assert "refusing checkpoint" in caplog.text and target.name in caplog.text
    assert [r["step"] for r in read_records(tmp_path)] == [1, 2, 3, 4]
    assert latest_checkpoint(tmp_path) == newest  # rewritten whole by the resumed run


class FailingOptimizer(torch.optim.AdamW):
    """An optimizer whose state cannot be saved: a checkpoint write dies midway."""

    fail = False

    def state_dict(self) -> dict[str, Any]:
        if self.fail:
            raise OSError("disk full")
        return super().state_dict()


def test_a_failed_write_leaves_the_previous_checkpoint_whole(tmp_path: Path) -> None:
    model = make_model(size="tiny", max_positions=64)
    opt = FailingOptimizer(model.parameters(), lr=1e-3)
    fit(model, opt, dataset(), rollout, GRPOObjective(), steps=2, run_dir=tmp_path)
    opt.fail = True
    with pytest.raises(OSError, match="disk full"):
        fit(model, opt, dataset(), rollout, GRPOObjective(), steps=3, run_dir=tmp_path, resume=True)
    folder = tmp_path / "checkpoints"
    assert [p.name for p in folder.iterdir()] == ["step-00000002"]
    _checkpoint.verify(folder / "step-00000002")
    # A process killed mid-write leaves a temporary folder: ignored, then cleaned up.
    (folder / ".tmp-step-00000003-123").mkdir()
    (folder / ".tmp-step-00000003-123/model.safetensors").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path) == folder / "step-00000002"
    assert not list(folder.glob(".tmp-*"))


class AheadRollout(PlainRollout):
    """A rollout with ``ahead`` and ``tasks``: records what was read before each call."""

    def __init__(self, ahead: int) -> None:
        super().__init__()
        self.ahead = ahead
        self.read: list[int] = []
        self.seen_at_call: list[int] = []
        self.opened = 0

    def tasks(self, data: Dataset) -> Dataset:
        def opened() -> None:
            self.opened += 1

        return data.observed(lambda b: self.read.append(int(b["task_id"][0])), opened)

    def __call__(self, model: Any, batch: Batch, *, updates: int) -> Batch:
        self.seen_at_call.append(len(self.read))
        return rollout(model, batch, updates=updates)


def test_a_rollout_with_part_of_the_protocol_is_refused_naming_what_it_lacks() -> None:
    class Partial:  # ahead and tasks, but nothing of the rest
        ahead = 2

        def tasks(self, data: Dataset) -> Dataset:
            return data

        def __call__(self, model: Any, batch: Batch, *, updates: int) -> Batch:
            return rollout(model, batch, updates=updates)

    model, opt = parts()
    lacks = "history, last_tasks, last_errors, restore: subclass dew.train.PlainRollout"
    with pytest.raises(TypeError, match=f"Partial has ahead, tasks but not {lacks}"):
        fit(model, opt, dataset(), Partial(), GRPOObjective(), steps=1)
    # A plain function is taken as a PlainRollout: nothing ahead, its batch's ids trained.
    result = fit(model, opt, dataset(), rollout, GRPOObjective(), steps=1)
    assert result.records[0]["tasks"]["trained"]


def test_the_reader_stays_ahead_by_the_rollouts_ahead(tmp_path: Path) -> None:
    r = AheadRollout(ahead=2)
    model, opt = parts()
    fit(model, opt, dataset(), r, GRPOObjective(), steps=3)
    assert r.opened == 1
    assert r.seen_at_call == [3, 4, 5]  # call n sees batches 0..n+2 read


def test_prefetch_deeper_than_ahead_reads_that_far_ahead() -> None:
    r = AheadRollout(ahead=2)
    model, opt = parts()
    fit(model, opt, dataset(), r, GRPOObjective(), steps=3, prefetch=4)
    assert r.seen_at_call == [5, 6, 7]  # call n sees batches 0..n+4 read, not n+2


def test_keep_sets_how_many_checkpoints_stay(tmp_path: Path) -> None:
    for keep, left in [
        (1, ["step-00000003"]),
        (3, ["step-00000001", "step-00000002", "step-00000003"]),
    ]:
        run(tmp_path / str(keep), 3, checkpoint_every=1, keep=keep)
        names = [p.name for p in _checkpoint.checkpoints(tmp_path / str(keep) / "checkpoints")]
        assert names == left, keep


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    model, opt = parts()
    args = (model, opt, dataset(), rollout, GRPOObjective())
    with pytest.raises(ValueError, match="steps=-1"):
        fit(*args, steps=-1)
    with pytest.raises(ValueError, match="checkpoint_every=0"):
        fit(*args, steps=1, checkpoint_every=0)
    with pytest.raises(ValueError, match="prefetch=1 must be >= the rollout's ahead=2"):
        fit(model, opt, dataset(), AheadRollout(2), GRPOObjective(), steps=1, prefetch=1)
    with pytest.raises(ValueError, match="resume=True needs run_dir"):
        fit(*args, steps=1, resume=True)
    fit(*args, steps=1, run_dir=tmp_path)
    with pytest.raises(ValueError, match="already holds checkpoints"):
        fit(*args, steps=2, run_dir=tmp_path)
    with pytest.raises(CheckpointError, match="no such run or checkpoint folder"):
        fit(*args, steps=2, resume=tmp_path / "nowhere")


def test_records_are_json_lines(tmp_path: Path) -> None:
    run(tmp_path, 2)
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]


def test_fit_freezes_the_heap_after_ten_steps_when_asked_and_unfreezes_it(
    tmp_path: Path,
) -> None:
    import gc

    seen: list[int] = []
    model, opt = parts()

    def failing(model: Any, batch: Batch, *, updates: int) -> Batch:
        if updates == 11:
            raise RuntimeError("rollout broke")
        return rollout(model, batch, updates=updates)

    def train(r: Any) -> None:
        fit(
            model,
            opt,
            dataset(),
            r,
            GRPOObjective(),
            steps=12,
            log=[lambda rec: seen.append(gc.get_freeze_count())],
            freeze_gc=True,
        )

    assert gc.get_freeze_count() == 0
    train(rollout)
    # A step's callbacks run before that step counts toward the warm-up.
    assert all(n == 0 for n in seen[:10]) and all(n > 0 for n in seen[10:])
    assert gc.get_freeze_count() == 0
    seen.clear()
    with pytest.raises(RuntimeError, match="rollout broke"):
        train(failing)
    assert len(seen) == 11 and seen[-1] > 0  # it was frozen when step 12 failed
    assert gc.get_freeze_count() == 0  # and undone on the way out


def test_fit_leaves_the_collector_alone_by_default(tmp_path: Path) -> None:
    import gc

    seen: list[int] = []
    run(None, 12, log=[lambda rec: seen.append(gc.get_freeze_count())])
    assert seen == [0] * 12
    with pytest.raises(ValueError, match="freeze_gc='yes' must be True or False"):
        run(None, 1, freeze_gc="yes")


class HistoryRollout(PlainRollout):
    """A plain rollout that keeps scheduler records, as the scheduler does."""

    def __init__(self) -> None:
        super().__init__()
        from dew.objectives.rl.scheduler import SchedulerRecord

        self.records: list[SchedulerRecord] = []
        self.restored: list[list[SchedulerRecord]] = []
        self.make = SchedulerRecord

    @property
    def history(self) -> tuple[Any, ...]:
        return tuple(self.records)

    def restore(self, records: Any) -> None:  # the scheduler's records within fit's
        restored = [self.make(**r["scheduler"]) for r in records if "scheduler" in r]
        self.restored.append(restored)
        self.records[:] = restored

    def __call__(self, model: Any, batch: Batch, *, updates: int) -> Batch:
        self.records.append(self.make(updates, updates, 0, 1, {"stale": updates}, 0, 0, 0, 0.0, {}))
        return rollout(model, batch, updates=updates)


def test_resume_restores_the_rollouts_history_through_its_method(tmp_path: Path) -> None:
    first = HistoryRollout()
    model, opt = parts()
    fit(model, opt, dataset(), first, GRPOObjective(), steps=2, run_dir=tmp_path)
    again = HistoryRollout()
    model, opt = parts()
    fit(model, opt, dataset(), again, GRPOObjective(), steps=3, run_dir=tmp_path, resume=True)
    assert again.restored == [first.records]  # rebuilt from the checkpoint's records
    assert [r.updates for r in again.history] == [0, 1, 2]
    records = read_records(tmp_path)
    assert [r["scheduler"]["resubmitted"] for r in records] == [{"stale": u} for u in range(3)]


class _Counting(GRPOObjective):
    """GRPOObjective that counts its loss calls (one per micro-batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def loss(self, model: Any, batch: Any, **kw: Any) -> Any:
        self.calls += 1
        return super().loss(model, batch, **kw)


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_micro_batches_give_the_whole_batchs_update(parts: int) -> None:
    whole, whole_result = run(None, 3)
    split, split_result = run(None, 3, micro_batches=parts)
    sw, ss = whole.state_dict(), split.state_dict()
    # Adam divides by the gradient's own scale: rounding shows at 1e-6 after 3 steps.
    assert all(torch.allclose(sw[k], ss[k], atol=1e-5, rtol=1e-5) for k in sw)
    assert not same_weights(whole, split) or parts == 1  # the parts really ran apart
    for a, b in zip(whole_result.records, split_result.records, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
        assert b["metrics"]["trained_tokens"] == pytest.approx(a["metrics"]["trained_tokens"])
        assert b["metrics"]["ratio_mean"] == pytest.approx(a["metrics"]["ratio_mean"], rel=1e-5)
    counting = _Counting()
    model, opt = parts_of()
    fit(model, opt, dataset(), rollout, counting, steps=2, micro_batches=parts)
    assert counting.calls == 2 * parts
    with pytest.raises(ValueError, match="micro_batches"):
        fit(model, opt, dataset(), rollout, counting, steps=1, micro_batches=0)


def parts_of() -> tuple[Any, Any]:
    return parts(0)


@pytest.mark.parametrize("split", [2, 3, 4])
def test_micro_batches_sum_to_the_whole_batchs_gradient(split: int) -> None:
    # Compared before the optimizer: Adam divides by the gradient's scale, so weights
    # after a step would not show a uniform scale error in the parts.
    from dew._step import backward as _backward

    model, _ = parts_of()
    packed = rollout(model, dataset().batch(0), updates=0)
    grads = []
    for micro in (1, split):
        model.zero_grad(set_to_none=True)
        _backward(GRPOObjective(), model, packed, micro)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, whole in grads[0].items():
        assert torch.allclose(grads[1][name], whole, rtol=1e-4, atol=1e-7), name


def test_a_resume_that_finds_no_valid_checkpoint_fails_and_touches_nothing(
    tmp_path: Path,
) -> None:
    run(tmp_path, 4, checkpoint_every=2)
    for path in (tmp_path / "checkpoints").iterdir():
        (path / "manifest.json").unlink()  # every checkpoint corrupt
    before = (tmp_path / "records.jsonl").read_bytes()
    for resume in (True, tmp_path):
        with pytest.raises(
            CheckpointError, match=r"no valid checkpoint to resume; refused: .*step-"
        ):
            run(tmp_path, 6, checkpoint_every=2, resume=resume)
    assert (tmp_path / "records.jsonl").read_bytes() == before
    for path in (tmp_path / "checkpoints").iterdir():
        shutil.rmtree(path)
    with pytest.raises(CheckpointError, match=r"no checkpoint to resume \(the folder is empty"):
        run(tmp_path, 6, resume=tmp_path)
    shutil.rmtree(tmp_path / "checkpoints")
    with pytest.raises(CheckpointError, match="holds no checkpoints/ folder"):
        run(tmp_path, 6, resume=tmp_path)
    assert (tmp_path / "records.jsonl").read_bytes() == before


def test_pruning_keeps_the_newest_valid_checkpoints(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    run(tmp_path, 2, checkpoint_every=1)  # step-1 and step-2
    (folder / "step-00000002" / "manifest.json").unlink()  # step-2 is corrupt now
    newest = folder / "step-00000003"
    shutil.copytree(folder / "step-00000001", newest)  # a valid step-3 just published
    _checkpoint.prune(folder, newest, keep=2)
    # The corrupt one does not count toward keep and goes; the valid older one stays.
    assert [p.name for p in _checkpoint.checkpoints(folder)] == ["step-00000001", "step-00000003"]
    # Folders numbered after the newest are another history's: left for latest() to judge.
    (folder / "step-00000009").mkdir()
    _checkpoint.prune(folder, newest, keep=1)
    assert [p.name for p in _checkpoint.checkpoints(folder)] == ["step-00000003", "step-00000009"]
    assert latest_checkpoint(tmp_path) == newest


def test_tensorboard_shows_every_step_once_after_a_resume(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(tmp_path, 3, checkpoint_every=2)  # events for 1..3, checkpoints 2 and 3
    # As if the process died after step 3's events but before its checkpoint.
    shutil.rmtree(tmp_path / "checkpoints" / "step-00000003")
    run(tmp_path, 4, checkpoint_every=2, resume=True)  # trains 3 and 4 again from 2
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    steps = [e.step for e in events.Scalars("loss")]
    assert steps == [1, 2, 3, 4], steps


def masked(model: Any, batch: Batch, *, updates: int) -> Batch:
    """A step whose rollouts all hit the length limit under truncation='mask'."""
    out = rollout(model, batch, updates=updates)
    out["loss_mask"] = np.zeros_like(out["loss_mask"])
    return out


def test_steps_that_train_nothing_warn_once_then_stop_the_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, opt = parts()
    with pytest.raises(TrainingStalled, match=r"3 steps in a row \(1\.\.3\) trained no token"):
        fit(model, opt, dataset(), masked, GRPOObjective(), steps=10, max_empty_steps=3)
    assert caplog.text.count("trained no token") == 1  # warned once, at step 1
    # None: the run goes on regardless (and still warned once).
    caplog.clear()
    result = fit(model, opt, dataset(), masked, GRPOObjective(), steps=6, max_empty_steps=None)
    assert result.updates == 6 and caplog.text.count("trained no token") == 1
    with pytest.raises(ValueError, match="max_empty_steps=0 must be None or an int >= 1"):
        fit(model, opt, dataset(), masked, GRPOObjective(), steps=1, max_empty_steps=0)


def test_a_source_that_always_fails_stops_the_run_with_its_errors(tmp_path: Path) -> None:
    import threading

    from dew.core import Rollout, RolloutKey, Status, Task, ThreadedSource
    from dew.objectives.rl.scheduler import RolloutScheduler

    class Broken(ThreadedSource):
        def run(self, task: Task, key: RolloutKey, stop: threading.Event) -> Rollout:
            return Rollout(key=key, task=task, status=Status.INFRA_ERROR, error="sandbox gone")

    model, opt = parts()
    objective = GRPOObjective()
    with (
        Broken(workers=2) as source,
        RolloutScheduler(
            objective, source, _Engine(), width=WIDTH, rows=8, groups=2, max_attempts=2
        ) as scheduler,
    ):
        with pytest.raises(TrainingStalled) as caught:
            fit(model, opt, dataset(), scheduler, objective, steps=10, max_empty_steps=2)
    message = str(caught.value)
    assert "2 steps in a row (1..2) trained no token: every group was abandoned" in message
    assert "infra_error: sandbox gone" in message  # the source's own words


class _Engine:
    def load(self, variables: Any, version: int) -> None:
        pass


@pytest.mark.parametrize("max_grad_norm", [1e-3, None])
def test_max_grad_norm_bounds_the_step_and_none_leaves_it_whole(
    tmp_path: Path, max_grad_norm: float | None
) -> None:
    # Plain SGD with lr 1: the step is the (clipped) gradient itself, so its norm shows
    # what clipping did (AdamW would hide it: its update does not scale with the gradient).
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = make_model(size="tiny", seed=0, max_positions=64)
    before = [p.detach().clone() for p in model.parameters()]
    seen: list[dict] = []
    fit(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        dataset(),
        rollout,
        GRPOObjective(),
        steps=1,
        max_grad_norm=max_grad_norm,
        log=[seen.append],
        tensorboard=False,
    )
    step = torch.sqrt(
        sum(((p.detach() - b) ** 2).sum() for p, b in zip(model.parameters(), before, strict=True))
    )
    if max_grad_norm is None:
        assert "grad_norm" not in seen[0]
        assert float(step) > 10 * 1e-3  # the whole gradient: far above the other bound
    else:
        assert seen[0]["grad_norm"] > 10 * max_grad_norm  # the norm before clipping
        assert float(step) == pytest.approx(max_grad_norm, rel=1e-3)


def test_tensorboard_false_writes_no_events_and_config_reaches_the_checkpoint(
    tmp_path: Path,
) -> None:
    run(tmp_path / "on", 1)
    assert list((tmp_path / "on" / "tensorboard").glob("events.out.tfevents.*"))
    _, result = run(tmp_path / "off", 1, tensorboard=False, config={"lr": 0.5, "task": "x"})
    assert not (tmp_path / "off" / "tensorboard").exists()
    state = json.loads((result.checkpoint / "state.json").read_text())
    assert state["extra"]["config"] == {"lr": 0.5, "task": "x"}
