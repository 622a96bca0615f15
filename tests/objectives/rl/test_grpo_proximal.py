"""GRPOObjective(proximal="forward"): the loss's own forward as the proximal policy.

Under one optimizer update per batch it is the rescored proximal exactly, with one
forward fewer; the scheduler then skips its rescoring; and a batch whose weights have
moved on (a second update) is refused, never trained on a wrong proximal.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dew.data import Prefetch
from dew.objectives.rl.grpo import PROXIMAL_STAMP, GRPOObjective, optimizer_steps
from dew.objectives.rl.scheduler import RolloutScheduler

from .conftest import WAIT, RecordingPublisher, ScriptedSource, task_dataset
from .test_grpo import grads, loss_batch, sharp_model

pytestmark = pytest.mark.timeout(60)


def off_policy(model: torch.nn.Module, seed: int = 3) -> dict[str, np.ndarray]:
    """A loss batch whose behavior log-probs differ from the model's own (stale
    rollouts), so the importance weights and the clip both have work to do."""
    batch = loss_batch(model, seed=seed)
    with torch.no_grad():
        current = GRPOObjective().packed_log_probs(model, batch).numpy()
    noise = np.random.default_rng(seed).normal(scale=1.0, size=current.shape)
    batch["behavior_log_probs"] = (current + noise).astype(np.float32)
    return batch


def test_the_forward_proximal_gives_the_rescored_loss_gradients_and_metrics() -> None:
    model = sharp_model("qwen2")
    out = {}
    for mode in ("rescore", "forward"):
        objective = GRPOObjective(clip=0.1, proximal=mode)
        batch = off_policy(model)
        objective.fill_proximal(model, batch)
        model.zero_grad()
        loss, metrics = objective.loss(model, batch)
        loss.backward()
        out[mode] = (float(loss.detach()), metrics, grads(model), batch)
    rescored, forward = out["rescore"], out["forward"]
    assert np.isfinite(rescored[3]["proximal_log_probs"]).all()
    assert PROXIMAL_STAMP not in rescored[3]
    assert np.isnan(forward[3]["proximal_log_probs"]).all()  # never mistaken for values
    assert forward[0] == pytest.approx(rescored[0], rel=1e-5)
    for name in ("mismatch_kl", "importance_mean", "importance_max", "clip_fraction"):
        assert forward[1][name] == pytest.approx(rescored[1][name], rel=1e-4, abs=1e-6)
    assert rescored[1]["importance_capped_fraction"] > 0  # the weights mattered here
    for a, b in zip(rescored[2], forward[2], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_a_forward_proximal_batch_is_refused_once_an_optimizer_stepped() -> None:
    model = sharp_model("llama")
    objective = GRPOObjective(proximal="forward")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = off_policy(model)
    objective.fill_proximal(model, batch)
    # micro-batches: several losses over parts of one batch before the one update
    for part in (slice(0, 2), slice(2, 4)):
        loss, _ = objective.loss(model, {k: v[part] if v.ndim else v for k, v in batch.items()})
        loss.backward()
    before = optimizer_steps()
    optimizer.step()
    assert optimizer_steps() == before + 1
    with pytest.raises(ValueError, match="an optimizer stepped since this batch"):
        objective.loss(model, batch)
    again = off_policy(model)  # a batch handed over under the new weights trains
    objective.fill_proximal(model, again)
    objective.loss(model, again)[0].backward()


def test_each_objective_refuses_the_other_ones_batches_and_an_unknown_mode() -> None:
    model = sharp_model("qwen2")
    batch = off_policy(model)
    GRPOObjective(proximal="forward").fill_proximal(model, batch)
    with pytest.raises(ValueError, match="packed for proximal='forward'"):
        GRPOObjective().loss(model, batch)
    with pytest.raises(ValueError, match="proximal='both'"):
        GRPOObjective(proximal="both")  # type: ignore[arg-type]
    plain = off_policy(model)
    del plain["proximal_log_probs"]  # the forward mode needs none of its own
    GRPOObjective(proximal="forward").loss(model, plain)
    with pytest.raises(ValueError, match="missing 'proximal_log_probs'"):
        GRPOObjective().loss(model, plain)


def test_a_scheduler_over_a_forward_objective_makes_no_rescoring_forward(
    source: ScriptedSource, publisher: RecordingPublisher, trainer
) -> None:
    model = sharp_model("qwen2")
    forwards: list[tuple[int, ...]] = []
    handle = model.register_forward_hook(lambda m, a, out: forwards.append(out.logits.shape))
    scheduler = RolloutScheduler(
        GRPOObjective(proximal="forward"), source, publisher, width=32, rows=4, groups=2, ahead=0
    )
    try:
        stream = Prefetch(scheduler.tasks(task_dataset(batch_size=2)).stream(), depth=0)
        fut = trainer(scheduler, model, next(stream), updates=0)
        source.wait_started(4)
        source.finish_all()
        out = fut.result(WAIT)
    finally:
        scheduler.close()
        handle.remove()
    assert forwards == []  # packed, stamped, and not rescored
    assert int(out[PROXIMAL_STAMP]) == optimizer_steps()
    assert np.isnan(out["proximal_log_probs"]).all()
    loss, metrics = GRPOObjective(proximal="forward").loss(model, out)
    assert torch.isfinite(loss) and metrics["trained_tokens"] > 0
