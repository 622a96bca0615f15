"""``/generate`` as SGLang's clients also send it: text prompts and text answers (with
the model's tokenizer), and a batch of prompts in one request, answered in order."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from dew.demo.model import make_tokenizer

from ._launch import Served, serve

TOK = make_tokenizer()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve("--demo", "tiny", "--max-batch", "8") as s:  # the demo tokenizer comes with it
        yield s


def greedy(max_new: int) -> dict[str, Any]:
    return {"max_new_tokens": max_new, "temperature": 0.0, "stop_token_ids": []}


@pytest.mark.timeout(60)
def test_a_text_prompt_is_tokenized_and_every_answer_says_its_text(served: Served) -> None:
    with served.client() as client:
        by_text = client.post("/generate", json={"text": "12+34=", "sampling_params": greedy(5)})
        assert by_text.status_code == 200, by_text.text
        ids = TOK("12+34=")["input_ids"]
        by_ids = client.post("/generate", json={"input_ids": ids, "sampling_params": greedy(5)})
    a, b = by_text.json(), by_ids.json()
    assert a["output_ids"] == b["output_ids"] and a["meta_info"]["prompt_tokens"] == len(ids)
    assert a["text"] == b["text"] == TOK.decode(a["output_ids"], skip_special_tokens=True)


@pytest.mark.timeout(60)
def test_a_batch_is_answered_in_order_each_prompt_with_its_own_params(served: Served) -> None:
    prompts = [TOK(t)["input_ids"] for t in ("1+1=", "22+3=", "7+70=")]
    with served.client() as client:
        singles = [
            client.post("/generate", json={"input_ids": p, "sampling_params": greedy(n)}).json()
            for p, n in zip(prompts, (2, 3, 4), strict=True)
        ]
        batch = client.post(
            "/generate",
            json={
                "input_ids": prompts,
                "sampling_params": [greedy(2), greedy(3), greedy(4)],
                "rid": ["a", "b", "c"],
                "return_logprob": True,
            },
        )
        assert batch.status_code == 200, batch.text
        texts = client.post(
            "/generate", json={"text": ["1+1=", "22+3="], "sampling_params": greedy(2)}
        ).json()
    answers = batch.json()
    assert [a["meta_info"]["id"] for a in answers] == ["a", "b", "c"]
    assert [a["output_ids"] for a in answers] == [s["output_ids"] for s in singles]
    assert [len(a["meta_info"]["output_token_logprobs"]) for a in answers] == [2, 3, 4]
    assert [t["output_ids"] for t in texts] == [s["output_ids"][:2] for s in singles[:2]]


@pytest.mark.timeout(60)
def test_one_prompt_of_a_batch_aborted_by_rid_answers_the_abort_shape_alone(
    served: Served,
) -> None:
    long = {"max_new_tokens": 900, "temperature": 1.0, "stop_token_ids": []}
    body = {"input_ids": [[5, 6], [7, 8]], "sampling_params": [long, greedy(3)], "rid": ["x", "y"]}
    with served.client() as client, ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.post, "/generate", json=body)
        deadline = time.monotonic() + 30
        while client.get("/health").json()["dew_in_flight"] < 1:
            assert time.monotonic() < deadline and not pending.done()
        assert client.post("/abort_request", json={"rid": "x"}).json()["success"] is True
        x, y = pending.result(timeout=30).json()
    assert x["meta_info"]["finish_reason"] == {"type": "abort"} and x["output_ids"] == []
    assert y["meta_info"]["finish_reason"]["type"] == "length" and len(y["output_ids"]) == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"input_ids": [[5], [6]], "rid": "r"}, "rid", "rid must be a list of 2"),
        ({"input_ids": [[5], [6]], "rid": ["r", "r"]}, "rid", "2 distinct"),
        ({"input_ids": [5], "sampling_params": [greedy(1)]}, "sampling_params", "list of 1"),
        ({"input_ids": [[5], [6]], "sampling_params": [greedy(1)] * 3}, "sampling_params", "(2)"),
        ({"input_ids": [[5], [999999]]}, "input_ids[1]", r"input_ids[1][0] = 999999"),
        ({"input_ids": [[5], []]}, "input_ids[1]", "input_ids[1] is empty"),
        ({"input_ids": [], "text": None}, "input_ids", "input_ids is empty"),
        ({"input_ids": [5], "text": "5"}, "input_ids", "send input_ids or text"),
        ({"text": []}, "text", "text is an empty batch"),
    ],
)
def test_a_malformed_batch_is_a_400_naming_the_field(
    served: Served, body: dict[str, Any], param: str, message: str
) -> None:
    with served.client() as client:
        answer = client.post("/generate", json={"sampling_params": greedy(1), **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and message in error["message"], error
