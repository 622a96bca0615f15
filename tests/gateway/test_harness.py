"""HarnessSource: callable and subprocess harnesses through a live gateway and RolloutServer."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from dew.core import Aborted, RolloutKey, Status, Task
from dew.gateway import HarnessEndpoint, HarnessOutcome, HarnessSource, RecordingGateway
from dew.objectives.rl.chains import chains

from ._harnesses import ask
from ._live import TASK, TOK, WAIT, length_verifier

KEY = RolloutKey(0, 0, 0)


def run_one(source: HarnessSource, key: RolloutKey = KEY):
    return source.start(TASK, key).result(WAIT)


@pytest.mark.timeout(120)
def test_callable_harness_completes_and_the_verifier_scores_it(gateway, spy):
    seen: list[HarnessOutcome] = []

    def verifier(task: Task, outcome: HarnessOutcome) -> dict[str, float]:
        seen.append(outcome)
        return {"format": 0.25, "correct": 1.0}

    with HarnessSource(gateway, lambda task, ep: ask(ep, turns=3), verifier, workers=2) as src:
        rollout = run_one(src)
    assert rollout.status is Status.COMPLETED and rollout.error is None
    assert rollout.reward == 1.25 and dict(rollout.components) == {"format": 0.25, "correct": 1.0}
    assert list(rollout.calls) == spy.calls and len(rollout.calls) == 3
    assert len(chains(rollout.calls)) == 1
    outcome = seen[0]
    assert outcome.task == TASK and outcome.calls == tuple(rollout.calls)
    assert outcome.value == TOK.decode(
        [int(t) for t in rollout.calls[-1].completion if t != TOK.eos_token_id]
    )


@pytest.mark.timeout(120)
def test_harness_failures_map_to_statuses(gateway):
    def after_a_call(task: Task, ep: HarnessEndpoint) -> None:
        ask(ep, turns=1)
        raise RuntimeError("the agent misformatted its answer")

    def before_any_call(task: Task, ep: HarnessEndpoint) -> None:
        raise RuntimeError("harness bug")

    def quits(task: Task, ep: HarnessEndpoint) -> None:
        ask(ep, turns=1)
        sys.exit(2)

    with HarnessSource(gateway, after_a_call, length_verifier) as src:
        r = run_one(src, RolloutKey(0, 0, 0))
    assert r.status is Status.AGENT_ERROR and r.reward == 1.0
    assert "misformatted" in r.error and len(r.calls) == 1
    with HarnessSource(gateway, before_any_call, length_verifier) as src:
        r = run_one(src, RolloutKey(0, 1, 0))
    assert r.status is Status.INFRA_ERROR and "harness bug" in r.error and r.reward is None
    with HarnessSource(gateway, quits, length_verifier) as src:
        r = run_one(src, RolloutKey(0, 2, 0))
    assert r.status is Status.AGENT_ERROR and "status 2" in r.error
    with HarnessSource(gateway, lambda t, ep: None, length_verifier) as src:
        r = run_one(src, RolloutKey(0, 3, 0))
    assert r.status is Status.INFRA_ERROR and "no model call" in r.error


@pytest.mark.timeout(120)
@pytest.mark.parametrize("verdict", ["raise", None, float("nan"), {"a": "x"}, {}, True])
def test_a_verifier_that_fails_is_an_infra_error(gateway, verdict):
    def verifier(task: Task, outcome: HarnessOutcome) -> Any:
        if verdict == "raise":
            raise KeyError("no answer key")
        return verdict

    with HarnessSource(gateway, lambda t, ep: ask(ep, turns=1), verifier) as src:
        r = run_one(src)
    assert r.status is Status.INFRA_ERROR and r.reward is None
    assert r.error.startswith("verifier failed") and len(r.calls) == 1


@pytest.mark.timeout(120)
def test_a_session_limit_truncates_and_is_still_scored(gateway):
    # max_turns=4: the fifth request is refused and the harness crashes on it.
    with HarnessSource(gateway, lambda t, ep: ask(ep, turns=6), length_verifier) as src:
        r = run_one(src)
    assert r.status is Status.TRUNCATED and r.truncation == "turns"
    assert r.reward == 4.0 and len(r.calls) == 4 and "turn limit" in r.error


@pytest.mark.timeout(120)
def test_wall_clock_timeout_stops_the_harness(gateway):
    def waits_for_stop(task: Task, ep: HarnessEndpoint) -> str:
        ask(ep, turns=1, max_tokens=1)  # well inside the timeout, even on a loaded machine
        assert ep.stop.wait(WAIT)  # released by the timeout, not by the clock here
        return "stopped"

    with HarnessSource(gateway, waits_for_stop, length_verifier, timeout=2.0) as src:
        r = run_one(src)
    assert r.status is Status.TRUNCATED and r.truncation == "wall_clock"
    assert r.reward == 1.0 and r.error is None


@pytest.mark.timeout(120)
def test_cancel_aborts_the_generation_in_flight(gateway, spy):
    def long_call(task: Task, ep: HarnessEndpoint) -> None:
        ask(ep, turns=1, max_tokens=200)

    with HarnessSource(gateway, long_call, length_verifier) as src:
        session = src.start(TASK, RolloutKey(0, 0, 0))
        assert spy.wait_entered(1)
        session.cancel()
        r = session.result(WAIT)
        assert spy.wait_errors(1)
    assert r.status is Status.CANCELLED and r.reward is None
    assert isinstance(spy.errors[0], Aborted) and not spy.calls


@pytest.mark.timeout(120)
def test_closing_the_source_stops_running_harnesses(gateway, spy):
    def long_call(task: Task, ep: HarnessEndpoint) -> None:
        ask(ep, turns=1, max_tokens=200)

    src = HarnessSource(gateway, long_call, length_verifier)
    sessions = [src.start(TASK, RolloutKey(0, i, 0)) for i in range(2)]
    assert spy.wait_entered(2)
    src.close()
    assert all(s.done() for s in sessions)
    assert {s.result(0).status for s in sessions} == {Status.CANCELLED}
    with pytest.raises(RuntimeError, match="closed"):
        src.start(TASK, RolloutKey(1, 0, 0))


@pytest.mark.timeout(60)
def test_a_closed_gateway_is_an_infra_error(spy):
    gw = RecordingGateway(spy, TOK).start()
    gw.close()
    with HarnessSource(gw, lambda t, ep: ask(ep, turns=1), length_verifier) as src:
        r = run_one(src)
    assert r.status is Status.INFRA_ERROR and "gateway" in r.error


@pytest.mark.timeout(60)
def test_harness_and_verifier_are_validated(gateway):
    for bad in ("python agent.py", [], [1, 2], 5):
        with pytest.raises(ValueError, match="harness"):
            HarnessSource(gateway, bad, length_verifier)
    with pytest.raises(ValueError, match="verifier"):
        HarnessSource(gateway, ["true"], None)
    with pytest.raises(ValueError, match="grace"):
        HarnessSource(gateway, ["true"], length_verifier, grace=-1)
    with pytest.raises(ValueError, match="timeout"):
        HarnessSource(gateway, ["true"], length_verifier, timeout=0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2])
def test_workers_bounds_how_many_harnesses_run_at_once(gateway, workers):
    gate = threading.Event()
    entered: list[str] = []
    cond = threading.Condition()

    def held(task: Task, ep: HarnessEndpoint) -> str:
        with cond:
            entered.append(task.id)
            cond.notify_all()
        assert gate.wait(WAIT)
        return ask(ep, turns=1)

    with HarnessSource(gateway, held, length_verifier, workers=workers) as src:
        sessions = [src.start(TASK, RolloutKey(0, i, 0)) for i in range(2)]
        with cond:
            assert cond.wait_for(lambda: len(entered) >= workers, WAIT)
            # With one worker the second harness must not begin while the first is
            # held; a source that ignored the bound would start it within this wait.
            assert cond.wait_for(lambda: len(entered) >= 2, 0.5) == (workers == 2)
        gate.set()
        rollouts = [session.result(WAIT) for session in sessions]
    assert [r.status for r in rollouts] == [Status.COMPLETED] * 2 and len(entered) == 2


@pytest.mark.timeout(120)
def test_each_worker_thread_keeps_its_own_http_client(gateway):
    # Sessions share no connection pool (whose lock every request would take): a worker
    # thread reuses its own client from one rollout to the next; close() shuts them.
    together = threading.Barrier(2, timeout=WAIT)
    seen: list[tuple[str, Any]] = []

    def harness(task: Task, ep: HarnessEndpoint) -> str:
        together.wait()  # both workers run at once: two threads, every round
        seen.append((threading.current_thread().name, ep.http_client))
        return ask(ep, turns=1)

    with HarnessSource(gateway, harness, length_verifier, workers=2) as src:
        for rnd in range(2):
            sessions = [src.start(TASK, RolloutKey(rnd, i, 0)) for i in range(2)]
            assert all(s.result(WAIT).status is Status.COMPLETED for s in sessions)
    by_thread: dict[str, set[int]] = {}
    for name, client in seen:
        by_thread.setdefault(name, set()).add(id(client))
    assert len(by_thread) == 2 and all(len(ids) == 1 for ids in by_thread.values()), seen
    clients = {id(c): c for _, c in seen}
    assert len(clients) == 2 and all(c.is_closed for c in clients.values())


@pytest.mark.timeout(120)
def test_tasks_hands_the_harness_and_verifier_the_full_task(gateway):
    full = Task("3", {"question": "What is 1+2?", "answer": "3"})
    seen: list[tuple[str, Task]] = []

    def harness(task: Task, ep: HarnessEndpoint) -> str:
        seen.append(("harness", task))
        return ask(ep, turns=1)

    def verifier(task: Task, outcome: HarnessOutcome) -> float:
        seen.append(("verifier", task))
        return 1.0

    with HarnessSource(gateway, harness, verifier, tasks={"3": full}) as src:
        # The scheduler's tasks carry only the id; the source looks the rest up.
        rollout = src.start(Task("3"), KEY).result(WAIT)
        assert rollout.status is Status.COMPLETED and rollout.task.id == "3"
        assert seen == [("harness", full), ("verifier", full)]
        with pytest.raises(ValueError, match=r"attempt=0\): task id '9' is not in this source"):
            src.start(Task("9"), RolloutKey(0, 1, 0)).result(WAIT)


# --------------------------------------------------------------------------- subprocesses

AGENT = textwrap.dedent("""
    import json, os, subprocess, sys, openai
    task = json.loads(os.environ["DEW_TASK"])
    with open(os.environ["DEW_TASK_FILE"]) as f:
        assert json.load(f) == task
    assert os.environ["OPENAI_API_BASE"] == os.environ["OPENAI_BASE_URL"]
    mode = task["data"]["mode"]
    with open(os.environ["PID_FILE"], "w") as f:
        f.write(str(os.getpid()))
    if mode == "stubborn":
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.environ["PID_FILE"], "a") as f:
            f.write(" " + str(child.pid))
    client = openai.OpenAI(max_retries=0)  # reads OPENAI_BASE_URL and OPENAI_API_KEY
    messages = [{"role": "user", "content": task["data"]["question"]}]
    long = mode in ("stubborn", "polite")
    try:
        for turn in range(2):
            r = client.chat.completions.create(model=os.environ["DEW_MODEL"],
                                               messages=messages, max_tokens=200 if long else 3)
            reply = r.choices[0].message.content
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": "again"}]
    except openai.APIError:
        if mode == "stubborn":
            import time
            while True:
                time.sleep(1)
        raise
    print(json.dumps({"answer": reply}))
    if mode == "fail":
        print("gave up", file=sys.stderr)
        sys.exit(3)
""")


@pytest.fixture
def script(tmp_path: Path) -> list[str]:
    path = tmp_path / "agent.py"
    path.write_text(AGENT)
    return [sys.executable, str(path)]


def answer(outcome: HarnessOutcome) -> str:
    return json.loads(outcome.stdout.strip().splitlines()[-1])["answer"]


def stdout_verifier(task: Task, outcome: HarnessOutcome) -> float:
    return 1.0 if answer(outcome) == task.data.get("answer") else 0.0


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def task(mode: str) -> Task:
    return Task("9", {"question": "2+2?", "answer": "4", "mode": mode})


@pytest.mark.timeout(180)
def test_subprocess_harness_completes_and_fails_with_its_status(gateway, spy, script, tmp_path):
    env = {"PID_FILE": str(tmp_path / "pid")}
    seen: dict[str, HarnessOutcome] = {}

    def verifier(task: Task, outcome: HarnessOutcome) -> float:
        seen[task.data["mode"]] = outcome
        return stdout_verifier(task, outcome)

    with HarnessSource(gateway, script, verifier, env=env, workers=2) as src:
        ok = src.start(task("ok"), RolloutKey(0, 0, 0))
        bad = src.start(task("fail"), RolloutKey(0, 1, 0))
        ok, bad = ok.result(WAIT), bad.result(WAIT)
    for rollout, outcome in ((ok, seen["ok"]), (bad, seen["fail"])):
        # The script printed what the gateway answered its last call.
        last = [int(t) for t in rollout.calls[-1].completion if t != TOK.eos_token_id]
        assert answer(outcome) == TOK.decode(last)
        assert rollout.reward == (1.0 if answer(outcome) == "4" else 0.0)
        assert outcome.calls == tuple(rollout.calls)
    assert ok.status is Status.COMPLETED and ok.error is None and seen["ok"].returncode == 0
    assert len(ok.calls) == 2 and len(chains(ok.calls)) == 1
    assert bad.status is Status.AGENT_ERROR and seen["fail"].returncode == 3
    assert "status 3" in bad.error and "gave up" in bad.error
    assert {id(c) for c in ok.calls + bad.calls} == {id(c) for c in spy.calls}


@pytest.mark.timeout(60)
def test_a_command_that_cannot_start_is_an_infra_error(gateway, tmp_path):
    with HarnessSource(gateway, [str(tmp_path / "missing")], stdout_verifier) as src:
        r = run_one(src)
    assert r.status is Status.INFRA_ERROR and "cannot launch" in r.error


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["polite", "stubborn"])
def test_cancel_terminates_the_subprocess_then_kills_it(gateway, spy, script, tmp_path, mode):
    pid_file = tmp_path / "pid"
    with HarnessSource(
        gateway, script, stdout_verifier, grace=0.5, env={"PID_FILE": str(pid_file)}
    ) as src:
        session = src.start(task(mode), RolloutKey(0, 0, 0))
        assert spy.wait_entered(1)  # its first (long) call is generating
        began = time.monotonic()
        session.cancel()
        r = session.result(WAIT)
        took = time.monotonic() - began
    assert r.status is Status.CANCELLED
    if mode == "stubborn":
        # It ignores SIGTERM, so it dies by SIGKILL once grace=0.5 has passed: never
        # sooner, and well before the default grace of 5 s would have let it live.
        assert 0.5 <= took < 4.5, took
    assert spy.wait_errors(1) and isinstance(spy.errors[0], Aborted)
    pids = [int(p) for p in pid_file.read_text().split()]
    assert len(pids) == (2 if mode == "stubborn" else 1)
    assert not any(alive(p) for p in pids)  # the harness and its child are gone


@pytest.mark.timeout(60)
def test_subprocess_environment(gateway, tmp_path):
    out = tmp_path / "env.json"
    code = (
        "import json, os; json.dump({k: os.environ.get(k) for k in ('OPENAI_BASE_URL', "
        "'OPENAI_API_KEY', 'DEW_MODEL', 'DEW_TASK', 'EXTRA')}, open(os.environ['OUT'], 'w'))"
    )
    with HarnessSource(
        gateway, [sys.executable, "-c", code], length_verifier, env={"OUT": str(out), "EXTRA": "1"}
    ) as src:
        r = run_one(src)
    assert r.status is Status.INFRA_ERROR and "no model call" in r.error
    seen = json.loads(out.read_text())
    assert seen["OPENAI_BASE_URL"] == gateway.base_url
    assert seen["OPENAI_API_KEY"].startswith("dew-") and seen["DEW_MODEL"] == "dew"
    assert json.loads(seen["DEW_TASK"]) == {"id": TASK.id, "data": dict(TASK.data)}
    assert seen["EXTRA"] == "1"
    # The key was the session's: now closed, it is refused.
    with (
        openai.OpenAI(
            base_url=gateway.base_url, api_key=seen["OPENAI_API_KEY"], max_retries=0
        ) as c,
        pytest.raises(openai.APIStatusError) as info,
    ):
        c.models.list()
    assert info.value.status_code == 410
    assert os.environ.get("EXTRA") is None


@pytest.mark.timeout(60)
def test_cwd_sets_the_subprocess_directory_and_max_output_bytes_keeps_the_tail(gateway, tmp_path):
    # The command writes 5,000 x's and then its directory to stderr, and fails: the
    # error carries the tail of stderr that the source kept.
    code = "import os, sys; sys.stderr.write('x' * 5000 + '\\n' + os.getcwd()); sys.exit(3)"
    work = tmp_path / "work"
    work.mkdir()
    errors = []
    for kwargs in ({}, {"cwd": str(work), "max_output_bytes": 300}):
        with HarnessSource(gateway, [sys.executable, "-c", code], length_verifier, **kwargs) as src:
            r = run_one(src)
        assert r.status is Status.INFRA_ERROR and "status 3" in r.error, r.error
        errors.append(r.error)
    whole, cut = errors
    assert whole.endswith("x\n" + os.getcwd()) and "bytes cut" not in whole
    assert cut.endswith("x\n" + str(work)) and "[... " in cut and " bytes cut]" in cut
    kept = cut.split(" bytes cut]\n", 1)[1]
    assert len(kept.encode()) == 300
