"""Fuzzed requests against a real `dew serve`: never a 5xx, always a well-formed answer.

Bodies are drawn from the server's own request models (their field names, at every
level, get missing, mistyped, huge or nested values), plus raw bytes, cut JSON and
hostile constants, sent to every POST route. Every answer must be a 2xx or a 4xx
whose error names the problem; a 200 from ``/generate`` must be a whole, consistent
completion; afterwards the server must still be healthy and serving.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dew.serving._http_common import GenerateBody, SamplingBody
from tests._fuzz import json_values

from ._launch import Served, serve

ROUTES = [
    "/generate",
    "/abort_request",
    "/update_weights_from_disk",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
]
BASE: dict[str, Any] = {
    "input_ids": [9, 8],
    "sampling_params": {"max_new_tokens": 2, "stop_token_ids": []},
    "return_logprob": True,
}


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve("--demo", "tiny", "--max-batch", "16") as s:
        yield s


@pytest.fixture(scope="module")
def http(served: Served) -> Iterator[httpx.Client]:
    with served.client(timeout=60.0) as client:
        yield client


huge = st.sampled_from([2**31, 2**63, 10**20, -1, 0, -(2**63), 10**400])
# Numbers a sampler can choke on: temperatures and top-p near 0 (logits / t overflow),
# and far past any sensible range.
extreme = st.sampled_from([5e-324, 1e-300, 1e-40, 1e-9, 5e-3, 1e300, 1.7e308]) | st.floats(
    min_value=0.0, max_value=1e-2
)
# Weight files a hostile client names: secrets, endless or blocking files, folders,
# climbs out of the weights folder.
paths = st.sampled_from(
    [
        "/etc/shadow", "/etc/passwd", "/proc/self/environ", "/proc/self/mem", "/dev/zero",
        "/dev/urandom", "/dev/stdin", "/", ".", "..", "../../etc/passwd", "", "\x00",
    ]
) | st.text(max_size=30)  # fmt: skip
id_lists = st.lists(st.integers(-5, 10**6), max_size=40)
# The models' own field names: a field added to the schema is fuzzed without an edit here.
TOP = sorted(GenerateBody.model_fields)
SAMPLING = sorted(SamplingBody.model_fields)


@st.composite
def mutated(draw: Any) -> bytes:
    body = json.loads(json.dumps(BASE))
    for _ in range(draw(st.integers(0, 4))):
        inner = draw(st.booleans()) and isinstance(body.get("sampling_params"), dict)
        target = body["sampling_params"] if inner else body
        name = draw(st.sampled_from(SAMPLING if inner else TOP) | st.text(max_size=8))
        choice = draw(st.integers(0, 4))
        if choice == 0:
            target.pop(name, None)
        elif choice == 1:
            target[name] = draw(json_values)
        elif choice == 2:
            target[name] = draw(huge)
        elif choice == 3:
            target[name] = draw(id_lists)
        else:
            target[name] = draw(extreme)
    if draw(st.integers(0, 4)) == 0:  # the weight push's fields, for the weights route
        body["model_path"] = draw(paths)
        body["dew_version"] = draw(st.integers(0, 3))
    if draw(st.booleans()):  # in range: these must be served, not refused
        body["sampling_params"] = {
            "max_new_tokens": draw(st.integers(1, 4)),
            "temperature": draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])),
            "top_k": draw(st.sampled_from([-1, 1, 5])),
            "top_p": draw(st.sampled_from([0.1, 1.0])),
            "stop_token_ids": draw(st.lists(st.integers(0, 90), max_size=3)),
        }
        body["input_ids"] = draw(st.lists(st.integers(0, 90), min_size=1, max_size=20))
    return json.dumps(body, allow_nan=True).encode()


raw_bodies = st.one_of(
    mutated(),
    st.binary(max_size=200),
    st.sampled_from(
        [
            b"",
            b"null",
            b"[]",
            b"{",
            b"[" * 1500,
            b'{"input_ids": NaN}',
            b'{"input_ids": [1e400]}',
            b'{"rid": "\\ud800"}',
            b'{"rid": "\xff\xfe"}',
            b"1" * 5000,
        ]
    ),
    mutated().map(lambda b: b[: len(b) // 2]),
)


CANARY = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 6, "stop_token_ids": []}}


def check_one(served: Served, http: httpx.Client, body: bytes, route: str) -> None:
    # A well-formed request in flight beside the fuzzed one: whatever the fuzzed one
    # sent, this one must be served whole.
    with ThreadPoolExecutor(1) as pool:
        canary = pool.submit(http.post, "/generate", json=CANARY)
        checked = _check_fuzzed(http, body, route)
        c = canary.result()
    assert c.status_code == 200 and len(c.json()["output_ids"]) == 6, (body[:300], c.text)
    if route == "/update_weights_from_disk" and checked is not None:
        # Refused or not, no answer quotes a file the server may read.
        assert "root:" not in checked and "PATH=" not in checked, checked


def _check_fuzzed(http: httpx.Client, body: bytes, route: str) -> str | None:
    r = http.post(route, content=body, headers={"content-type": "application/json"})
    event(f"{route} {r.status_code}")
    assert r.status_code < 500, (route, body[:300], r.text[:500])
    answer = r.json()
    if r.status_code >= 400:
        message = answer["error"]["message"]
        assert isinstance(message, str) and message, answer
        return r.text
    if route != "/generate":
        return r.text
    request = json.loads(body)
    asked = request["sampling_params"]["max_new_tokens"]
    ids, meta = answer["output_ids"], answer["meta_info"]
    assert 1 <= len(ids) <= asked, (request, answer)
    assert meta["completion_tokens"] == len(ids) and meta["prompt_tokens"] == len(
        request["input_ids"]
    )
    if request.get("return_logprob"):
        rows = meta["output_token_logprobs"]
        assert [row[1] for row in rows] == ids
        assert all(row[0] <= 0.0 for row in rows)
    return r.text


SETTINGS = {"deadline": None, "suppress_health_check": list(HealthCheck)}
FUZZ = {"body": raw_bodies, "route": st.sampled_from(ROUTES) | st.just("/generate")}


@pytest.mark.slow
@pytest.mark.timeout(600)
@settings(max_examples=200, **SETTINGS)
@given(**FUZZ)
def test_fuzzed_requests_never_5xx(served: Served, http: httpx.Client, body: bytes, route: str):
    check_one(served, http, body, route)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@settings(max_examples=2000, **SETTINGS)
@given(**FUZZ)
def test_thousands_of_fuzzed_requests_never_5xx(
    served: Served, http: httpx.Client, body: bytes, route: str
):
    check_one(served, http, body, route)


def test_dew_serve_is_healthy_and_serving_after_the_fuzzing(
    served: Served, http: httpx.Client
) -> None:
    # Runs after the fuzz tests of this module (pytest keeps file order).
    assert http.get("/health").json()["status"] == "ok"
    r = http.post("/generate", json=BASE)
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == 2
    assert served.proc.poll() is None
