"""Fixtures of the serving tests: a lively tiny Qwen2 model and a server around it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from dew.serving import RolloutServer

from ._helpers import lively


@pytest.fixture(scope="module")
def qwen() -> torch.nn.Module:
    return lively("qwen2", 1)


@pytest.fixture
def server(qwen: torch.nn.Module) -> Iterator[RolloutServer]:
    srv = RolloutServer(qwen, max_batch=16, seed=0)
    yield srv
    srv.close()
