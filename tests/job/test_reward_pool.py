"""Reward functions in worker processes: every call bounded, every way user code can
fail (hang, exit, interrupt, a signal from outside) that rollout's named error, and no
worker left behind by a close or by the trainer's death."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dew.core import Call, Task
from dew.job._reward_pool import RewardPool
from dew.job.rewards import RewardError, combine, load_reward

ROWS = [{"prompt": "2+2=", "answer": "4"}]
CALL = Call(prompt=[1, 2], completion=[3], log_probs=[-0.5], version=0)

# Each completion names what the reward does; "pid" writes the worker's pid to a file
# named by the row, then waits there forever, so a test can signal it mid-call.
FAULTY = """
import os, sys, time
from pathlib import Path

def judge(prompts, completions, completion_ids, answer, **kwargs):
    what = completions[0]
    if what == "hang":
        time.sleep(3600)
    if what == "exit":
        sys.exit(3)
    if what == "_exit":
        os._exit(4)
    if what == "interrupt":
        raise KeyboardInterrupt
    if what == "boom":
        raise ValueError("no answer")
    if what.startswith("pid:"):
        Path(what[4:]).write_text(str(os.getpid()))
        time.sleep(3600)
    if what.startswith("pid now:"):
        Path(what[8:]).write_text(str(os.getpid()))
        return [0.0]
    if what == "print":
        print("a line from the reward")
    return [1.0 if what == answer[0] else 0.0]
"""


@pytest.fixture
def judge(tmp_path: Path) -> str:
    path = tmp_path / "faulty.py"
    path.write_text(FAULTY)
    return f"{path}:judge"


def verifier_of(pool: RewardPool):  # type: ignore[no-untyped-def]
    return combine(pool.rewards, ROWS, prompt_column="prompt", chat=False, pool=pool)


def score(verifier, text: str) -> dict[str, float]:  # type: ignore[no-untyped-def]
    return verifier(Task("0"), text, CALL)  # type: ignore[no-any-return]


def await_file(path: Path, within: float = 30.0) -> str:
    deadline = time.monotonic() + within
    while not (path.is_file() and path.read_text()):
        assert time.monotonic() < deadline, f"{path} was never written"
        time.sleep(0.02)
    return path.read_text()


def gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False


@pytest.mark.timeout(60)
def test_each_way_a_reward_can_fail_is_that_calls_error_naming_it(judge: str) -> None:
    reward = load_reward(judge, timeout=1.5)  # a non-default timeout takes effect
    with RewardPool([reward]) as pool:
        verifier = verifier_of(pool)
        assert score(verifier, "4") == {"judge": 1.0}
        t0 = time.monotonic()
        with pytest.raises(RewardError, match=rf"reward {judge} did not return within 1.5 s"):
            score(verifier, "hang")
        assert 1.4 < time.monotonic() - t0 < 10
        with pytest.raises(RewardError, match=rf"reward {judge} raised SystemExit: 3$"):
            score(verifier, "exit")
        with pytest.raises(RewardError, match=rf"reward {judge}: its process exited with code 4"):
            score(verifier, "_exit")
        with pytest.raises(RewardError, match=rf"reward {judge} raised KeyboardInterrupt$"):
            score(verifier, "interrupt")
        with pytest.raises(RewardError, match=rf"reward {judge} raised ValueError: no answer"):
            score(verifier, "boom")
        # After all of that the pool still scores, with one worker kept.
        assert score(verifier, "5") == {"judge": 0.0}
        assert score(verifier, "4") == {"judge": 1.0}
        assert len(pool._idle) == 1 and not pool._busy


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_chaos_a_worker_signalled_mid_call_fails_that_call_alone(
    judge: str, tmp_path: Path, sig: signal.Signals
) -> None:
    with RewardPool([load_reward(judge, timeout=2.0)]) as pool:
        verifier = verifier_of(pool)
        assert score(verifier, "4") == {"judge": 1.0}
        where = tmp_path / "pid"
        errors: list[BaseException] = []

        def call() -> None:
            try:
                score(verifier, f"pid:{where}")
            except RewardError as exc:
                errors.append(exc)

        caller = threading.Thread(target=call)
        caller.start()
        pid = int(await_file(where))
        os.kill(pid, sig)
        caller.join(30)
        assert not caller.is_alive()
        why = "was killed by SIGKILL" if sig is signal.SIGKILL else "did not return within 2 s"
        assert len(errors) == 1 and why in str(errors[0]), errors
        assert gone(pid)  # a stopped one is killed and reaped, never reused
        assert score(verifier, "4") == {"judge": 1.0}  # a new worker


@pytest.mark.timeout(60)
def test_a_ctrl_c_to_the_process_group_is_the_trainers_not_the_rewards(
    judge: str, tmp_path: Path
) -> None:
    """Workers ignore SIGINT: a terminal's Ctrl-C reaches every process of its group,
    and the trainer decides what it means."""
    slow = tmp_path / "slow.py"
    slow.write_text(
        "import os, time\nfrom pathlib import Path\n"
        "def judge(task, completion, call):\n"
        "    Path(completion).write_text(str(os.getpid()))\n"
        "    time.sleep(1.0)\n"
        "    return 0.25\n"
    )
    with RewardPool([load_reward(f"{slow}:judge")]) as pool:
        verifier = verifier_of(pool)
        where = tmp_path / "pid"
        got: list[dict[str, float]] = []
        caller = threading.Thread(target=lambda: got.append(score(verifier, str(where))))
        caller.start()
        os.kill(int(await_file(where)), signal.SIGINT)
        caller.join(30)
        assert got == [{"judge": 0.25}]


@pytest.mark.timeout(60)
def test_close_ends_calls_in_progress_at_once_and_leaves_no_worker(
    judge: str, tmp_path: Path
) -> None:
    pool = RewardPool([load_reward(judge, timeout=600.0)])
    verifier = verifier_of(pool)
    assert score(verifier, "4") == {"judge": 1.0}
    errors: list[BaseException] = []
    pids: list[int] = []

    def call(i: int) -> None:
        try:
            score(verifier, f"pid:{tmp_path / str(i)}")
        except RewardError as exc:
            errors.append(exc)

    callers = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for caller in callers:
        caller.start()
    pids = [int(await_file(tmp_path / str(i))) for i in range(3)]
    assert len(set(pids)) == 3  # one worker per call at once
    t0 = time.monotonic()
    pool.close()
    for caller in callers:
        caller.join(10)
    assert time.monotonic() - t0 < 10 and not any(c.is_alive() for c in callers)
    assert len(errors) == 3 and all(
        "stopped, the reward processes were closed" in str(e) for e in errors
    )
    assert all(gone(pid, 1.0) for pid in pids)
    with pytest.raises(RewardError, match="closed"):
        score(verifier, "4")


@pytest.mark.timeout(60)
def test_chaos_workers_end_with_a_sigkilled_trainer(judge: str, tmp_path: Path) -> None:
    """No cleanup runs in a SIGKILLed trainer: its workers end on their own."""
    where = tmp_path / "pid"
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\n"
            "from dew.core import Call, Task\n"
            "from dew.job._reward_pool import RewardPool\n"
            "from dew.job.rewards import load_reward, combine\n"
            "pool = RewardPool([load_reward(sys.argv[1])])\n"
            "v = combine(pool.rewards, [{'prompt': 'p', 'answer': 'a'}], prompt_column='prompt',"
            " chat=False, pool=pool)\n"
            "v(Task('0'), 'pid:' + sys.argv[2], Call(prompt=[1], completion=[2], log_probs=[0.0],"
            " version=0))\n",
            judge,
            str(where),
        ]
    )
    try:
        worker = int(await_file(where))
        trainer.kill()
        trainer.wait(10)
        assert gone(worker)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()


@pytest.mark.timeout(60)
def test_what_a_worker_cannot_take_or_load_is_an_error_and_the_pool_goes_on(
    judge: str, tmp_path: Path
) -> None:
    with RewardPool([load_reward(judge)]) as pool:
        with pytest.raises(RewardError, match=rf"reward {judge}: its inputs cannot be sent"):
            pool.score_many(0, Task("0"), "p", [lambda: 0], [CALL], {}, False)  # never pickles
        assert pool.score_many(0, Task("0"), "p", ["x"], [CALL], {"answer": "x"}, False) == [1.0]
        assert len(pool._idle) == 1  # the worker that refused the inputs is kept

    gone_file = tmp_path / "once.py"
    gone_file.write_text("def judge(task, completion, call):\n    return 1.0\n")
    reward = load_reward(f"{gone_file}:judge")
    gone_file.write_text("raise ImportError('only the first import works')\n")
    with RewardPool([reward]) as pool:
        with pytest.raises(RewardError, match=r"in its worker process: .*only the first import"):
            pool.score_many(0, Task("0"), "p", ["x"], [CALL], {}, False)


@pytest.mark.timeout(60)
def test_a_worker_sees_the_trainers_import_path(tmp_path: Path) -> None:
    """A reward named by module resolves in the worker as it did in the trainer."""
    package = tmp_path / "my_rewards_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("def judge(task, completion, call):\n    return 0.5\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with RewardPool([load_reward("my_rewards_pkg:judge")]) as pool:
            assert pool.score_many(0, Task("0"), "p", ["x"], [CALL], {}, False) == [0.5]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("my_rewards_pkg", None)


# Each of the four rows' second call (the first is dew train's probe before the first
# step) fails its own way; every other call scores as usual.
ONCE = """
import os, sys, time
from pathlib import Path

def flaky(prompts, completions, completion_ids, answer, **kwargs):
    probed = Path(__file__).with_name(f"probed-{answer[0]}")
    mark = Path(__file__).with_name(f"failed-{answer[0]}")
    Path(__file__).with_name(f"pid-{os.getpid()}").touch()
    if not probed.exists():
        probed.touch()
    elif not mark.exists():
        mark.touch()
        if answer[0] == "123":
            time.sleep(3600)
        if answer[0] == "456":
            sys.exit(3)
        if answer[0] == "789":
            raise KeyboardInterrupt
        if answer[0] == "321":
            os._exit(9)
    return [ids[0] / 100 for ids in completion_ids]
"""


@pytest.mark.timeout(300)
def test_dew_train_outlives_rewards_that_hang_exit_or_interrupt(tmp_path: Path) -> None:
    from tests.job.test_train_cli import config, dew_train, make_model_dir

    model = make_model_dir(tmp_path / "model")
    path = config(
        tmp_path,
        model,
        **{
            'copy_reward.py:copy_reward"': 'once.py:flaky"\ntimeout = 2.0',
            "tasks = 2": "tasks = 4",
            "steps = 3": "steps = 2",
            "eval_every = 2": "eval_every = 1",
            # Each step's groups are the only ones running, so every fault is step 1's.
            "groups = 4": "groups = 4\nahead = 0",
        },
    )
    (tmp_path / "once.py").write_text(ONCE)
    rows = [
        {"messages": [{"role": "user", "content": d}], "answer": d}
        for d in ("123", "456", "789", "321")
    ]
    (tmp_path / "copy-chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    t0 = time.monotonic()
    done = dew_train(str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert time.monotonic() - t0 < 200
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert {p.name for p in tmp_path.glob("failed-*")} == {
        f"failed-{d}" for d in ("123", "456", "789", "321")
    }
    # Each fault cost one attempt of each sample of its group (the reward is called once
    # per group: 4 groups of 4, of either step), recorded as such; no group was lost.
    resubmitted = [r["scheduler"]["resubmitted"].get("infra_error", 0) for r in records]
    assert sum(resubmitted) == 16 and set(records[0]["scheduler"]["resubmitted"]) == {"infra_error"}
    assert sorted(records[0]["tasks"]["trained"]) == ["0", "1", "2", "3"]
    assert all(r["scheduler"]["abandoned"] == 0 for r in records)
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [(e["step"], e["errors"]) for e in evals] == [(1, 0), (2, 0)]
    workers = [int(p.name[4:]) for p in tmp_path.glob("pid-*")]
    assert workers and all(gone(pid, 1.0) for pid in workers)  # none outlived the run
    # Each failure is in its step's record with its cause, and the first of each kind
    # of each reward is on screen, once.
    errors = records[0]["errors"]
    assert len(errors) == 16 and all(": infra_error: verifier failed: " in e for e in errors)
    name = f"{tmp_path}/once.py:flaky"
    said = [line for line in done.stderr.splitlines() if f"reward {name} failed" in line]
    kinds = ["did not return within 2 s", "raised SystemExit: 3", "raised KeyboardInterrupt"]
    kinds.append("its process exited with code 9")
    assert len(said) == 4 and all(any(k in line for line in said) for k in kinds), said
    assert all(line.startswith(f"dew train: step 1: reward {name} failed: ") for line in said)


@pytest.mark.timeout(60)
def test_chaos_a_large_call_to_a_stopped_idle_worker_is_bounded_too(
    judge: str, tmp_path: Path
) -> None:
    """A request bigger than the pipe holds is written only as the worker reads it: to
    a stopped worker that never does, the writing itself is bounded by the timeout."""
    with RewardPool([load_reward(judge, timeout=2.0)]) as pool:
        verifier = verifier_of(pool)
        where = tmp_path / "pid"
        assert score(verifier, f"pid now:{where}") == {"judge": 0.0}
        pid = int(where.read_text())
        os.kill(pid, signal.SIGSTOP)  # idle, between calls
        t0 = time.monotonic()
        with pytest.raises(RewardError, match="did not return within 2 s"):
            score(verifier, "x" * 4_000_000)  # far more than a pipe's buffer
        assert 1.9 < time.monotonic() - t0 < 10
        assert gone(pid)
        assert score(verifier, "4") == {"judge": 1.0}  # a new worker
