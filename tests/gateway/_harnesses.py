"""Harnesses that the harness-process tests send to other processes: defined at module
level (so they pickle by reference) in a module that imports nothing heavy."""

from __future__ import annotations

import os
import sys

from dew.core import Task
from dew.gateway import HarnessEndpoint

WAIT = 60.0


def ask(endpoint: HarnessEndpoint, turns: int, max_tokens: int = 3) -> str:
    with endpoint.client(max_retries=0) as c:
        messages = [{"role": "user", "content": "q"}]
        reply = ""
        for _ in range(turns):
            r = c.chat.completions.create(
                model=endpoint.model, messages=messages, max_tokens=max_tokens
            )
            reply = r.choices[0].message.content or ""
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "+"}]
        return reply


def pid_and_reply(task: Task, ep: HarnessEndpoint) -> tuple[int, str]:
    return os.getpid(), ask(ep, turns=2)


def raises_after_a_call(task: Task, ep: HarnessEndpoint) -> None:
    ask(ep, turns=1)
    raise RuntimeError("the agent misformatted its answer")


def quits(task: Task, ep: HarnessEndpoint) -> None:
    ask(ep, turns=1)
    sys.exit(2)


def returns_what_cannot_be_pickled(task: Task, ep: HarnessEndpoint) -> object:
    ask(ep, turns=1)
    return lambda: None


def waits_for_stop(task: Task, ep: HarnessEndpoint) -> str:
    ask(ep, turns=1, max_tokens=1)
    assert ep.stop.wait(WAIT)  # set in this process by the parent's stop message
    return "stopped"
