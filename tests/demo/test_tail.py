"""The heavy-tailed workload: seeded lognormal lengths, per-call latencies, multi-turn
episodes, and every parameter taking effect."""

from __future__ import annotations

import math
import random
import statistics
import threading

import pytest

from dew.core import Call, RolloutKey, SamplingParams, Status, Task
from dew.demo.model import make_model, make_tokenizer
from dew.demo.tail import TailEnv, Workload, copy_credit, make_tail_task, turns_max_chain
from dew.objectives.rl.sources import EnvironmentSource
from dew.serving import RolloutServer

TOK = make_tokenizer()
EOS = TOK.eos_token_id


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


class Sleeps:
    """Records what the workload sleeps, without sleeping."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._lock = threading.Lock()

    def __call__(self, seconds: float) -> None:
        with self._lock:
            self.seconds.append(seconds)


def call_of(prompt: list[int], completion: list[int]) -> Call:
    return Call(
        prompt=prompt,
        completion=completion,
        log_probs=[0.0] * len(completion),
        version=0,
        finish_reason="stop" if completion[-1:] == [EOS] else "length",
    )


def test_lengths_are_lognormal_per_task_and_capped() -> None:
    work = Workload()
    task = make_tail_task(4000, seed=0, tokenizer=TOK, workload=work)
    lengths = [len(t) for t in task.texts]
    # median 24 and sigma 0.9: the sample median is within a few percent of 24, p99 is
    # about e^(2.33 x 0.9) = 8x the median, and about 1% of draws reach the cap
    assert 22 <= statistics.median(lengths) <= 26
    p99 = sorted(lengths)[int(0.99 * len(lengths))]
    assert 120 <= p99 <= work.length_cap
    assert min(lengths) >= 1 and max(lengths) == work.length_cap
    capped = sum(n == work.length_cap for n in lengths) / len(lengths)
    assert 0.003 <= capped <= 0.03
    sigma = statistics.stdev(math.log(n) for n in lengths if 1 < n < work.length_cap)
    assert 0.75 <= sigma <= 1.0
    assert all(t.isdigit() for t in task.texts)
    for text, prompt, answer in zip(task.texts[:50], task.prompts, task.answers, strict=False):
        assert prompt == ids(text + "=") and answer == ids(text)
    assert task.max_prompt == max(map(len, task.prompts))


def test_tasks_depend_on_the_seed_and_id_only() -> None:
    a = make_tail_task(100, seed=3, tokenizer=TOK)
    assert make_tail_task(10, seed=3, tokenizer=TOK).texts == a.texts[:10]  # any n
    assert make_tail_task(10, seed=3, tokenizer=TOK).turns == a.turns[:10]
    assert make_tail_task(100, seed=4, tokenizer=TOK).texts != a.texts
    with pytest.raises(ValueError, match="n must be"):
        make_tail_task(0, tokenizer=TOK)


def test_copy_credit() -> None:
    assert copy_credit([*ids("407"), EOS], [*ids("407"), EOS]) == 1.0
    assert copy_credit([*ids("407"), EOS], [*ids("4x7"), EOS]) == 0.75
    # a wrong digit earns the partial share only where a digit belongs
    digits = frozenset(ids("0123456789"))
    assert copy_credit(ids("407"), ids("417"), digits=digits, partial=0.25) == 2.25 / 3
    assert copy_credit(ids("407"), ids("4x7"), digits=digits, partial=0.25) == 2 / 3
    assert copy_credit([*ids("4"), EOS], ids("45"), digits=digits, partial=0.25) == 0.5
    assert copy_credit(ids("407"), ids("417")) == 2 / 3  # no partial credit by default
    assert copy_credit([*ids("407"), EOS], ids("407")) == 0.75  # never stopped
    # running on past the answer dilutes the credit like missing tokens do
    assert copy_credit([*ids("407"), EOS], ids("4071234")) == 3 / 7
    assert copy_credit(ids("407"), []) == 0.0
    assert copy_credit([], []) == 0.0


def test_the_verifier_sleeps_a_drawn_latency_per_call() -> None:
    sleeps = Sleeps()
    task = make_tail_task(8, seed=0, tokenizer=TOK, sleep=sleeps)
    right = [*task.answers[2], EOS]
    assert task.verifier(Task("2"), "", call_of(task.prompts[2], right)) == {"copy": 1.0}
    wrong = task.verifier(Task("2"), "", call_of(task.prompts[2], [*right[:-1], 5, 5, EOS]))
    assert 0 < wrong["copy"] < 1
    assert len(sleeps.seconds) == 2 and sleeps.seconds[0] != sleeps.seconds[1]
    assert all(0 < s < 2.0 for s in sleeps.seconds)
    with pytest.raises(ValueError, match="task 'x'"):
        task.verifier(Task("x"), "", call_of(task.prompts[0], right))
    with pytest.raises(ValueError, match="task '8'"):
        task.verifier(Task("8"), "", call_of(task.prompts[0], right))


def test_latencies_are_lognormal_around_the_median() -> None:
    work = Workload()
    rng = random.Random(0)
    draws = [work.latency(rng) for _ in range(5000)]
    assert 0.046 <= statistics.median(draws) <= 0.054
    assert 0.5 <= statistics.stdev(math.log(d) for d in draws) <= 0.7
    # a zero median turns the latency off
    sleeps = Sleeps()
    quiet = make_tail_task(4, tokenizer=TOK, workload=Workload(latency_median=0), sleep=sleeps)
    quiet.verifier(Task("0"), "", call_of(quiet.prompts[0], [EOS]))
    assert sleeps.seconds == []


def test_non_default_parameters_take_effect() -> None:
    short = Workload(length_median=3, length_sigma=0.0, length_cap=5, turn_median=2, turn_cap=2)
    task = make_tail_task(200, seed=0, tokenizer=TOK, workload=short)
    assert {len(t) for t in task.texts} == {3}  # sigma 0: every length is the median
    assert {len(s) for turns in task.turns for s in turns} == {2}
    capped = make_tail_task(200, tokenizer=TOK, workload=Workload(length_median=50, length_cap=7))
    assert max(len(t) for t in capped.texts) == 7
    three = make_tail_task(50, tokenizer=TOK, workload=Workload(min_turns=3, max_turns=3))
    assert {len(t) for t in three.turns} == {3}
    default = make_tail_task(400, tokenizer=TOK)
    assert {len(t) for t in default.turns} == {2, 3, 4}
    # format_credit: what a wrong digit earns
    answer = [*make_tail_task(1, tokenizer=TOK).answers[0], EOS]
    wrong = [(t - 6 + 1) % 10 + 6 if t != EOS else t for t in answer]  # every digit off by one
    assert ids("0123456789") == list(range(6, 16))
    for credit in (0.0, 0.25, 0.5):
        task = make_tail_task(1, tokenizer=TOK, workload=Workload(format_credit=credit))
        got = task.verifier(Task("0"), "", call_of(task.prompts[0], wrong))["copy"]
        assert got == pytest.approx((1 + credit * (len(answer) - 1)) / len(answer))
    slow = Workload(latency_median=0.5, latency_sigma=0.0)
    sleeps = Sleeps()
    task = make_tail_task(2, tokenizer=TOK, workload=slow, sleep=sleeps)
    task.verifier(Task("0"), "", call_of(task.prompts[0], [EOS]))
    assert sleeps.seconds == [pytest.approx(0.5)]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("length_median", 0.5),
        ("turn_median", 0),
        ("length_sigma", -1.0),
        ("latency_median", float("nan")),
        ("latency_sigma", float("inf")),
        ("length_cap", 0),
        ("turn_cap", 1.5),
        ("min_turns", 0),
        ("max_turns", 1),
        ("format_credit", 1.5),
        ("format_credit", float("nan")),
    ],
)
def test_bad_parameters_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        Workload(**{field: value})  # type: ignore[arg-type]


def test_describe_names_every_parameter() -> None:
    work = Workload(length_median=30, latency_median=0.12, max_turns=5, format_credit=0.3)
    text = work.describe()
    for part in ("median 30", "0.9", "192", "120 ms", "0.6", "2-5 turns", "48", "earns 0.3"):
        assert part in text, (part, text)


def test_an_episode_copies_each_segment_after_a_tool_call() -> None:
    sleeps = Sleeps()
    task = make_tail_task(20, seed=1, tokenizer=TOK, sleep=sleeps)
    env = task.env()
    with pytest.raises(RuntimeError, match="reset"):
        env.step("1")
    segments = task.turns[5]
    assert env.reset(Task("5")) == segments[0] + "="
    for turn, segment in enumerate(segments):
        obs = env.step(segment if turn else segment + "99")  # the first runs on 2 digits
        assert len(sleeps.seconds) == turn + 1
        assert obs == (segments[turn + 1] + "=" if turn + 1 < len(segments) else None)
    first = len(segments[0]) / (len(segments[0]) + 2)
    assert env.score() == {"copy": pytest.approx((first + len(segments) - 1) / len(segments))}
    again = TailEnv(task)  # a fresh episode starts clean
    again.reset(Task("5"))
    assert again.score() == {"copy": 0.0}
    with pytest.raises(ValueError, match="task '20'"):
        again.reset(Task("20"))


@pytest.mark.timeout(120)
def test_multi_turn_episodes_fit_the_chain_bound_on_a_real_engine() -> None:
    """Untrained replies run on to the token cap: the bound must still hold them all."""
    work = Workload(latency_median=0.0)
    task = make_tail_task(16, seed=0, tokenizer=TOK, workload=work)
    width = turns_max_chain(task, TOK, max_tokens=work.turn_cap)
    model = make_model(max_positions=512)
    server = RolloutServer(model, max_batch=16)
    source = EnvironmentSource(
        server,
        task.env,
        tokenizer=TOK,
        max_turns=work.max_turns,
        max_context=width,
        workers=4,
        sampling=SamplingParams(max_tokens=work.turn_cap, stop_ids=()),  # never stops early
    )
    try:
        for i in range(4):
            rollout = source.run(Task(str(i)), RolloutKey(i, 0, 0), threading.Event())
            assert rollout.status is Status.COMPLETED, rollout.error
            assert len(rollout.calls) == len(task.turns[i])
            chain = rollout.calls[-1]
            assert len(chain.prompt) + len(chain.completion) <= width
            assert 0 <= rollout.reward <= 1
    finally:
        source.close()
        server.close()
