"""Faults that well-kept servers learned about in public: an error response without its request id, forged log
lines, validation that throws, numerics at the edges, constraints that silently fail, one request that beats
the queue, unbounded headers, and CPU work on the event loop."""

from __future__ import annotations

import logging

import httpx
import pytest
from fastapi.testclient import TestClient

from kvserve.server.app import create_app
from kvserve.server.config import ServeConfig
from kvserve.server.state import ServerState


@pytest.fixture(scope="module")
def bare_state(smollm2):
    return ServerState(smollm2, ServeConfig(num_kv_blocks=8, block_size=16))


def test_an_unhandled_error_still_carries_its_request_id_and_is_logged_as_500(bare_state, caplog):
    app = create_app(bare_state)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a bug")

    caplog.set_level(logging.INFO, logger="kvserve.requests")
    with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as client:
        response = client.get("/boom", headers={"x-request-id": "trace-42"})
    assert response.status_code == 500 and response.headers["x-request-id"] == "trace-42"
    assert response.json()["error"]["code"] == "internal_error"
    assert "a bug" not in response.text  # the exception's text stays in the log, not in the reply
    lines = [r.getMessage() for r in caplog.records if r.name == "kvserve.requests"]
    assert any(line.startswith("GET /boom 500 request_id=trace-42") for line in lines), lines


def test_the_request_log_escapes_the_path(bare_state, caplog):
    caplog.set_level(logging.INFO, logger="kvserve.requests")
    with TestClient(create_app(bare_state), base_url="http://127.0.0.1") as client:
        client.get("/v1/x%0AGET%20/v1/models%20200%20request_id=forged%0D")
    lines = [r.getMessage() for r in caplog.records if r.name == "kvserve.requests"]
    assert lines and all("\n" not in line and "\r" not in line for line in lines)
    assert any(line.startswith("GET /v1/x\\nGET /v1/models 200 request_id=forged\\r 404") for line in lines), lines


def _post(url: str, path: str, body) -> httpx.Response:
    import json

    return httpx.post(url + path, content=json.dumps(body).encode(), timeout=60,
                      headers={"content-type": "application/json"})


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.mark.parametrize("path,body,named", [
    (COMPLETIONS, {"prompt": "Hi", "logit_bias": {"²": 1}}, "logit_bias"),        # isdigit() yes, int() no
    (COMPLETIONS, {"prompt": "Hi", "logit_bias": {"1" * 5000: 1}}, "logit_bias"),  # int() refuses 4,300+ digits
    (COMPLETIONS, {"prompt": "\ud800"}, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "\ud800", "text": "x"}]}]}, "messages.0.content.0"),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "guided_regex": "a\ud800"}, "guided_regex"),
    ("/v1/responses", {"input": "Hi", "metadata": {"k": "\ud800"}}, "metadata.k"),
    ("/v1/responses", {"input": "Hi", "text": {"format": "json"}}, "text.format"),
    ("/v1/responses", {"input": "Hi", "text": {"format": ["x"]}}, "text.format"),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "tool_choice": {"a": _nested(100)}}, "tool_choice"),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c", "type": "function",
                              "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]},
                         {"role": "tool", "tool_call_id": "c", "content": "1"}]}, "arguments"),
    # a schema given as a JSON string: the body's depth limit does not see inside it
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}],
            "guided_json": '{"type": "array", "items": ' + "[" * 5000 + "]" * 5000 + "}"}, "guided_json"),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}],  # Python's re parses groups recursively
            "guided_json": {"type": "string", "pattern": "(" * 20000 + "a" + ")" * 20000}}, "guided_json"),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}],
            "structured_outputs": {"grammar": "start: " + "(" * 20000 + '"a"' + ")" * 20000}},
     "structured_outputs.grammar"),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}],  # GBNF: llguidance's converter recurses (its 400)
            "guided_grammar": "root ::= " + "(" * 900 + '"a"' + ")" * 900}, "guided_grammar"),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "string", "pattern": "(" * 2000 + ")" * 2000}}}}}]},
     "tools.0.function.parameters"),
])
def test_validation_refuses_instead_of_throwing(server_url, path, body, named):
    response = _post(server_url, path, body | {"max_tokens": 1} if path != "/v1/responses" else body)
    assert response.status_code == 400, response.text
    assert named in response.text, response.text


@pytest.mark.parametrize("path,body", [
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 1, "n": 1.0}),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 2.0, "seed": 3.0}),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1.0, "top_logprobs": 0.0}),
])
def test_integral_floats_are_integers(server_url, path, body):
    assert _post(server_url, path, body).status_code == 200


@pytest.mark.parametrize("top_k", [2**63, 10**30])
def test_a_top_k_past_int64_samples_beside_others(server_url, top_k):
    """The API bounds top_k from below only; one past int64 reached the sampling kernel and failed every request of
    its step. Now it keeps every token (off), and a request beside it is answered too."""
    import concurrent.futures

    bodies = [{"prompt": "Hi", "max_tokens": 4, "top_k": top_k, "seed": 1},
              {"prompt": "Hello", "max_tokens": 4, "temperature": 0.9, "seed": 2}]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        responses = list(pool.map(lambda body: _post(server_url, COMPLETIONS, body), bodies))
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in responses)


def test_a_fractional_n_is_still_refused(server_url):
    response = _post(server_url, COMPLETIONS, {"prompt": "Hi", "n": 1.5})
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"


def test_one_request_cannot_outgrow_the_queue(smollm2):
    from tests.serverutil import running_server

    with running_server(smollm2, ServeConfig(num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=64,
                                             max_queue=12, max_prompts_per_request=10)) as url:
        many = _post(url, COMPLETIONS, {"prompt": ["Hi"] * 11, "max_tokens": 1})
        assert many.status_code == 400 and "at most 10" in many.json()["error"]["message"]
        assert many.json()["error"]["param"] == "prompt"
        wide = _post(url, COMPLETIONS, {"prompt": ["Hi"] * 2, "n": 9, "max_tokens": 1})
        error = wide.json()["error"]
        assert wide.status_code == 400 and "18 sequences" in error["message"] and "at most 16" in error["message"]
        assert _post(url, COMPLETIONS, {"prompt": ["Hi"] * 2, "n": 8, "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("size", [70_000, 1 << 20])
def test_oversized_headers_get_431_and_normal_ones_pass(server_url, size):
    big = httpx.get(server_url + "/health", headers={"x-junk": "a" * size}, timeout=30)
    assert big.status_code == 431 and big.json()["error"]["code"] == "request_header_fields_too_large"
    assert "x-request-id" in big.headers
    assert httpx.get(server_url + "/health", headers={"x-junk": "a" * 30_000}).status_code == 200


def test_a_large_body_is_not_counted_as_headers(server_url):
    prompt = "word " * 60_000  # ~300 KB of body arrives with the headers in the first reads
    response = httpx.post(server_url + "/tokenize", json={"prompt": prompt}, timeout=60)
    assert response.status_code == 200 and response.json()["count"] > 50_000


def _threads_running(monkeypatch, name: str) -> list[str]:
    """The threads ``kvserve.server.app.<name>`` runs on, call by call (wrapped here to record them)."""
    import threading

    import kvserve.server.app as app_module

    threads: list[str] = []
    real = getattr(app_module, name)

    def recording(*args):
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(app_module, name, recording)
    return threads


def test_long_prompts_are_tokenized_off_the_event_loop(bare_state, monkeypatch):
    threads = _threads_running(monkeypatch, "completion_text_ids")
    with TestClient(create_app(bare_state), base_url="http://127.0.0.1") as client:
        short = client.post("/tokenize", json={"prompt": "Hi"})
        long = client.post("/tokenize", json={"prompt": "word " * 10_000})
    assert short.status_code == long.status_code == 200 and long.json()["count"] >= 10_000
    loop_thread, worker = threads
    assert worker != loop_thread  # the long one ran on a worker thread, the loop kept serving


def test_a_chat_of_many_short_messages_is_rendered_off_the_event_loop(bare_state, monkeypatch):
    """A template's work grows with its messages, not only their characters: 29,000 one-character messages
    (870 KB) took ~1 s to render on the loop, stalling every stream. More than 128 are rendered on a worker."""
    threads = _threads_running(monkeypatch, "chat_prompt_ids")
    turns = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    with TestClient(create_app(bare_state), base_url="http://127.0.0.1") as client:
        few = client.post("/tokenize", json={"messages": turns * 2})
        many = client.post("/tokenize", json={"messages": turns * 100})
    assert few.status_code == many.status_code == 200 and many.json()["count"] > few.json()["count"]
    loop_thread, worker = threads
    assert worker != loop_thread


def _stream_events(response: httpx.Response) -> list:
    import json

    return [line[len("data: "):] if line == "data: [DONE]" else json.loads(line[len("data: "):])
            for line in response.text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("field,value,limit", [
    ("guided_regex", r"[^\s\S]", "admits no output"),                  # an empty class
    ("guided_regex", r"a[^\s\S]b", "admits no output"),
    ("guided_regex", "a{1000000}", "limit of 10,000 repetitions"),
    ("structured_outputs", {"regex": "(ab){20000,}"}, "limit of 10,000 repetitions"),
    ("guided_grammar", 'start: "a"~50000', "limit of 10,000 repetitions"),
    ("guided_grammar", 'start: a\na: a "x"\n', "admits no output"),    # no rule that ends
    ("guided_grammar", 'start: a\na: "x" a\n', "admits no output"),
    ("guided_grammar", 'start: "ok" (b | c)\nb: "y" c\nc: [b] "x" c\n', "admits no output"),
    ("guided_json", {"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"}, "admits no output"),
    ("guided_json", {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}},
                                        "required": ["next"]}}, "$ref": "#/$defs/node"}, "admits no output"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "t", "schema": {
        "type": "array", "minItems": 1, "items": {"$ref": "#"}}}}, "admits no output"),
    ("guided_json", {"type": "string", "pattern": "[0-9]{99999}"}, "limit of 10,000 repetitions"),
    # counts under the limit, nested into a million: refused before any SSE byte, not by the lexer mid-reply
    ("response_format", {"type": "json_schema", "json_schema": {"name": "t", "schema": {
        "type": "string", "pattern": "^(a{1000}){1000}$"}}}, "into 1,000,000 repetitions"),
    ("guided_grammar", 'start: ("a"~100)~200', "into 20,000 repetitions"),
    ("guided_choice", [f"option {i}" for i in range(5000)], "limit of 1,024"),
])
def test_constraints_that_cannot_be_served_are_refused_before_queueing(server_url, field, value, limit):
    for stream in (False, True):
        response = _post(server_url, CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                                            "stream": stream, field: value})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert limit in error["message"] and error["param"].startswith(field.split(".")[0]), error


def test_a_reply_that_stops_short_of_its_grammar_is_never_labelled_stop(server_url):
    import json

    # "ok" is allowed, after it no token is (the embedded schema has no value); the checks before compiling do
    # not read a grammar with %json, and llguidance learns it only after "ok": the reply cannot satisfy it
    embedded = json.dumps({"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"})
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0,
            "guided_grammar": f'start: "ok" %json {embedded}'}
    whole = _post(server_url, CHAT, body)
    assert whole.status_code == 400, whole.text
    assert whole.json()["error"]["code"] == "constraint_unsatisfied"
    streamed = _post(server_url, CHAT, body | {"stream": True})
    events = _stream_events(streamed)
    assert streamed.status_code == 200 and events[-1] == "[DONE]"
    final, error = events[-3], events[-2]
    assert final["choices"][0]["finish_reason"] == "error"
    assert error["error"]["code"] == "constraint_unsatisfied"
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-2]) == "ok"
    completion = _post(server_url, COMPLETIONS, {"prompt": "Hi", "max_tokens": 8, "temperature": 0,
                                                  "guided_grammar": body["guided_grammar"]})
    assert completion.status_code == 400 and completion.json()["error"]["code"] == "constraint_unsatisfied"


@pytest.mark.parametrize("name", ["get_weather\n", "get weather", "x" * 65, "météo", ""])
def test_a_tool_name_outside_openais_rule_is_refused_by_field(server_url, name):
    tool = {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    response = _post(server_url, CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                                        "tools": [tool]})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tools.0.function.name"


@pytest.mark.parametrize("path,body", [
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 1}),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 1}),
])
def test_stream_null_means_the_default_everywhere_and_the_schema_says_so(server_url, path, body):
    response = _post(server_url, path, body | {"stream": None})
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    schema = httpx.get(server_url + "/openapi.json").json()
    ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    stream = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"]["stream"]
    assert {"type": "null"} in stream["anyOf"] and stream["default"] is False


_BODIES = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
           "/v1/completions": {"prompt": "Hi", "max_tokens": 1},
           "/v1/responses": {"input": "Hi", "max_output_tokens": 1},
           "/tokenize": {"prompt": "Hi"}, "/detokenize": {"tokens": [1, 2]}}


def _provocations(path: str, method: str, has_body: bool, model: str) -> list[dict]:
    """Requests that draw each answer a route can give: served, no key, a wrong Host, oversized headers, and
    for a body a form, an oversized one, broken JSON, a wrong model and a stream."""
    key = {"authorization": "Bearer k"}
    url = path.replace("{model_id}", model)
    cases = [{"url": url, "headers": key}, {"url": url, "headers": {}},
             {"url": url, "headers": key | {"host": "evil.example"}},
             {"url": url, "headers": key | {"x-junk": "a" * 70_000}}]
    if "{model_id}" in path:
        cases.append({"url": path.replace("{model_id}", "nope"), "headers": key})
    if has_body:
        body = _BODIES.get(path, {})
        json_headers = key | {"content-type": "application/json"}
        import json

        cases = [dict(c, content=json.dumps(body), headers=c["headers"] | {"content-type": "application/json"})
                 for c in cases]
        cases += [{"url": url, "headers": key | {"content-type": "text/plain"}, "content": "prompt=Hi"},
                  {"url": url, "headers": json_headers, "content": json.dumps({"prompt": "a" * 40_000})},
                  {"url": url, "headers": json_headers, "content": '{"prompt": '},
                  {"url": url, "headers": json_headers, "content": json.dumps(body | {"model": "nope"})},
                  {"url": url, "headers": json_headers, "content": json.dumps(body | {"stream": True})}]
    return [c | {"method": method.upper()} for c in cases]


def test_every_status_and_content_type_answered_is_in_the_openapi_document(smollm2):
    from tests.serverutil import running_server

    with running_server(smollm2, ServeConfig(num_kv_blocks=16, block_size=16, api_key="k",
                                             max_request_bytes=16_384)) as url:
        document = httpx.get(url + "/openapi.json").json()
        model = httpx.get(url + "/v1/models", headers={"authorization": "Bearer k"}).json()["data"][0]["id"]
        undocumented, seen = [], set()
        for path, operations in document["paths"].items():
            for method, operation in operations.items():
                for case in _provocations(path, method, "requestBody" in operation, model):
                    response = httpx.request(case["method"], url + case["url"], headers=case["headers"],
                                             content=case.get("content"), timeout=60)
                    status = str(response.status_code)
                    kind = response.headers.get("content-type", "").split(";")[0]
                    seen.add(status)
                    documented = operation["responses"].get(status, {}).get("content", {})
                    if kind not in documented:
                        undocumented.append(f"{method.upper()} {path}: {status} {kind or 'no content type'}")
    assert not undocumented, undocumented
    assert {"200", "400", "401", "404", "413", "415", "421", "431"} <= seen


@pytest.mark.parametrize("text,product", [
    ("^(a{1000}){1000}$", 1_000_000), ("((ab){10}c){10}", 100), ("a{100}b{100}", 100), ("(a|b){2,5}", 5),
    (r"[(]{5}(x){3}", 5), (r"\({100}", 100), ('("a"~100)~200', 20_000), ("[0-9]{3}-[0-9]{4}", 4),
])
def test_nested_repetition_multiplies_counts_down_groups_only(text, product):
    from kvserve.server.grammar_limits import nested_repetition

    assert nested_repetition(text) == product


_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": "f"}, {"type": "function"},
                                         {"type": "function", "function": {"name": ["f"]}},
                                         {"function": {"name": "f"}}])
def test_a_tool_choice_of_the_wrong_shape_is_a_400_naming_it(server_url, path, tool_choice):
    """It was a 500 (a string or list where server.tools read a mapping or a name)."""
    response = _post(server_url, path, {"messages": [{"role": "user", "content": "Hi"}], "tools": [_TOOL],
                                        "tool_choice": tool_choice} | ({"max_tokens": 1} if path == CHAT else {}))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tool_choice"


def test_tool_parameters_of_a_type_other_than_object_are_refused():
    """A call's arguments are a JSON object: a ``{"type": "string"}`` schema could never be honoured by
    ``required`` (the reply came back as content) and OpenAI refuses it too."""
    from kvserve.server.errors import ApiError
    from kvserve.server.tools import functions

    class Body:
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]
        tool_choice = "required"

    with pytest.raises(ApiError) as refused:
        functions(Body())
    assert refused.value.status == 400 and refused.value.param == "tools.0.function.parameters"
    assert 'type "string"' in str(refused.value)


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=latin-1"])
def test_a_body_that_is_not_utf8_gets_a_400_saying_so(server_url, content_type):
    body = b'{"messages": [{"role": "user", "content": "a\xff\xfeb"}], "max_tokens": 1}'
    response = httpx.post(server_url + CHAT, content=body, headers={"content-type": content_type}, timeout=30)
    assert response.status_code == 400, response.text
    assert "not valid UTF-8 (byte 44 is not)" in response.json()["error"]["message"]
