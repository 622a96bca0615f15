"""Engines placed on devices: the names checked against this machine, ``dew serve
--device``, one device per launched engine of a fleet (a vLLM server shown only its
own GPU), and the in-process engine's copy on a device of its own."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import torch

from dew._devices import default_device, device_problem
from dew.core import EngineError, SamplingParams
from dew.serving import RolloutServer
from dew.serving.fleet import EngineFleet
from dew.serving.fleet._parts import _gpu, local_processes

from ._helpers import lively

NO_CUDA = not torch.cuda.is_available()


def test_device_names_are_checked_against_this_machine() -> None:
    assert device_problem("cpu") is None
    assert device_problem("gpu:1") == "not a device name (cpu, cuda, cuda:N, xpu, xpu:N or mps)"
    assert device_problem("cuda:") is not None
    if NO_CUDA:
        assert device_problem("cuda:1") == "CUDA is not available on this machine"
        assert default_device() == "cpu"
    else:
        count = torch.cuda.device_count()
        assert device_problem(f"cuda:{count}") == f"this machine has {count} cuda devices (0..)"


def test_each_launched_engine_gets_its_own_device() -> None:
    def argv(devices: list[str] | None) -> list[list[str]]:
        made = local_processes(
            "dew", 2, demo="tiny", model=None, seed=0, args=(), env=None, python=None,
            router=None, weights_dir="/tmp/w", devices=devices,
        )  # fmt: skip
        return [p.argv for p in made]  # type: ignore[attr-defined]

    placed = argv(["cuda:1", "cuda:2"])
    assert [a[-2:] for a in placed] == [["--device", "cuda:1"], ["--device", "cuda:2"]]
    assert all("--device" not in a for a in argv(None))  # each server's own default
    with pytest.raises(ValueError, match=r"one device per engine \(2\)"):
        argv(["cuda:1"])
    # vLLM takes the first GPU it sees: it is shown only its own.
    assert _gpu({"OMP_NUM_THREADS": "1"}, "cuda:3") == {
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "3",
    }
    assert _gpu(None, "cpu") is None and _gpu(None, "cuda") is None


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_fleet_launched_on_devices_serves_there_and_a_missing_one_is_one_line() -> None:
    with EngineFleet.launch(1, demo="tiny", devices=["cpu"]) as fleet:
        assert fleet.generate([5, 6], SamplingParams(max_tokens=2)).completion
        with _client(fleet.members()[0].url) as client:
            assert client.get("/get_model_info").json()["dew_device"] == "cpu"
    if NO_CUDA:
        with pytest.raises(EngineError, match="--device cuda:1: CUDA is not available"):
            EngineFleet.launch(1, demo="tiny", devices=["cuda:1"], startup_timeout=60)


@pytest.mark.timeout(60)
def test_dew_serve_refuses_a_device_this_machine_lacks_in_one_line() -> None:
    if not NO_CUDA:
        pytest.skip("this machine has CUDA")
    done = subprocess.run(
        [sys.executable, "-m", "dew.serve", "--demo", "tiny", "--port", "0", "--device", "cuda:1"],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert done.returncode == 2
    assert (
        done.stderr == "dew serve: error: --device cuda:1: CUDA is not available on this machine\n"
    )


def test_the_in_process_engine_copy_goes_to_its_own_device() -> None:
    model = lively("qwen2", 4)
    with RolloutServer(model, device="cpu") as engine:
        assert engine.device == torch.device("cpu")
        assert engine.generate([5, 6], SamplingParams(max_tokens=2)).completion
    if NO_CUDA:  # the device reaches torch: a GPU this machine lacks is torch's error
        with pytest.raises((RuntimeError, AssertionError), match=r"(?i)cuda"):
            RolloutServer(model, device="cuda:1")


def _client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=30)
