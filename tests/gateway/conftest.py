"""Fixtures of the harness tests: one real engine per module, a spy over it per test,
and a recording gateway in front of the spy (modules that define their own win)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dew.core import SamplingParams
from dew.demo.model import make_model
from dew.gateway import RecordingGateway
from dew.serving import RolloutServer

from ._live import TOK, Spy


@pytest.fixture(scope="module")
def server() -> Iterator[RolloutServer]:
    with RolloutServer(make_model(max_positions=256), max_batch=16) as s:
        yield s


@pytest.fixture
def spy(server: RolloutServer) -> Spy:
    return Spy(server)


@pytest.fixture
def gateway(spy: Spy) -> Iterator[RecordingGateway]:
    with RecordingGateway(spy, TOK, sampling=SamplingParams(max_tokens=200), max_turns=4) as gw:
        yield gw
