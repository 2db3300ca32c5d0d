"""/v1/responses with the official openai SDK, unmodified: create, stream, usage, refusals, request ids."""

from __future__ import annotations

import httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(server_url):
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0)


def test_create_matches_chat(client):
    response = client.responses.create(model=MODEL, input=QUESTION, instructions="Answer in one sentence.",
                                       temperature=0, max_output_tokens=40)
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=40, messages=[
        {"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": QUESTION}])
    assert response.object == "response" and response.output_text == chat.choices[0].message.content
    assert "Paris" in response.output_text
    assert response.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert response._request_id and response.id == "resp_" + response._request_id


def test_message_list_input_and_truncation(client):
    response = client.responses.create(model=MODEL, max_output_tokens=3, temperature=0, input=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Name three colours."}]}])
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output_text


def test_stream_sends_the_responses_events_in_order(client):
    expected_text = client.responses.create(model=MODEL, input=QUESTION, temperature=0,
                                            max_output_tokens=40).output_text
    with client.responses.stream(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=40) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    head = ["response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
            "response.completed"]
    assert kinds[:4] == head and kinds[-4:] == tail
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected_text
    assert final.output_text == expected_text and final.usage.output_tokens > 0


@pytest.mark.parametrize("extra,named", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input_image"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "function_call_output"),
    ({"temperature": 3}, "temperature"),
])
def test_unserved_fields_are_a_400_naming_them(client, extra, named):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**({"model": MODEL, "input": "Hi", "max_output_tokens": 2} | extra))
    assert named in caught.value.message


def test_a_limit_past_the_context_names_max_output_tokens(server_url):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 10**9}
    error = httpx.post(server_url + "/v1/responses", json=body, timeout=60).json()["error"]
    assert error["param"] == "max_output_tokens" and "max_output_tokens" in error["message"]
    assert "max_tokens" not in error["message"].replace("max_output_tokens", "")


@pytest.mark.parametrize("instructions", [None, "Be brief."])
def test_a_prompt_past_the_context_names_input(server_url, instructions):
    body = {"model": MODEL, "input": [{"role": "user", "content": "x " * 9000}], "instructions": instructions}
    error = httpx.post(server_url + "/v1/responses", json=body, timeout=60).json()["error"]
    assert error["param"] == "input" and "prompt has" in error["message"]


def test_store_false_and_metadata_are_accepted(server_url):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "store": False, "metadata": {"k": "v"}}
    response = httpx.post(server_url + "/v1/responses", json=body, timeout=60)
    assert response.status_code == 200 and response.json()["metadata"] == {"k": "v"}


def test_request_id_reaches_the_sdk(client):
    completion = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert completion._request_id and completion.id == "cmpl-" + completion._request_id
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "Hi"}],
        extra_headers={"x-request-id": "my-trace-1"})
    assert raw.request_id == "my-trace-1" and raw.parse().id == "chatcmpl-my-trace-1"


def _raw_events(url: str, body: dict) -> list[tuple[str, dict]]:
    """A streamed /v1/responses reply as (SSE event name, data) pairs, as sent."""
    import json

    response = httpx.post(url + "/v1/responses", json=body | {"stream": True}, timeout=120)
    assert response.status_code == 200, response.text
    events, name = [], None
    for line in response.text.splitlines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: "):])))
    return events


@pytest.mark.parametrize("limit,terminal", [(40, "response.completed"), (2, "response.incomplete")])
def test_stream_events_validate_against_the_sdks_event_schema(server_url, limit, terminal):
    """Each event parses as the SDK's own ``ResponseStreamEvent`` type with every required field (the SDK's stream
    reader is lenient: it would not say), and the ids and indices tie the events to one message and one part."""
    import typing

    from openai.types.responses import Response, ResponseStreamEvent

    kinds = {typing.get_args(cls.model_fields["type"].annotation)[0]: cls
             for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}
    events = _raw_events(server_url, {"model": MODEL, "input": QUESTION, "temperature": 0,
                                      "max_output_tokens": limit})
    for name, data in events:
        assert name == data["type"]
        kinds[data["type"]].model_validate(data)  # raises on a missing or mistyped field, nested ones included
    datas = [data for _, data in events]
    assert [d["sequence_number"] for d in datas] == list(range(len(datas)))
    item_id = datas[2]["item"]["id"]
    assert all(d["item_id"] == item_id and d["output_index"] == 0 and d["content_index"] == 0
               for d in datas if "item_id" in d)
    assert datas[-1]["type"] == terminal
    final = Response.model_validate(datas[-1]["response"])
    assert final.output[0].id == item_id and final.id == datas[0]["response"]["id"]
    assert final.output_text == "".join(d["delta"] for d in datas if d["type"] == "response.output_text.delta")


def test_responses_and_chat_without_a_limit_stop_at_the_default_cap(smollm2):
    """Before, a Responses request without max_output_tokens generated until the context was full."""
    from kvserve.server.config import ServeConfig
    from tests.serverutil import running_server

    with running_server(smollm2, ServeConfig(num_kv_blocks=64, default_max_tokens=5)) as url:
        body = {"model": MODEL, "input": "Count from one to one hundred in words.", "temperature": 0}
        response = httpx.post(url + "/v1/responses", json=body, timeout=120).json()
        assert response["usage"]["output_tokens"] == 5 and response["status"] == "incomplete"
        assert response["incomplete_details"] == {"reason": "max_output_tokens"}
        chat = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": body["input"]}], "temperature": 0}).json()
        assert chat["usage"]["completion_tokens"] == 5 and chat["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("item", [{"role": "tool", "content": "x"}, {"type": "function_call_output", "output": "x"}])
def test_a_refused_input_item_is_named_by_its_place_not_by_pydantics_union_tags(server_url, item):
    response = httpx.post(server_url + "/v1/responses", json={"input": [item], "max_output_tokens": 1}, timeout=60)
    assert response.status_code == 400, response.text
    param = response.json()["error"]["param"]
    assert param.startswith("input.0") and "[" not in param and "function-after" not in param, param


@pytest.mark.parametrize("extra, param", [({"seed": 7}, "seed"), ({"stop": [" "]}, "stop"), ({"top_k": 5}, "top_k"),
                                          ({"text": {"verbosity": "low"}}, "text.verbosity"),
                                          ({"text": {"fmt": {}}}, "text.fmt"),
                                          ({"stream_options": {"include_usage": True}}, "stream_options")])
def test_a_field_the_responses_route_would_ignore_is_a_400_naming_it(server_url, extra, param):
    """As on chat and completions: a field not served is refused by name (seed and stop were taken and ignored)."""
    response = httpx.post(server_url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 1} | extra,
                          timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_responses_fields_without_effect_are_accepted(server_url):
    body = {"input": "Hi", "max_output_tokens": 1, "prompt_cache_key": "k", "safety_identifier": "u",
            "text": {"format": {"type": "text"}, "verbosity": "medium"}, "store": False, "parallel_tool_calls": True}
    assert httpx.post(server_url + "/v1/responses", json=body, timeout=60).status_code == 200
