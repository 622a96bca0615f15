import math

import pytest

from dew.objectives.rl.config import SchedulerConfig
from dew.plan._engine import EngineConfig, EngineModel
from dew.plan._trace import Figures
from dew.plan.planner import Scenario, plan, recommend, simulate
from dew.plan.presets import LengthPreset


def test_engine_single_sequence_and_fifo():
    cfg = EngineConfig(a=1.0, b=0.5, max_active=2)
    e = EngineModel(cfg)
    e.add("x", 4)
    e.add("y", 2)
    e.add("z", 1)  # queued: two slots
    assert (e.active, e.queued) == (2, 1)
    # Two active: 2 s per iteration. y finishes after 2 tokens, at t=4.
    assert e.next_completion() == pytest.approx(4.0)
    e.served = 7  # a push: z gets its slot (first token) after it
    assert [(k, t) for k, t, _ in e.advance(4.0)] == [("y", pytest.approx(4.0))]
    assert e.active == 2
    done = e.advance(100.0)
    assert [k for k, _, _ in done] == ["z", "x"]
    assert [v for _, _, v in done] == [7, 0]
    assert e.generated == pytest.approx(7.0)


def test_engine_cancel_reports_partial_tokens():
    e = EngineModel(EngineConfig(a=1.0, b=0.0, max_active=1))
    e.add("x", 10)
    e.add("y", 10)
    e.advance(3.0)
    assert e.cancel("x") == (pytest.approx(3.0), 0)
    assert e.active == 1  # y got the slot at once
    assert e.cancel("y") == (0.0, 0)
    assert e.active == 0
    assert e.cancel("nope") is None
    with pytest.raises(ValueError, match="length"):
        e.add("w", 0)


def _heavy(T_ratio: float, steps: int = 10) -> Scenario:
    return Scenario.relative("dapo", 32, 8, T_ratio, steps=steps, warmup=3)


def test_ahead_beats_synchronous_on_heavy_tails():
    sc = _heavy(0.5)
    sync, ahead = plan(SchedulerConfig.tight(ahead=0), sc), plan(SchedulerConfig.tight(ahead=1), sc)
    assert sync.fraction < ahead.fraction
    assert sync.lag == 0 and ahead.lag == pytest.approx(1.0)
    for f in (sync, ahead):
        assert 0 < f.fraction <= 1.0
        assert f.length_bias == pytest.approx(1.0)
        assert f.wasted == pytest.approx(0.0, abs=1e-9)
        assert 0 <= f.trainer_idle <= 1 and -1e-9 <= f.engine_idle <= 1


def test_trainer_bound_runs_reach_the_limit():
    sc = _heavy(20.0, steps=6)
    f = plan(SchedulerConfig.tight(ahead=1), sc)
    assert f.fraction == pytest.approx(1.0, abs=0.01)
    assert f.trainer_idle < 0.01


def test_oversample_and_admit_favour_short_rollouts():
    sc = _heavy(0.5)
    over = plan(SchedulerConfig.tight(ahead=1, oversample=4), sc)
    admit = plan(SchedulerConfig.tight(ahead=1, admit=24), sc)
    assert over.length_bias < 0.9 and admit.length_bias < 0.95
    assert over.wasted > 0 and admit.wasted > 0
    assert admit.samples_ratio == pytest.approx(admit.fraction * 24 / 32)


def test_trace_follows_the_trainer_timeline():
    T = 5.0
    p = LengthPreset("flat", math.log(100), 0.0, 0.0, 1000)
    sc = Scenario(p, tasks=2, group=2, T=T, steps=3, warmup=1)
    trace = simulate(SchedulerConfig.tight(ahead=0), sc)
    cfg = sc.engine
    gen = 100 * (cfg.a + cfg.b * 4)  # 4 sequences of 100 tokens, all at once
    for k, s in enumerate(trace.steps):
        assert s.call == pytest.approx(k * (gen + T))
        assert s.waited == pytest.approx(gen)
        assert s.end - s.ready == pytest.approx(T)
        assert (s.samples, s.tokens) == (4, 400)


def test_policy_and_scenario_validate():
    with pytest.raises(ValueError, match="max_lag"):
        SchedulerConfig(ahead=2, max_lag=1)
    with pytest.raises(ValueError, match="warmup"):
        Scenario.relative("dapo", 4, 2, 1.0, steps=2, warmup=2)


def test_engine_slot_freed_before_a_push_serves_the_old_version():
    # Slots are filled lazily; a push must not reach a request whose slot freed before it.
    e = EngineModel(EngineConfig(a=1.0, b=0.0, max_active=1))
    e.add("x", 2)
    e.add("y", 1)
    assert e.next_until(10.0) == ("x", pytest.approx(2.0), 0)  # y's slot is free at t=2
    e.served = 5
    e.add("z", 1)
    assert [(k, v) for k, _, v in e.advance(10.0)] == [("y", 0), ("z", 5)]


def test_the_scenario_sets_the_group_and_timeouts_are_refused():
    sc = _heavy(0.5, steps=6)
    base = plan(SchedulerConfig.tight(ahead=1), sc)
    assert plan(SchedulerConfig.tight(ahead=1, groups=3), sc) == base  # groups=8 from sc
    with pytest.raises(ValueError, match=r"timeout=5\.0: the planner does not model"):
        plan(SchedulerConfig.tight(ahead=1, timeout=5.0), sc)


def test_sync_every_pushes_every_other_step():
    p = LengthPreset("flat", math.log(100), 0.0, 0.0, 1000)
    sc = Scenario(p, tasks=2, group=2, T=1.0, steps=4, warmup=1)
    trace = simulate(SchedulerConfig.tight(ahead=0, sync_every=2), sc)
    assert [s.lag for s in trace.steps] == [0, 1, 0, 1]
    assert [s.lag for s in simulate(SchedulerConfig.tight(ahead=0), sc).steps] == [0] * 4


def _figures(samples_per_s: float, bias: float = 1.0, lag: float = 1.0, wasted: float = 0.0):
    return Figures(
        fraction=1.0,
        samples_ratio=1.0,
        samples_per_s=samples_per_s,
        step_time=1.0,
        limit_step=1.0,
        trainer_idle=0.0,
        engine_idle=0.0,
        lag=lag,
        token_lag=lag,
        length_bias=bias,
        wasted=wasted,
    )


def test_recommend_the_fastest_unbiased_policy():
    sync, one, two = (SchedulerConfig.tight(ahead=a) for a in (0, 1, 2))
    cut = SchedulerConfig.tight(ahead=1, oversample=4)
    rows = [
        (sync, _figures(60.0, lag=0.0)),
        (one, _figures(100.0, lag=1.0)),
        (two, _figures(101.0, lag=2.0)),  # within 2% of the fastest: the fresher one wins
        (cut, _figures(130.0, bias=0.9, wasted=0.3)),  # fastest, but trains shorter answers
    ]
    assert recommend(rows) == one
    assert recommend(rows, max_bias=0.1) == cut  # a looser bound admits the cutting policy
    assert recommend(rows[:1] + rows[2:]) == two
    # ties on speed and lag: the one that wastes fewer tokens
    os2 = SchedulerConfig.tight(ahead=1, oversample=2)
    assert recommend([(os2, _figures(100.0, wasted=0.2)), (one, _figures(100.0))]) == one
    # every policy biased: the least biased one
    assert recommend([(cut, _figures(130.0, bias=0.9)), (one, _figures(90.0, bias=0.95))]) == one
    with pytest.raises(ValueError, match="rows"):
        recommend([])
    with pytest.raises(ValueError, match="max_bias"):
        recommend(rows, max_bias=-1.0)


def test_recommend_on_a_planned_heavy_tail_prefers_running_ahead():
    sc = Scenario.relative("tail", 8, 8, 1.0, steps=8, warmup=2)
    policies = [SchedulerConfig.tight(ahead=a) for a in (0, 1)]
    planned = [(p, plan(p, sc)) for p in policies]
    assert recommend(planned) == SchedulerConfig.tight(ahead=1)


def test_a_fixed_verifier_latency_adds_to_each_synchronous_step():
    # Flat lengths, latency 2 s with sigma 0: every rollout is scored 2 s after its
    # last token, so a synchronous step waits generation + 2 s, and the trainer
    # then trains T; the engine is idle while the scores come in.
    T, latency = 5.0, 2.0
    p = LengthPreset("flat", math.log(100), 0.0, 0.0, 1000)
    sc = Scenario(p, tasks=2, group=2, T=T, steps=3, warmup=1, latency=latency)
    trace = simulate(SchedulerConfig.tight(ahead=0), sc)
    cfg = sc.engine
    gen = 100 * (cfg.a + cfg.b * 4)
    for k, s in enumerate(trace.steps):
        assert s.call == pytest.approx(k * (gen + latency + T))
        assert s.waited == pytest.approx(gen + latency)
        assert (s.samples, s.tokens) == (4, 400)


def test_running_ahead_hides_the_verifier_latency_that_sync_waits_for():
    scored = Scenario.relative("tail", 8, 8, 1.0, steps=10, warmup=3, latency=0.05)
    drawn = Scenario.relative(
        "tail", 8, 8, 1.0, steps=10, warmup=3, latency=0.05, latency_sigma=0.6
    )
    sync, ahead = SchedulerConfig.tight(ahead=0), SchedulerConfig.tight(ahead=2)
    instant = Scenario.relative("tail", 8, 8, 1.0, steps=10, warmup=3)
    assert plan(sync, scored).step_time == pytest.approx(plan(sync, instant).step_time + 0.05)
    assert plan(sync, drawn).step_time > plan(sync, scored).step_time  # the tail of the draws
    assert plan(ahead, drawn).fraction > 1.5 * plan(sync, drawn).fraction
    # Cutting the slowest verifications (oversample) costs no length bias: within a
    # group of the tail preset every sample has its task's length.
    over = plan(SchedulerConfig.tight(ahead=1, oversample=2), drawn)
    assert over.length_bias == pytest.approx(1.0) and over.wasted > 0


def test_verifier_latencies_are_seeded_per_rollout():
    runs = [
        simulate(
            SchedulerConfig.tight(ahead=1),
            Scenario.relative(
                "tail", 4, 4, 1.0, steps=4, warmup=1, latency=0.05, latency_sigma=0.6, seed=s
            ),
        )
        for s in (0, 0, 1)
    ]
    ends = [[st.end for st in r.steps] for r in runs]
    assert ends[0] == ends[1] and ends[0] != ends[2]
    for name in ("latency", "latency_sigma"):
        with pytest.raises(ValueError, match=name):
            Scenario.relative("tail", 4, 4, 1.0, **{name: -0.1})


def test_a_fleet_model_routes_a_group_to_one_engine_and_runs_its_engines_side_by_side():
    from dew.core import RolloutKey
    from dew.plan._engine import FleetModel

    cfg = EngineConfig(a=1.0, b=0.0, max_active=4)
    fleet = FleetModel([cfg, cfg])
    for s in range(3):  # group 0: all on the first engine (the least loaded at its start)
        fleet.add(RolloutKey(0, s, 0), 2)
    fleet.add(RolloutKey(1, 0, 0), 4)  # group 1: the other engine, now the least loaded
    first, second = fleet.engines
    assert (first.active, second.active) == (3, 1)
    fleet.add(RolloutKey(0, 3, 0), 1)  # affinity wins over load
    assert (first.active, second.active) == (4, 1)
    done = fleet.advance(10.0)
    assert [(k.group, k.sample, t) for k, t, _ in done] == [
        (0, 3, 1.0),
        (0, 0, 2.0),
        (0, 1, 2.0),
        (0, 2, 2.0),
        (1, 0, 4.0),
    ]
    assert fleet.now == 10.0 and first.now == second.now == 10.0
    assert fleet.generated == pytest.approx(11.0)
    assert fleet.cancel(RolloutKey(5, 0, 0)) is None


def test_two_engines_plan_as_one_engine_of_twice_the_slots_would_on_a_wide_batch():
    p = LengthPreset("flat", math.log(50.0), 0.0, 0.0, 1000)
    engine = EngineConfig(a=1e-3, b=0.0, max_active=8)
    one = plan(
        SchedulerConfig.tight(ahead=0), Scenario(p, 8, 4, T=0.0, steps=4, warmup=1, engine=engine)
    )
    two = plan(
        SchedulerConfig.tight(ahead=0),
        Scenario(p, 8, 4, T=0.0, steps=4, warmup=1, engine=engine, engines=2),
    )
    # 32 samples of 50 tokens: one engine of 8 slots runs 4 waves, two run 2 each
    assert one.step_time == pytest.approx(4 * 50 * 1e-3)
    assert two.step_time == pytest.approx(2 * 50 * 1e-3)
    with pytest.raises(ValueError, match="engines=0"):
        Scenario(p, 8, 4, T=0.0, engines=0)


def test_a_trainer_sharing_the_cores_with_the_engine_slows_both_while_they_overlap():
    from dew.core import RolloutKey
    from dew.plan.planner import _Run

    p = LengthPreset("flat", math.log(3.0), 0.0, 0.0, 1000)
    sc = Scenario(p, 1, 2, T=2.0, engine=EngineConfig(a=1.0, b=0.0, max_active=4), sharing=0.5)
    run = _Run(SchedulerConfig.tight(ahead=1), sc)
    run.engine.add(RolloutKey(0, 0, 0), 3)  # 3 tokens at 1 s each, alone
    run.train_shared(2.0)
    # both at half speed: the trainer's 2 s of work end at t=4, when the engine has
    # made 2 tokens; its last token then takes 1 s alone
    assert run.engine.now == pytest.approx(4.0)
    assert run.engine.next_completion() == pytest.approx(5.0)
    assert run.engine.slowdown == 1.0
    idle = _Run(SchedulerConfig.tight(ahead=1), sc)
    idle.train_shared(1.5)  # no engine runs beside it: the trainer at full speed
    assert idle.engine.now == pytest.approx(1.5)


def test_sharing_leaves_a_synchronous_plan_alone_and_slows_an_overlapping_one():
    p = LengthPreset("flat", math.log(40.0), 0.0, 0.0, 1000)
    engine = EngineConfig(a=1e-3, b=1e-5, max_active=64)

    def step(ahead: int, sharing: float) -> float:
        sc = Scenario(p, 4, 4, T=0.05, steps=6, warmup=2, engine=engine, sharing=sharing)
        return plan(SchedulerConfig.tight(ahead=ahead), sc).step_time

    assert step(0, 0.5) == pytest.approx(step(0, 1.0))  # nothing runs beside the trainer
    assert step(1, 0.5) > step(1, 1.0) * 1.1
    with pytest.raises(ValueError, match="sharing=0"):
        Scenario(p, 4, 4, T=0.05, sharing=0.0)


def test_a_multi_turn_rollout_frees_its_slot_between_turns():
    p = LengthPreset("flat", math.log(4.0), 0.0, 0.0, 1000)
    engine = EngineConfig(a=1.0, b=1.0, max_active=1)  # one slot, 2 s per token

    def step(turns: tuple[float, ...]) -> float:
        sc = Scenario(p, 1, 2, T=0.0, steps=3, warmup=1, engine=engine, latency=5.0, turns=turns)
        return plan(SchedulerConfig.tight(ahead=0), sc).step_time

    # one call each: A's 4 tokens (0-8), B's (8-16), B's verifier 5 s
    assert step((1.0,)) == pytest.approx(21.0)
    # two calls of 2 tokens, 5 s outside after each, the slot free meanwhile: A 0-4,
    # B 4-8, A again 9-13 (its tool done at 9), B 13-17 (its at 13), B's verifier to 22
    assert step((0.0, 1.0)) == pytest.approx(22.0)
    with pytest.raises(ValueError, match="turns="):
        Scenario(p, 1, 2, T=0.0, turns=(0.0, 0.0))
