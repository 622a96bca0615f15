"""Helpers of the serving tests: lively tiny models, prompts, a reference greedy decode."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import torch

from dew.demo.model import make_model

WAIT = 60.0  # seconds; the bound on every wait for an engine event in these tests


def chaos_seed() -> int:
    """The seed of a chaos test: ``DEW_CHAOS_SEED`` to replay one a failure named, else
    the clock (each run lands its faults somewhere new)."""
    given = os.environ.get("DEW_CHAOS_SEED")
    return int(given) if given else int(time.time())


def lively(arch: str, seed: int) -> torch.nn.Module:
    """A tiny random model with weights scaled up: at the default init, greedy decoding
    just repeats the last prompt token, which would make every greedy check vacuous."""
    model = make_model(arch, "tiny", seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    return model


def prompts(
    count: int, vocab: int, *, seed: int = 0, low: int = 2, high: int = 12
) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(low, high + 1, (count,), generator=g).tolist()
    return [torch.randint(6, vocab, (n,), generator=g).tolist() for n in lens]


def hf_greedy(
    model: torch.nn.Module, prompt: list[int], new: int, eos: int | None = None
) -> list[int]:
    """``model.generate`` greedy output; it stops only at ``eos`` (kept), when given."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=eos,
        )
    tokens = out[0, len(prompt) :].tolist()
    if eos is None:
        assert len(tokens) == new
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def wait_until(check: Callable[[], bool], what: str) -> None:
    """Poll an engine counter until ``check`` holds (bounded by WAIT)."""
    deadline = time.monotonic() + WAIT
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


class Worker:
    """Runs one blocking call on its own thread and keeps its result or exception."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.result: object = None
        self.error: BaseException | None = None
        self.done = threading.Event()

        def run() -> None:
            try:
                self.result = fn()
            except BaseException as exc:  # kept for the test to assert on
                self.error = exc
            finally:
                self.done.set()

        self.thread = threading.Thread(target=run)
        self.thread.start()

    def join(self, timeout: float = WAIT) -> object:
        assert self.done.wait(timeout), "worker did not finish"
        self.thread.join()
        return self.result
