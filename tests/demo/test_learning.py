"""Training works: the demo task's reward rises far above the untrained model's.

A short, seeded run of the real loop (in-process engine, scheduler, GRPO objective,
weight pushes). It fails if the loss, the advantages or the weight push break: with
any of them broken the reward stays where the untrained model has it (or falls).

Measured on a 2-core CPU (2026-12-02; 100 steps at lr 3e-3; mean reward of the last 20
steps): 0.235, 0.273 and 0.261 in three runs (the scheduler's timing varies them), with
the untrained model at 0.015 over the first 10. The bound, 0.08, is five times the
untrained reward and a third of the lowest trained one. Seeded by hand, each fault kept
the run at the untrained level: the loss's sign flipped 0.000, the advantages zeroed
0.011, the engine's weight copy dropped 0.011.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dew.demo.run import DemoConfig, run_demo

STEPS = 100
BOUND = 0.08


@pytest.mark.timeout(240)
def test_the_demo_task_learns(tmp_path: Path) -> None:
    config = DemoConfig.for_task("single", steps=STEPS, lr=3e-3, checkpoint_every=1000)
    result = run_demo(config, run_dir=tmp_path / "run", progress=False, plot=False)
    rewards = result.rewards()
    assert len(rewards) == STEPS
    first, last = sum(rewards[:10]) / 10, sum(rewards[-20:]) / 20
    assert first < 0.05, (first, last)  # untrained: a digit right by chance, now and then
    assert last > BOUND, (first, last)
