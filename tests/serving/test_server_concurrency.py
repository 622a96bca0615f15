"""RolloutServer under concurrency: continuous batching, aborts, weight pushes, close."""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from dew.core import Aborted, Call, Engine, SamplingParams
from dew.serving import RolloutServer

from ._helpers import WAIT, Worker, hf_greedy, lively, prompts, wait_until


@pytest.mark.timeout(120)
def test_many_threads_share_batches(server: RolloutServer) -> None:
    batch = prompts(48, server.vocab_size, seed=4)
    settings = [
        {"temperature": 0.0},
        {"temperature": 1.0},
        {"top_k": 3},
        {"top_p": 0.6, "temperature": 0.5},
    ]
    # Every thread submits once all have started: on a loaded machine, threads started
    # one by one could otherwise reach the engine too far apart to share a batch.
    together = threading.Barrier(len(batch), timeout=WAIT)

    def one(i: int, p: list[int]) -> Call:
        together.wait()
        return server.generate(
            p, SamplingParams(max_tokens=3 + i % 11, stop_ids=(), **settings[i % 4])
        )

    workers = [Worker(lambda i=i, p=p: one(i, p)) for i, p in enumerate(batch)]
    calls = [w.join() for w in workers]
    for i, (p, call) in enumerate(zip(batch, calls, strict=True)):
        assert isinstance(call, Call), workers[i].error
        assert list(call.prompt) == p
        assert len(call.completion) == len(call.log_probs) == 3 + i % 11
    stats = server.stats()
    assert (stats["pending"], stats["active"], stats["loads"]) == (0, 0, 0)
    # 48 requests of at most 13 tokens through 16 slots: batches were shared.
    assert stats["iterations"] < sum(3 + i % 11 for i in range(48)) / 4


@pytest.mark.timeout(120)
def test_short_request_is_not_held_behind_long_ones(server: RolloutServer) -> None:
    stops = [threading.Event() for _ in range(4)]
    longs = [
        Worker(
            lambda s=s: server.generate(
                [6, 7, 8], SamplingParams(max_tokens=1000, stop_ids=()), stop=s
            )
        )
        for s in stops
    ]
    wait_until(lambda: server.stats()["active"] == 4, "the long requests to decode")
    short = server.generate([9, 10], SamplingParams(max_tokens=3, stop_ids=()))
    assert len(short.completion) == 3
    # The long ones (1000 tokens each) are still running: the short one joined their batch.
    assert server.stats()["active"] == 4 and not any(w.done.is_set() for w in longs)
    for s in stops:
        s.set()
    for w in longs:
        w.join()
        assert isinstance(w.error, Aborted) and w.error.tokens < 1000


@pytest.mark.timeout(120)
def test_stop_aborts_within_one_iteration_and_frees_the_slot(qwen: torch.nn.Module) -> None:
    with RolloutServer(qwen, max_batch=1) as server:
        stop = threading.Event()
        victim = Worker(
            lambda: server.generate([5, 6], SamplingParams(max_tokens=1000, stop_ids=()), stop=stop)
        )
        wait_until(lambda: server.stats()["active"] == 1, "the request to decode")
        waiting = Worker(
            lambda: server.generate([7], SamplingParams(max_tokens=5, stop_ids=()))
        )  # needs the only slot
        wait_until(lambda: server.stats()["pending"] == 1, "the second request to queue")
        seen = server.stats()["iterations"]
        stop.set()
        victim.join()
        assert isinstance(victim.error, Aborted)
        # Dropped by the iteration in flight when stop was set, or the next one.
        assert victim.error.iteration <= seen + 2
        waiting.join()
        assert isinstance(waiting.result, Call) and len(waiting.result.completion) == 5
        # A stop already set fails fast without reaching the engine.
        with pytest.raises(Aborted) as info:
            server.generate([5], SamplingParams(max_tokens=3, stop_ids=()), stop=stop)
        assert info.value.iteration == -1


@pytest.mark.timeout(240)
def test_thousands_of_aborts_leave_no_trace(qwen: torch.nn.Module) -> None:
    per_thread, threads = 250, 8
    with RolloutServer(qwen, max_batch=8) as server:
        stops: queue.Queue[threading.Event | None] = queue.Queue()
        outcomes: list[str] = []
        lock = threading.Lock()

        def client(seed: int) -> None:
            for i in range(per_thread):
                stop = threading.Event()
                stops.put(stop)
                try:
                    server.generate(
                        [6 + (seed + i) % 50] * (1 + i % 5),
                        SamplingParams(max_tokens=500, stop_ids=()),
                        stop=stop,
                    )
                    kind = "finished"
                except Aborted as exc:
                    kind = "engine" if exc.iteration >= 0 else "early"
                with lock:
                    outcomes.append(kind)

        def aborter() -> None:
            # Sets each stop as soon as it is published: some before the request is
            # queued, some while pending, some while decoding.
            while (stop := stops.get()) is not None:
                stop.set()

        killer = threading.Thread(target=aborter)
        killer.start()
        clients = [threading.Thread(target=client, args=(s,)) for s in range(threads)]
        for c in clients:
            c.start()
        for c in clients:
            c.join(WAIT * 3)
            assert not c.is_alive()
        stops.put(None)
        killer.join()
        assert len(outcomes) == per_thread * threads
        assert "finished" not in outcomes  # 500 tokens never outran the aborter
        assert outcomes.count("engine") > 0
        stats = server.stats()
        assert (stats["pending"], stats["active"], stats["loads"]) == (0, 0, 0)
        assert server._batch.active == [] and not server._pending  # the tables themselves
        call = server.generate(
            [5, 6, 7], SamplingParams(max_tokens=4, temperature=0, stop_ids=())
        )  # still serving
        assert list(call.completion) == hf_greedy(qwen, [5, 6, 7], 4)


@pytest.mark.timeout(180)
def test_load_mid_request_switches_weights_and_keeps_the_oldest_version() -> None:
    old, new = lively("qwen2", 10), lively("qwen2", 11)
    prompt, n = [12, 13, 14, 15], 150
    with RolloutServer(old, version=3, max_batch=4) as server:
        beside = Worker(
            lambda: server.generate(
                [20, 21], SamplingParams(max_tokens=300, temperature=1.0, stop_ids=())
            )
        )
        running = Worker(
            lambda: server.generate(
                prompt, SamplingParams(max_tokens=n, temperature=0, stop_ids=())
            )
        )
        wait_until(lambda: server.stats()["active"] == 2, "both requests to decode")
        server.load(new, 4)  # returns once the new weights are in place
        assert server.version == 4
        # The push lands at the next iteration, with ~150 tokens of the request to go.
        call = running.join()
        other = beside.join()
        after = server.generate(prompt, SamplingParams(max_tokens=3, temperature=0, stop_ids=()))
    assert isinstance(call, Call) and isinstance(other, Call)
    assert call.version == 3 and other.version == 3  # the oldest version that served them
    assert after.version == 4
    completion = list(call.completion)
    before_push = hf_greedy(old, prompt, n)
    assert completion != before_push, "tokens after the push must come from the new weights"
    # Some prefix is the old model's greedy output, the rest the new model's greedy
    # continuation of prompt + that prefix (keys and values recomputed under it).
    agree = next(j for j in range(n) if completion[j] != before_push[j])
    assert agree >= 1  # the push landed after the first token
    # The switch happened at some j <= agree (the new weights may agree for a while).
    assert any(
        completion[j:] == hf_greedy(new, prompt + completion[:j], n - j)
        for j in range(agree, 0, -1)
    ), "the tail is not the new weights' greedy output"


@pytest.mark.timeout(120)
def test_close_fails_pending_requests_clearly(qwen: torch.nn.Module) -> None:
    server = RolloutServer(qwen, max_batch=1)
    active = Worker(lambda: server.generate([5], SamplingParams(max_tokens=1000, stop_ids=())))
    wait_until(lambda: server.stats()["active"] == 1, "the first request to decode")
    pending = Worker(lambda: server.generate([6], SamplingParams(max_tokens=3, stop_ids=())))
    wait_until(lambda: server.stats()["pending"] == 1, "the second request to queue")
    server.close()
    assert not server._thread.is_alive()
    for w in (active, pending):
        w.join()
        assert isinstance(w.error, RuntimeError) and "closed" in str(w.error)
    with pytest.raises(RuntimeError, match="closed"):
        server.generate([5], SamplingParams(max_tokens=1, stop_ids=()))
    with pytest.raises(RuntimeError, match="closed"):
        server.load(qwen, 1)
    server.close()  # idempotent


@pytest.mark.timeout(120)
def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(qwen: torch.nn.Module) -> None:
    with RolloutServer(qwen) as server:
        broken = {k: torch.full_like(v, float("nan")) for k, v in qwen.state_dict().items()}
        server.load(broken, 1)
        with pytest.raises(RuntimeError, match="model step failed"):
            server.generate(
                [5, 6], SamplingParams(max_tokens=4, stop_ids=())
            )  # sampling from NaN logits raises
        assert server.stats()["active"] == 0
        server.load(qwen, 2)
        call = server.generate([5, 6], SamplingParams(max_tokens=4, temperature=0, stop_ids=()))
        assert list(call.completion) == hf_greedy(qwen, [5, 6], 4) and call.version == 2


@pytest.mark.timeout(120)
def test_submit_returns_futures_that_resolve_on_the_engine_thread(server: RolloutServer) -> None:
    batch = prompts(24, server.vocab_size, seed=9)
    seen: queue.Queue[str] = queue.Queue()

    def note(_: object) -> None:
        seen.put(threading.current_thread().name)

    # One thread submits everything; no thread waits on any single request.
    futures = [
        server.submit(p, SamplingParams(max_tokens=4, temperature=0, stop_ids=())) for p in batch
    ]
    for f in futures:
        f.add_done_callback(note)
    calls = [f.result(timeout=WAIT) for f in futures]
    for p, call in zip(batch, calls, strict=True):
        assert list(call.prompt) == p and len(call.completion) == 4
    # Greedy: the same tokens the blocking call and the model itself give.
    again = server.generate(batch[0], SamplingParams(max_tokens=4, temperature=0, stop_ids=()))
    assert list(calls[0].completion) == list(again.completion)
    assert list(calls[5].completion) == hf_greedy(server._model, batch[5], 4)
    names = {seen.get(timeout=WAIT) for _ in batch}
    # Callbacks added before the answer run on the engine thread; ones added after it
    # run at once on the adding thread.
    assert names <= {"RolloutServer-engine", threading.current_thread().name}
    assert not any(f.cancel() for f in futures)  # cancel() never takes one from the engine


@pytest.mark.timeout(120)
def test_submit_future_is_stopped_by_its_event_not_by_cancel(server: RolloutServer) -> None:
    stop = threading.Event()
    future = server.submit([5, 6], SamplingParams(max_tokens=1000, stop_ids=()), stop=stop)
    wait_until(lambda: server.stats()["active"] == 1, "the request to decode")
    assert not future.cancel() and not future.done()  # running: only stop aborts it
    stop.set()
    error = future.exception(timeout=WAIT)
    assert isinstance(error, Aborted) and error.tokens < 1000
    assert server.stats()["active"] == 0
    already = server.submit(
        [5], SamplingParams(max_tokens=3, stop_ids=()), stop=stop
    )  # stop set: fails at once
    assert isinstance(already.exception(timeout=0), Aborted)
    with pytest.raises(ValueError, match="max_tokens"):
        server.submit([5], SamplingParams(max_tokens=0, stop_ids=()))


@pytest.mark.timeout(120)
def test_abort_drops_that_request_only(server: RolloutServer) -> None:
    assert isinstance(server, Engine)
    shared = threading.Event()  # one stop event for two requests, as a multi-turn session has
    victim = server.submit([5, 6], SamplingParams(max_tokens=1000, stop_ids=()), stop=shared)
    other = server.submit([7, 8], SamplingParams(max_tokens=40, stop_ids=()), stop=shared)
    wait_until(lambda: server.stats()["active"] == 2, "both requests to decode")
    server.abort(victim)
    error = victim.exception(timeout=WAIT)
    assert isinstance(error, Aborted) and error.tokens < 1000 and error.iteration > 0
    call = other.result(timeout=WAIT)  # the event it shares was never set
    assert len(call.completion) == 40 and not shared.is_set()
    server.abort(victim)  # idempotent, and a no-op once resolved
    server.abort(other)
    assert server.stats()["active"] == 0


@pytest.mark.timeout(120)
def test_blocking_calls_from_a_done_callback_are_refused(qwen: torch.nn.Module) -> None:
    outcomes: queue.Queue[BaseException | Call] = queue.Queue()
    with RolloutServer(qwen, max_batch=1) as server:

        def chain(_: object) -> None:
            for blocking in (
                lambda: server.generate([7], SamplingParams(max_tokens=2, stop_ids=())),
                lambda: server.load(qwen, 9),
            ):
                try:
                    blocking()
                except RuntimeError as exc:
                    outcomes.put(exc)
            # submit only queues, so it is fine there.
            server.submit([7], SamplingParams(max_tokens=2, stop_ids=())).add_done_callback(
                lambda f: outcomes.put(f.result())
            )

        hold = threading.Event()
        holder = server.submit(
            [5, 6], SamplingParams(max_tokens=1000, stop_ids=()), stop=hold
        )  # takes the only slot
        wait_until(lambda: server.stats()["active"] == 1, "the holder to decode")
        target = server.submit([8], SamplingParams(max_tokens=3, stop_ids=()))
        target.add_done_callback(chain)  # attached while it waits: runs on the engine
        hold.set()
        assert isinstance(holder.exception(timeout=WAIT), Aborted)
        got = [outcomes.get(timeout=WAIT) for _ in range(3)]
        assert server.version == 0  # the refused load never reached the engine
    errors = [g for g in got if isinstance(g, RuntimeError)]
    assert len(errors) == 2 and all("engine thread" in str(e) for e in errors)
    assert any(isinstance(g, Call) and len(g.completion) == 2 for g in got)
