"""EnvironmentSource on a real RolloutServer, with environments the tests script."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import pytest

from dew.core import Rollout, RolloutKey, SamplingParams, Status, Task
from dew.demo.guess import make_env
from dew.demo.model import make_model, make_tokenizer
from dew.objectives.rl.chains import chains, merge_ratio
from dew.objectives.rl.sources import AgentError, ChatTokens, Environment, EnvironmentSource
from dew.objectives.rl.sources.chat import text_encoder
from dew.serving import RolloutServer

TOK = make_tokenizer()
EOS = TOK.eos_token_id
WAIT = 60.0


@pytest.fixture(scope="module")
def server() -> Iterator[RolloutServer]:
    srv = RolloutServer(make_model("qwen2", "tiny", seed=5), seed=1, max_len=512)
    yield srv
    srv.close()


class Scripted:
    """An environment that answers each reply with the next scripted observation.

    An entry of ``script`` may be a string or message list (returned), ``None``
    (episode over) or an exception (raised). ``score`` returns ``reward`` or raises it.
    """

    def __init__(
        self,
        script: list[Any],
        reward: Any = 1.0,
        opening: Any = "start",
        gate: threading.Event | None = None,
    ) -> None:
        self.script = list(script)
        self.reward = reward
        self.opening = opening
        self.gate = gate
        self.replies: list[str] = []
        self.closed = False

    def reset(self, task: Task) -> Any:
        if isinstance(self.opening, BaseException):
            raise self.opening
        return self.opening

    def step(self, reply: str) -> Any:
        self.replies.append(reply)
        if self.gate is not None:
            assert self.gate.wait(WAIT)
        out = self.script.pop(0)
        if isinstance(out, BaseException):
            raise out
        return out

    def score(self) -> Any:
        if isinstance(self.reward, BaseException):
            raise self.reward
        return self.reward

    def close(self) -> None:
        self.closed = True


def source_for(
    server: RolloutServer, make: Callable[[], Environment], **kw: Any
) -> EnvironmentSource:
    """The source with test defaults; sampling keywords (max_tokens, temperature, top_k,
    top_p, stop_ids) go into its SamplingParams."""
    fields = {"max_tokens", "temperature", "top_k", "top_p", "stop_ids"}
    sampling = {"max_tokens": 4, **{k: v for k, v in kw.items() if k in fields}}
    options = {"tokenizer": TOK, "max_turns": 8, "max_context": 512}
    options.update({k: v for k, v in kw.items() if k not in fields})
    return EnvironmentSource(server, make, sampling=SamplingParams(**sampling), **options)


def run(source: EnvironmentSource, i: int = 0) -> Rollout:
    return source.start(Task(str(i)), RolloutKey(0, i, 0)).result(timeout=WAIT)


@pytest.mark.timeout(180)
def test_multi_turn_calls_extend_each_other_into_one_chain(server: RolloutServer) -> None:
    envs: list[Scripted] = []

    def make() -> Scripted:
        script = ["higher", [{"role": "tool", "content": "42"}], "again", None]
        envs.append(Scripted(script, reward={"solved": 1.0, "speed": 0.25}))
        return envs[-1]

    with source_for(server, make, temperature=1.0) as source:
        sessions = [source.start(Task(str(i)), RolloutKey(0, i, 0)) for i in range(6)]
        rollouts = [s.result(timeout=WAIT) for s in sessions]
    for r in rollouts:
        assert r.status is Status.COMPLETED, r.error
        assert len(r.calls) == 4 and r.reward == 1.25
        assert dict(r.components) == {"solved": 1.0, "speed": 0.25}
        for before, after in zip(r.calls, r.calls[1:], strict=False):
            head = [*before.prompt, *before.completion]
            assert list(after.prompt[: len(head)]) == head  # token-exact extension
        assert len(chains(r.calls)) == 1
    assert merge_ratio(rollouts) == 1.0
    assert all(env.closed for env in envs)
    # The environment got each reply as text without the stop token.
    for env, r in zip(envs, rollouts, strict=True):
        for reply, call in zip(env.replies, r.calls, strict=True):
            ids = list(call.completion)
            if call.finish_reason == "stop":
                assert ids[-1] == EOS
                ids = ids[:-1]
            assert reply == TOK.decode(ids, skip_special_tokens=False)


def test_incremental_chat_tokens_equal_the_full_template() -> None:
    chat = ChatTokens(TOK)
    first = [{"role": "system", "content": "s"}, {"role": "user", "content": "guess 0-9"}]
    prompt = chat.first(first)
    reply = TOK("5<|im_end|>", add_special_tokens=False)["input_ids"]
    new = [{"role": "user", "content": "higher"}]
    extended = prompt + reply + chat.after_reply(TOK.decode(reply), True, new)
    full = [*first, {"role": "assistant", "content": "5"}, *new]
    want = TOK.apply_chat_template(full, add_generation_prompt=True, tokenize=True)
    assert extended == list(want["input_ids"])
    # A reply cut before its stop token gets the whole end-of-turn text.
    cut = TOK("5", add_special_tokens=False)["input_ids"]
    assert prompt + cut + chat.after_reply("5", False, new) == list(want["input_ids"])


@pytest.mark.parametrize(
    "text", ["", "5", "12=34", "<|im_end|>\n<|im_start|>user\nhigher", "héllo wörld ✓ 0"]
)
def test_the_text_encoder_gives_the_tokenizer_call_s_ids(text: str) -> None:
    want = list(TOK(text, add_special_tokens=False)["input_ids"])
    assert text_encoder(TOK)(text) == want

    class Wrapped:  # no Rust tokenizer to call: the tokenizer call itself
        def __call__(self, text: str, add_special_tokens: bool) -> dict[str, list[int]]:
            assert add_special_tokens is False
            return TOK(text, add_special_tokens=False)

    assert text_encoder(Wrapped())(text) == want


def test_templates_that_cannot_be_extended_are_refused() -> None:
    last_only = make_tokenizer()
    last_only.chat_template = "{{ messages[-1]['content'] }}"
    with pytest.raises(ValueError, match="concatenation"):
        ChatTokens(last_only)
    no_system = make_tokenizer()
    no_system.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system role') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(ValueError, match="no system role"):
        ChatTokens(no_system)


def test_agent_error_is_scored(server: RolloutServer) -> None:
    env = Scripted(["lower", AgentError("reply is not a number")], reward=0.5)
    with source_for(server, lambda: env) as source:
        r = run(source)
    assert r.status is Status.AGENT_ERROR and r.error == "reply is not a number"
    assert r.reward == 0.5 and len(r.calls) == 2 and env.closed


def _cannot_start() -> Scripted:
    raise RuntimeError("cannot start")


@pytest.mark.parametrize(
    ("where", "env"),
    [
        ("reset", lambda: Scripted([], opening=KeyError("no such task"))),
        ("step", lambda: Scripted([OSError("sandbox died")])),
        ("score", lambda: Scripted([None], reward=ZeroDivisionError("bad grader"))),
        ("score value", lambda: Scripted([None], reward=float("nan"))),
        ("observation", lambda: Scripted([42])),
        ("make_env", lambda: _cannot_start()),
    ],
)
def test_other_environment_failures_are_infra_errors(
    server: RolloutServer, where: str, env: Callable[[], Scripted]
) -> None:
    with source_for(server, env) as source:
        r = run(source)
    assert r.status is Status.INFRA_ERROR, where
    assert r.reward is None and dict(r.components) == {}
    assert r.error


def test_turn_limit(server: RolloutServer) -> None:
    with source_for(server, lambda: Scripted(["more"] * 10, reward=0.1), max_turns=3) as source:
        r = run(source)
    assert r.status is Status.TRUNCATED and r.truncation == "turns"
    assert len(r.calls) == 3 and r.reward == 0.1


def test_context_limit(server: RolloutServer) -> None:
    chat = ChatTokens(TOK)
    opening = len(chat.first([{"role": "user", "content": "start"}]))
    turn = len(chat.after_reply("abcd", False, [{"role": "user", "content": "x" * 10}]))
    second = opening + 4 + turn  # the second prompt (every reply is 4 tokens: no stop ids)
    for extra, replies in [(2, [4, 2]), (0, [4])]:
        # extra=2: the second reply gets 2 tokens of room and is cut by the context;
        # extra=0: there is no room left for a second reply at all.
        with source_for(
            server,
            lambda: Scripted(["x" * 10] * 10, reward=0.2),
            max_context=second + extra,
            stop_ids=(),
        ) as source:
            r = run(source)
        assert r.status is Status.TRUNCATED and r.truncation == "context"
        assert r.reward == 0.2
        assert [len(c.completion) for c in r.calls] == replies
        assert all(len(c.prompt) + len(c.completion) <= second + extra for c in r.calls)
    # The opening alone does not fit: the task cannot run at all.
    with source_for(server, lambda: Scripted([None]), max_context=opening) as source:
        r = run(source)
    assert r.status is Status.INFRA_ERROR and "max_context" in (r.error or "")


@pytest.mark.timeout(120)
def test_wall_clock_limit(server: RolloutServer) -> None:
    class Slow(Scripted):
        def step(self, reply: str) -> Any:
            # Spend the whole budget inside the step; the limit is checked after it.
            end = self.began + 0.2
            while time.monotonic() < end:
                time.sleep(0.01)
            return "go on"

        def reset(self, task: Task) -> Any:
            self.began = time.monotonic()
            return "start"

    with source_for(server, lambda: Slow([], reward=0.3), wall_clock=0.1) as source:
        r = run(source)
    assert r.status is Status.TRUNCATED and r.truncation == "wall_clock"
    assert len(r.calls) == 1 and r.reward == 0.3


@pytest.mark.timeout(120)
def test_cancel_between_steps_and_during_generation(server: RolloutServer) -> None:
    gate = threading.Event()
    env = Scripted(["next", None], gate=gate)
    with source_for(server, lambda: env) as source:
        session = source.start(Task("0"), RolloutKey(0, 0, 0))
        deadline = time.monotonic() + WAIT
        while not env.replies:  # the first step has begun and waits on the gate
            assert time.monotonic() < deadline
            time.sleep(0.001)
        session.cancel()
        gate.set()
        r = session.result(timeout=WAIT)
    assert r.status is Status.CANCELLED and r.reward is None
    assert len(env.replies) == 1  # no step after the cancel

    with source_for(server, lambda: Scripted([None]), max_tokens=400, stop_ids=()) as source:
        session = source.start(Task("0"), RolloutKey(0, 1, 0))
        deadline = time.monotonic() + WAIT
        while server.stats()["active"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        session.cancel()
        r = session.result(timeout=WAIT)
    assert r.status is Status.CANCELLED
    assert server.stats()["active"] == 0  # the generation was aborted, not finished


def test_bad_configuration(server: RolloutServer) -> None:
    env = lambda: Scripted([None])  # noqa: E731
    for kw, message in [
        ({"max_turns": 0}, "max_turns"),
        ({"max_context": 1}, "max_context"),
        ({"max_context": 10_000}, "max_len"),
        ({"wall_clock": 0}, "wall_clock"),
        ({"max_tokens": 0}, "max_tokens"),
    ]:
        with pytest.raises(ValueError, match=message):
            source_for(server, env, **kw)
    plain = make_tokenizer()
    plain.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        EnvironmentSource(
            server,
            env,
            tokenizer=plain,
            max_turns=1,
            max_context=64,
            sampling=SamplingParams(max_tokens=1),
        )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2])
def test_workers_bounds_how_many_episodes_run_at_once(server: RolloutServer, workers: int) -> None:
    gate = threading.Event()
    cond = threading.Condition()
    opened: list[str] = []

    class Held(Scripted):
        def reset(self, task: Task) -> Any:
            with cond:
                opened.append(task.id)
                cond.notify_all()
            assert gate.wait(WAIT)
            return "start"

    with source_for(server, lambda: Held([None]), workers=workers) as source:
        sessions = [source.start(Task(str(i)), RolloutKey(0, i, 0)) for i in range(2)]
        with cond:
            assert cond.wait_for(lambda: len(opened) >= workers, WAIT)
            # One worker: the second episode must not open while the first is held; a
            # source that ignored the bound would open it within this wait.
            assert cond.wait_for(lambda: len(opened) >= 2, 0.5) == (workers == 2)
        gate.set()
        rollouts = [session.result(timeout=WAIT) for session in sessions]
    assert [r.status for r in rollouts] == [Status.COMPLETED] * 2 and sorted(opened) == ["0", "1"]


@pytest.mark.timeout(180)
def test_guess_environment_end_to_end(server: RolloutServer) -> None:
    with source_for(
        server,
        make_env(low=0, high=9, seed=3),
        max_turns=5,
        max_tokens=2,
        temperature=1.0,
        workers=8,
    ) as source:
        sessions = [source.start(Task(str(i)), RolloutKey(1, i, 0)) for i in range(24)]
        rollouts = [s.result(timeout=WAIT) for s in sessions]
    allowed = {Status.COMPLETED, Status.AGENT_ERROR, Status.TRUNCATED}
    assert {r.status for r in rollouts} <= allowed
    for r in rollouts:
        assert r.reward is not None and isinstance(r.components, Mapping)
        assert set(r.components) == {"solved", "quick"}
        assert (r.components["solved"] == 1.0) == (r.status is Status.COMPLETED)
    assert merge_ratio(rollouts) == 1.0
    assert np.isfinite([r.reward for r in rollouts]).all()


class Routed:
    """The server, noting the affinity of every call (a fleet routes on it)."""

    def __init__(self, server: RolloutServer) -> None:
        self.server = server
        self.version = server.version
        self.max_len = server.max_len
        self.affinities: list[object] = []

    def submit(self, prompt: Any, params: SamplingParams, **kw: Any) -> Any:
        self.affinities.append(kw.get("affinity"))
        return self.server.submit(prompt, params, **kw)

    def generate(self, prompt: Any, params: SamplingParams, **kw: Any) -> Any:
        return self.submit(prompt, params, **kw).result()

    def abort(self, future: Any) -> None:
        self.server.abort(future)


def test_every_turn_carries_the_group_as_affinity(server: RolloutServer) -> None:
    engine = Routed(server)
    with source_for(engine, lambda: Scripted(["more", "more", None])) as source:  # type: ignore[arg-type]
        r = source.start(Task("0"), RolloutKey(4, 1, 0)).result(timeout=WAIT)
    assert len(r.calls) == 3 and engine.affinities == [4, 4, 4]


class Lossy(Routed):
    """Serves the first call, then loses every request to a fault."""

    def submit(self, prompt: Any, params: SamplingParams, **kw: Any) -> Any:
        from concurrent.futures import Future

        from dew.core import Call, EngineError

        if not self.affinities:
            return super().submit(prompt, params, **kw)
        self.affinities.append(kw.get("affinity"))
        future: Future[Call] = Future()
        future.set_exception(EngineError("engine died"))
        return future


def test_a_call_lost_to_a_fault_is_an_infra_error(server: RolloutServer) -> None:
    engine = Lossy(server)
    with source_for(engine, lambda: Scripted(["more", None])) as source:  # type: ignore[arg-type]
        r = run(source)
    assert r.status is Status.INFRA_ERROR and r.reward is None
    assert r.error == "engine: EngineError: engine died" and len(r.calls) == 1
