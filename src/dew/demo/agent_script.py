"""The demo agent: an ordinary OpenAI-client program that knows nothing about dew.

Run as ``python -m dew.demo.agent_script``. It reads its task from ``DEW_TASK``
(JSON ``{"id": ..., "data": {"digit": d}}``, or the file named by
``DEW_TASK_FILE``) and talks to whatever ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``
point at, as any agent harness would. ``DEW_MODEL`` names the model (default
``dew``) and ``DEW_MAX_TOKENS`` caps each reply (default 4). It prints its replies
as one JSON line.

The episode, two model turns with a tool call between them:

1. the user asks the model to repeat a digit ``d``;
2. the agent runs the ``next_digit`` tool on the model's reply (the digit after
   the reply's first character, or after ``d`` when the reply does not start with
   a digit) and hands the result back as a ``tool`` message;
3. the model should repeat the tool's digit.

The agent sends every earlier message back verbatim, so each prompt extends the
previous prompt and reply and the gateway records the episode as one chain.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def next_digit(reply: str, fallback: int) -> int:
    """The tool: the digit after ``reply``'s first character, else after ``fallback``."""
    first = reply[:1]
    base = int(first) if first.isdigit() and first.isascii() else fallback
    return (base + 1) % 10


def solve(client: Any, model: str, digit: int, *, max_tokens: int) -> dict[str, Any]:
    """One episode through ``client`` (an ``openai.OpenAI``): the replies and the tool result."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"digit {digit}"}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens)
    reply = first.choices[0].message.content or ""
    tool = next_digit(reply, digit)
    messages.append({"role": "assistant", "content": reply})
    # The tool answers in the user's words, so "repeat the last digit" solves both turns.
    messages.append({"role": "tool", "tool_call_id": "next_digit", "content": f"digit {tool}"})
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens)
    return {"replies": [reply, second.choices[0].message.content or ""], "tool": tool}


def _task() -> dict[str, Any]:
    raw = os.environ.get("DEW_TASK")
    if raw is None:
        with open(os.environ["DEW_TASK_FILE"]) as f:
            raw = f.read()
    return json.loads(raw)


def main() -> int:
    import openai

    task = _task()
    max_tokens = int(os.environ.get("DEW_MAX_TOKENS", "4"))
    model = os.environ.get("DEW_MODEL", "dew")
    with openai.OpenAI(max_retries=0) as client:  # OPENAI_BASE_URL / OPENAI_API_KEY
        out = solve(client, model, int(task["data"]["digit"]), max_tokens=max_tokens)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
