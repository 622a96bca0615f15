"""PromptSource on a real RolloutServer, with verifiers the tests script."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from dew.core import Call, RolloutKey, SamplingParams, Status, Task
from dew.demo.model import make_model, make_tokenizer
from dew.objectives.rl.sources import PromptSource
from dew.serving import RolloutServer

TOK = make_tokenizer()
WAIT = 60.0


@pytest.fixture(scope="module")
def server() -> Iterator[RolloutServer]:
    srv = RolloutServer(make_model("qwen2", "tiny", seed=2), seed=0)
    yield srv
    srv.close()


@pytest.fixture
def engine(server: RolloutServer) -> Any:
    return server


def key(i: int = 0) -> RolloutKey:
    return RolloutKey(group=0, sample=i, attempt=0)


class Recorder:
    """A verifier that returns a scripted value and records what it was shown."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.seen: list[tuple[Task, Any, Call]] = []
        self.lock = threading.Lock()

    def __call__(self, task: Task, completion: Any, call: Call) -> Any:
        with self.lock:
            self.seen.append((task, completion, call))
        if isinstance(self.out, BaseException):
            raise self.out
        return self.out


def run_one(source: PromptSource, task_id: str = "0") -> Any:
    return source.start(Task(task_id), key()).result(timeout=WAIT)


def test_stop_token_completes_and_the_verifier_sees_ids_without_it(
    engine: Any, server: RolloutServer
) -> None:
    verifier = Recorder(0.75)
    everything = range(server.vocab_size)  # any first token stops
    with PromptSource(
        engine,
        [[7, 8, 9], (10, 11)],
        verifier,
        sampling=SamplingParams(max_tokens=5, stop_ids=everything),
    ) as source:
        rollout = run_one(source, "1")
    assert rollout.status is Status.COMPLETED and rollout.truncation is None
    assert rollout.reward == 0.75 and dict(rollout.components) == {}
    (call,) = rollout.calls
    assert list(call.prompt) == [10, 11] and len(call.completion) == 1
    assert call.finish_reason == "stop"
    task, completion, seen_call = verifier.seen[0]
    assert task.id == "1" and completion == [] and seen_call is call


def test_max_tokens_truncates_and_is_still_scored(engine: Any) -> None:
    verifier = Recorder({"format": 0.25, "answer": 0.5})
    with PromptSource(
        engine, [[5, 6]], verifier, sampling=SamplingParams(max_tokens=4, stop_ids=())
    ) as source:
        rollout = run_one(source)
    assert rollout.status is Status.TRUNCATED and rollout.truncation == "length"
    assert rollout.reward == 0.75
    assert dict(rollout.components) == {"format": 0.25, "answer": 0.5}
    assert len(rollout.calls[0].completion) == 4
    assert verifier.seen[0][1] == list(rollout.calls[0].completion)


@pytest.mark.parametrize(
    "bad",
    [
        RuntimeError("grader crashed"),
        SystemExit(3),  # on a pool thread, only the verifier's own raise: its failure
        KeyboardInterrupt("grader"),
        float("nan"),
        "1.0",
        {"a": float("inf")},
        {"a": "x"},
        {},
    ],
)
def test_verifier_failure_is_infra_error_without_reward(engine: Any, bad: Any) -> None:
    with PromptSource(
        engine, [[5, 6]], Recorder(bad), sampling=SamplingParams(max_tokens=2)
    ) as source:
        rollout = run_one(source)
    assert rollout.status is Status.INFRA_ERROR
    assert rollout.reward is None and dict(rollout.components) == {}
    assert rollout.error and rollout.error.startswith("verifier failed")
    if isinstance(bad, BaseException):
        assert rollout.error == f"verifier failed: {type(bad).__name__}: {bad}"
    assert len(rollout.calls) == 1  # the generation is kept for inspection


@pytest.mark.timeout(120)
def test_cancel_aborts_the_generation(engine: Any, server: RolloutServer) -> None:
    with PromptSource(
        engine, [[5, 6]], Recorder(1.0), sampling=SamplingParams(max_tokens=1000, stop_ids=())
    ) as source:
        session = source.start(Task("0"), key())
        deadline = time.monotonic() + WAIT
        while server.stats()["active"] == 0:  # wait for the request to reach the engine
            assert time.monotonic() < deadline
            time.sleep(0.001)
        session.cancel()
        rollout = session.result(timeout=WAIT)
    assert rollout.status is Status.CANCELLED and rollout.reward is None
    assert server.stats()["active"] == 0


def test_text_prompts_and_chat_template(engine: Any) -> None:
    verifier = Recorder(1.0)
    prompts = [
        "12+3=",
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
    ]
    with PromptSource(
        engine, prompts[:1], verifier, tokenizer=TOK, sampling=SamplingParams(max_tokens=3)
    ) as source:
        assert source.sampling.stop_ids == (TOK.eos_token_id,)
    with PromptSource(
        engine,
        prompts[:1],
        verifier,
        tokenizer=TOK,
        sampling=SamplingParams(max_tokens=3, stop_ids=()),
    ) as source:
        rollout = run_one(source)
    assert list(rollout.calls[0].prompt) == TOK("12+3=")["input_ids"]
    text = verifier.seen[0][1]
    assert isinstance(text, str)
    assert rollout.calls[0].finish_reason == "length"  # nothing cut off: the text is it all
    assert text == TOK.decode(list(rollout.calls[0].completion), skip_special_tokens=False)

    with PromptSource(
        engine,
        prompts,
        verifier,
        tokenizer=TOK,
        chat_template=True,
        sampling=SamplingParams(max_tokens=3),
    ) as source:
        first = run_one(source, "0")
        second = run_one(source, "1")
    want0 = TOK.apply_chat_template(
        [{"role": "user", "content": "12+3="}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    want1 = TOK.apply_chat_template(prompts[1], add_generation_prompt=True, tokenize=True)[
        "input_ids"
    ]
    assert list(first.calls[0].prompt) == want0
    assert list(second.calls[0].prompt) == want1


class Column(Sequence[Any]):
    """A read-only sequence that is not a list (as a dataset column can be)."""

    def __init__(self, items: list[Any]) -> None:
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: Any) -> Any:
        return self._items[i]


def test_any_sequence_of_prompts_and_array_prompts(engine: Any) -> None:
    import numpy as np

    prompts = Column([np.array([5, 6, 7]), torch.tensor([8, 9])])
    with PromptSource(
        engine, prompts, Recorder(0.0), sampling=SamplingParams(max_tokens=2)
    ) as source:
        assert list(run_one(source, "0").calls[0].prompt) == [5, 6, 7]
        assert list(run_one(source, "1").calls[0].prompt) == [8, 9]


def test_dataset_column_prompts(engine: Any) -> None:
    import datasets

    table = datasets.Dataset.from_dict({"prompt": ["12=", "345="]})
    with PromptSource(
        engine, table["prompt"], Recorder(0.0), tokenizer=TOK, sampling=SamplingParams(max_tokens=2)
    ) as source:
        assert list(run_one(source, "1").calls[0].prompt) == TOK("345=")["input_ids"]
    # The whole table, with the column named (a table without it is refused up front).
    sampling = SamplingParams(max_tokens=2)
    with PromptSource(
        engine, table, Recorder(0.0), tokenizer=TOK, sampling=sampling, column="prompt"
    ) as source:
        assert list(run_one(source, "0").calls[0].prompt) == TOK("12=")["input_ids"]
    with pytest.raises(ValueError, match=r"prompts is a table with columns \['prompt'\]"):
        PromptSource(engine, table, Recorder(0.0), tokenizer=TOK, sampling=sampling)
    with pytest.raises(ValueError, match="column='text' is not one of"):
        PromptSource(engine, table, Recorder(0.0), tokenizer=TOK, sampling=sampling, column="text")
    with pytest.raises(ValueError, match="column= names a column of a table"):
        PromptSource(engine, ["1="], Recorder(0.0), tokenizer=TOK, sampling=sampling, column="x")


def test_bad_task_ids_and_configuration(engine: Any) -> None:
    with PromptSource(
        engine, [[5]], Recorder(0.0), sampling=SamplingParams(max_tokens=2)
    ) as source:
        for bad in ("1", "-1", "x", "0.5"):
            with pytest.raises(ValueError, match=r"rollout\(group=0, sample=3, attempt=0\)"):
                source.start(Task(bad), key(3))
    with pytest.raises(ValueError, match="max_tokens"):
        PromptSource(engine, [[5]], Recorder(0.0), sampling=SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="tokenizer"):
        PromptSource(
            engine, ["x"], Recorder(0.0), chat_template=True, sampling=SamplingParams(max_tokens=1)
        )
    with pytest.raises(ValueError, match="top_p"):
        PromptSource(engine, [[5]], Recorder(0.0), sampling=SamplingParams(max_tokens=1, top_p=0.0))
    with PromptSource(
        engine, ["text"], Recorder(0.0), sampling=SamplingParams(max_tokens=1)
    ) as source:
        with pytest.raises(ValueError, match="need a tokenizer"):
            source.start(Task("0"), key()).result(timeout=WAIT)


def test_defaults_to_the_served_models_eos() -> None:
    model = make_model("qwen2", "tiny", seed=2)
    with torch.no_grad():  # livelier than the default init, so greedy does not repeat
        for p in model.parameters():
            p.mul_(3.0)
    greedy = SamplingParams(max_tokens=6, temperature=0)
    with RolloutServer(model) as server:
        full = list(server.generate([5, 6], greedy, stop=None).completion)
    model.config.eos_token_id = full[2]  # the served model's end-of-sequence id
    model.generation_config.eos_token_id = full[2]
    with (
        RolloutServer(model) as server,
        PromptSource(server, [[5, 6]], Recorder(0.0), sampling=greedy) as source,
    ):
        assert source.sampling.stop_ids is None  # no tokenizer: the engine's eos applies
        rollout = run_one(source)
    call = rollout.calls[0]
    assert list(call.completion) == full[: full.index(full[2]) + 1]
    assert call.finish_reason == "stop" and rollout.status is Status.COMPLETED


@pytest.mark.timeout(120)
def test_many_sessions_at_once(engine: Any) -> None:
    prompts = [[6 + i % 40, 7, 8] for i in range(40)]
    verifier = Recorder(0.5)
    with PromptSource(
        engine, prompts, verifier, workers=16, sampling=SamplingParams(max_tokens=6, top_k=10)
    ) as source:
        sessions = [source.start(Task(str(i)), key(i)) for i in range(40)]
        rollouts = [s.result(timeout=WAIT) for s in sessions]
    assert {r.status for r in rollouts} <= {Status.COMPLETED, Status.TRUNCATED}
    assert [list(r.calls[0].prompt) for r in rollouts] == prompts
    assert all(r.calls[0].support is not None for r in rollouts)
    assert len(verifier.seen) == 40


class Counting:
    """The server, counting the generations it has finished (submit path only)."""

    def __init__(self, server: RolloutServer) -> None:
        self._server = server
        self.version = server.version
        self.finished = 0
        self.affinities: list[object] = []
        self._lock = threading.Lock()

    def generate(self, *args: Any, **kwargs: Any) -> Call:
        raise AssertionError("the submit path must not block in generate")

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        self.affinities.append(kwargs.get("affinity"))
        future = self._server.submit(*args, **kwargs)
        future.add_done_callback(self._count)
        return future

    def _count(self, _: object) -> None:
        with self._lock:
            self.finished += 1


@pytest.mark.timeout(120)
def test_submit_path_generates_everything_while_the_only_worker_verifies(
    server: RolloutServer,
) -> None:
    gate = threading.Event()
    threads: list[str] = []

    def slow(task: Task, completion: Any, call: Call) -> float:
        threads.append(threading.current_thread().name)
        assert gate.wait(WAIT)
        return 1.0

    engine = Counting(server)
    with PromptSource(
        engine, [[5, 6, 7]], slow, workers=1, sampling=SamplingParams(max_tokens=3, stop_ids=())
    ) as source:
        sessions = [source.start(Task("0"), key(i)) for i in range(8)]
        deadline = time.monotonic() + WAIT
        # One pool thread, stuck in the first verifier: the generations go on without it.
        while engine.finished < 8 or not threads:
            assert time.monotonic() < deadline, "generations waited for a worker"
            time.sleep(0.001)
        assert not any(s.done() for s in sessions) and len(threads) == 1
        gate.set()
        rollouts = [s.result(timeout=WAIT) for s in sessions]
    assert all(r.status is Status.TRUNCATED and r.reward == 1.0 for r in rollouts)
    assert len(threads) == 8 and "RolloutServer-engine" not in threads  # never on the engine


@pytest.mark.timeout(120)
def test_close_waits_for_sessions_still_in_the_engine(engine: Any, server: RolloutServer) -> None:
    source = PromptSource(
        engine, [[5, 6]], Recorder(1.0), sampling=SamplingParams(max_tokens=1000, stop_ids=())
    )
    session = source.start(Task("0"), key())
    deadline = time.monotonic() + WAIT
    while server.stats()["active"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    source.close()
    assert session.done()  # resolved before close() returned, on either path
    assert session.result(timeout=0).status is Status.CANCELLED
    assert server.stats()["active"] == 0
    with pytest.raises(RuntimeError, match="closed"):
        source.start(Task("0"), key(1))


def test_a_closed_engine_raises_out_of_the_session() -> None:
    closed = RolloutServer(make_model("qwen2", "tiny", seed=2), seed=0)
    closed.close()
    with PromptSource(
        closed, [[5]], Recorder(1.0), sampling=SamplingParams(max_tokens=2)
    ) as source:
        session = source.start(Task("0"), key())
        with pytest.raises(RuntimeError, match="closed"):
            session.result(timeout=WAIT)


@pytest.mark.timeout(120)
def test_cancels_and_close_racing_the_engine_resolve_each_session_once(
    engine: Any, server: RolloutServer
) -> None:
    calls: dict[int, int] = {}
    lock = threading.Lock()

    def count(session: Any) -> None:
        with lock:
            calls[id(session)] = calls.get(id(session), 0) + 1

    prompts = [[5 + i % 30, 6] for i in range(48)]
    source = PromptSource(
        engine,
        prompts,
        Recorder(0.5),
        workers=4,
        sampling=SamplingParams(max_tokens=40, stop_ids=()),
    )
    sessions = []
    for i in range(48):
        s = source.start(Task(str(i)), key(i))
        s.add_done_callback(count)
        sessions.append(s)
        if i % 3 == 0:
            s.cancel()  # at once: before or while it reaches the engine
    for s in sessions[1::3]:
        s.cancel()  # while decoding, or after it finished
        s.cancel()  # cancel is idempotent
    source.close()  # the last third is stopped by close
    assert all(s.done() for s in sessions)
    assert sorted(calls.values()) == [1] * 48  # every callback exactly once
    statuses = [s.result(timeout=0).status for s in sessions]
    assert set(statuses) <= {Status.TRUNCATED, Status.CANCELLED}
    assert all(statuses[i] is Status.CANCELLED for i in range(0, 48, 3))
    stats = server.stats()
    assert (stats["pending"], stats["active"]) == (0, 0)


def test_the_group_is_the_routing_affinity(server: RolloutServer) -> None:
    engine = Counting(server)
    with PromptSource(
        engine, [[5, 6]], Recorder(1.0), sampling=SamplingParams(max_tokens=2)
    ) as source:
        for group in (3, 3, 8):
            source.start(Task("0"), RolloutKey(group, 0, 0)).result(timeout=WAIT)
    assert engine.affinities == [3, 3, 8]


class Lossy:
    """An engine that loses every request to a fault, as a dead fleet member does."""

    version = 0

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        from concurrent.futures import Future

        from dew.core import EngineError

        future: Future[Call] = Future()
        future.set_exception(EngineError("engine http://127.0.0.1:1 died"))
        return future

    def abort(self, future: Any) -> None:
        pass


def test_a_request_lost_to_a_fault_is_an_infra_error() -> None:
    with PromptSource(
        Lossy(), [[5]], Recorder(1.0), sampling=SamplingParams(max_tokens=2)
    ) as source:  # type: ignore[arg-type]
        rollout = run_one(source)
    assert rollout.status is Status.INFRA_ERROR and rollout.reward is None
    assert rollout.error == "engine: EngineError: engine http://127.0.0.1:1 died"
