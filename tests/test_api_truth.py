"""Refuse what would serve garbage, and tell the truth in every field, on a live server.

Strict request types, the OpenAPI document, logprobs that describe exactly the returned text, text_offset,
fields refused by name instead of ignored, the Host guard, idle connections, 401's challenge, and the
max_model_len /v1/models reports.
"""

from __future__ import annotations

import json
import selectors
import socket
import time

import httpx
import pytest

from kvserve.server.config import ServeConfig
from tests.serverutil import running_server

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def post(url: str, path: str, body: dict, **kw) -> httpx.Response:
    kw.setdefault("timeout", 120)
    return httpx.post(url + path, content=json.dumps(body).encode(),
                      headers={"content-type": "application/json"} | kw.pop("headers", {}), **kw)


def stream(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json=body | {"stream": True}, timeout=120) as response:
        assert response.status_code == 200
        lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def completion_logprobs(url: str, body: dict, streamed: bool) -> tuple[str, dict, dict | None]:
    """(text, logprobs with lists joined over chunks, usage) of a one-choice completion."""
    if not streamed:
        reply = post(url, COMPLETIONS, body).json()
        return reply["choices"][0]["text"], reply["choices"][0]["logprobs"], reply["usage"]
    chunks = stream(url, COMPLETIONS, body | {"stream_options": {"include_usage": True}})
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    logprobs = {k: [v for c in chunks if c["choices"] for v in c["choices"][0]["logprobs"][k]] for k in keys}
    return text, logprobs, chunks[-1]["usage"]


# -- 2. strict types, and an OpenAPI document that says what the server sends --------------------------------

@pytest.mark.parametrize("path,extra,param", [
    (COMPLETIONS, {"prompt": [True, False]}, "prompt"),
    (COMPLETIONS, {"prompt": [[1, True]]}, "prompt"),
    (COMPLETIONS, {"max_tokens": True}, "max_tokens"),
    (COMPLETIONS, {"n": "2"}, "n"),
    (COMPLETIONS, {"logprobs": True}, "logprobs"),
    (COMPLETIONS, {"temperature": "0"}, "temperature"),
    (COMPLETIONS, {"echo": 1}, "echo"),
    (CHAT, {"max_tokens": 2.5}, "max_tokens"),  # 2.0 is an integer (JSON Schema), 2.5 is not
    (CHAT, {"logprobs": 1}, "logprobs"),
    (CHAT, {"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    (CHAT, {"stop_token_ids": [False]}, "stop_token_ids.0"),
])
def test_types_are_strict_as_openai(server_url, path, extra, param):
    base = {"prompt": "Hi", "max_tokens": 2} if path == COMPLETIONS else {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    response = post(server_url, path, base | extra)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_detokenize_refuses_booleans_as_token_ids(server_url):
    response = post(server_url, "/detokenize", {"tokens": [True, 1]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tokens.0"


def test_integers_are_still_numbers(server_url):
    body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0, "top_p": 1, "presence_penalty": 0}
    assert post(server_url, COMPLETIONS, body).status_code == 200


def test_openapi_documents_the_400_the_server_sends(server_url):
    doc = httpx.get(server_url + "/openapi.json").json()
    assert '"422"' not in json.dumps(doc["paths"]) and "HTTPValidationError" not in json.dumps(doc)
    for path in (CHAT, COMPLETIONS, "/tokenize", "/detokenize"):
        answer = doc["paths"][path]["post"]["responses"]["400"]
        assert answer["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "401" in doc["paths"][CHAT]["post"]["responses"] and "429" in doc["paths"][CHAT]["post"]["responses"]
    schemas = doc["components"]["schemas"]
    detail = schemas[schemas["ErrorResponse"]["properties"]["error"]["$ref"].rsplit("/", 1)[1]]
    sent = post(server_url, COMPLETIONS, {"prompt": "Hi", "n": "2"})
    assert sent.status_code == 400
    assert set(sent.json()) == set(schemas["ErrorResponse"]["required"])
    assert set(detail["required"]) <= set(sent.json()["error"]) <= set(detail["properties"])


def test_openapi_documents_a_message_content_and_a_text_part_as_required(server_url):
    """A responses message's content and a text part's text are refused missing or null (by validators that name
    them), so the document says they are required and not null; a chat message's content takes null (on an
    assistant's tool calls)."""
    schemas = httpx.get(server_url + "/openapi.json").json()["components"]["schemas"]
    for name, field in (("InputMessage", "content"), ("InputPart", "text"), ("ContentPart", "text")):
        assert field in schemas[name]["required"], name
        prop = schemas[name]["properties"][field]
        assert "default" not in prop and {"type": "null"} not in prop.get("anyOf", [prop]), name
    assert {"type": "null"} in schemas["ChatMessage"]["properties"]["content"]["anyOf"]
    for body, param in (({"input": [{"role": "user", "content": None}]}, "input.0.content"),
                        ({"input": [{"role": "user"}]}, "input.0.content"),
                        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input.0.content")):
        sent = post(server_url, "/v1/responses", body)
        assert sent.status_code == 400 and sent.json()["error"]["param"] == param, sent.text


# -- 3. logprobs describe exactly the returned text ----------------------------------------------------------

def _free_run(url: str, prompt: str) -> tuple[str, list[str]]:
    text, logprobs, _ = completion_logprobs(url, {"prompt": prompt, "max_tokens": 16, "temperature": 0,
                                                  "logprobs": 2, "ignore_eos": True}, streamed=False)
    assert "".join(logprobs["tokens"]) == text  # the prompt is chosen so that its reply is plain ASCII
    return text, logprobs["tokens"]


@pytest.mark.parametrize("streamed", [False, True])
def test_a_withheld_stop_string_has_no_logprobs(server_url, streamed):
    prompt = "The capital of France is"
    free, tokens = _free_run(server_url, prompt)
    # the first token after the first few whose text is new: a stop string on a token boundary (" Paris.\n\n|The")
    k = next(i for i in range(3, len(tokens)) if tokens[i] not in "".join(tokens[:i]) and tokens[i].strip())
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 2, "ignore_eos": True,
            "stop": [tokens[k]]}
    text, logprobs, usage = completion_logprobs(server_url, body, streamed)
    assert text == "".join(tokens[:k]) == free[:free.index(tokens[k])]
    assert logprobs["tokens"] == tokens[:k]  # the stop string's token is gone, with its alternatives
    assert len(logprobs["top_logprobs"]) == len(logprobs["token_logprobs"]) == len(logprobs["text_offset"]) == k
    assert usage["completion_tokens"] == k + 1  # the withheld token was generated: it counts (docs/api.md)


@pytest.mark.parametrize("streamed", [False, True])
def test_text_held_back_for_a_stop_that_never_matches_keeps_its_logprobs(server_url, streamed):
    prompt = "The capital of France is"
    free, tokens = _free_run(server_url, prompt)
    # a stop beginning with a whole token's text holds that token back until the stop cannot match
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 2, "ignore_eos": True,
            "stop": [tokens[4] + "\u2603"]}
    text, logprobs, _ = completion_logprobs(server_url, body, streamed)
    assert text == free and logprobs["tokens"] == tokens
    assert logprobs["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]


def test_chat_logprobs_stop_with_the_text(server_url):
    body = {"messages": [{"role": "user", "content": "List four fruits, separated by commas."}], "max_tokens": 24,
            "temperature": 0, "logprobs": True, "top_logprobs": 1}
    free = post(server_url, CHAT, body).json()["choices"][0]
    tokens = [t["token"] for t in free["logprobs"]["content"]]
    k = next(i for i in range(2, len(tokens)) if tokens[i] not in "".join(tokens[:i]) and tokens[i].strip())
    stopped = post(server_url, CHAT, body | {"stop": [tokens[k]]}).json()["choices"][0]
    assert stopped["message"]["content"] == "".join(tokens[:k])
    assert [t["token"] for t in stopped["logprobs"]["content"]] == tokens[:k]


# -- 4. text_offset: a token that adds no character adds no offset -------------------------------------------

def test_text_offset_of_a_reply_that_ends_a_prompts_character(server_url):
    # the prompt ends inside an emoji: the reply's first tokens are its last bytes, which add no character
    body = {"prompt": [19556, 905, 216, 10813], "max_tokens": 8, "temperature": 0, "logprobs": 1}
    for streamed in (False, True):
        text, logprobs, _ = completion_logprobs(server_url, body, streamed)
        tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
        assert tokens[0].startswith("bytes:")  # the case this test is about
        assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] <= len(text)
        for token, offset in zip(tokens, offsets):
            if not token.startswith("bytes:"):
                assert text[offset:offset + len(token)] == token, (tokens, offsets, text)
        echoed = post(server_url, COMPLETIONS, body | {"echo": True}).json()["choices"][0]
        prompt_len = len(echoed["text"]) - len(text)
        assert echoed["logprobs"]["text_offset"][4:] == [prompt_len + o for o in offsets]


BYTE_TOKENS = {10813: b"\xf0\x9f", 242: b"\x98", 218: b"\x80"}  # SmolLM2's: parts of characters, or invalid


def test_text_offset_after_an_invalid_byte_is_where_the_next_character_starts(server_url):
    # tokens released together (an invalid byte, then the bytes of an emoji): each starts where its character
    # does, the U+FFFD of the invalid byte counted, as the echoed prompt of the same ids counts them
    named = {"bytes:" + "".join(f"\\x{b:02x}" for b in raw): token for token, raw in BYTE_TOKENS.items()}
    body = {"prompt": "Hi", "max_tokens": 8, "temperature": 1.0, "logprobs": 0,
            "logit_bias": {str(token): 30 for token in BYTE_TOKENS}}
    spread = False
    for seed in (1, 2, 3):
        for streamed in (False, True):
            text, logprobs, _ = completion_logprobs(server_url, body | {"seed": seed}, streamed)
            ids = [named[token] for token in logprobs["tokens"]]
            echoed = post(server_url, COMPLETIONS, {"prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 1})
            assert logprobs["text_offset"] == echoed.json()["choices"][0]["logprobs"]["text_offset"][:len(ids)], (
                ids, text)
            assert all(offset <= len(text) for offset in logprobs["text_offset"])
            spread |= len(set(logprobs["text_offset"])) > 1 and "\ufffd" in text
    assert spread  # the case this test is about: text after an invalid byte


def test_text_offset_of_a_token_after_an_abandoned_character_is_after_its_u_fffd(server_url):
    # "Hi"-like text, then ",", the first bytes of an emoji that the next "," abandons (one U+FFFD), and so on:
    # each "," starts after the U+FFFD before it (the echoed prompt's offsets and a reply's come from the same
    # detokenizer: IncrementalDetokenizer.starts)
    ids = [26843, 28, 10813, 28, 10813, 28, 10813]
    echoed = post(server_url, COMPLETIONS, {"prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 1}).json()
    choice = echoed["choices"][0]
    text, tokens = choice["text"], choice["logprobs"]["tokens"][:len(ids)]
    offsets = choice["logprobs"]["text_offset"][:len(ids)]
    head = len(tokens[0])
    assert offsets == [0, head, head + 1, head + 2, head + 3, head + 4, head + 5], (tokens, offsets, text)
    for token, offset in zip(tokens, offsets):
        if not token.startswith("bytes:"):
            assert text[offset:offset + len(token)] == token, (tokens, offsets, text)


def test_a_sentencepiece_tokens_bytes_are_its_byte_or_its_piece_with_spaces():
    # Llama 2 / Mistral spell a byte "<0xF0>" and a word boundary "\u2581"; byte-level BPE's mapping reads
    # neither (their logprobs' bytes were "<0xF0>" and a word without its space)
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from kvserve.server.detok import token_bytes

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    vocab |= {"\u2581Hello": 259, "world": 260, "\u2581": 261}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>")
    assert [token_bytes(tokenizer, t) for t in (3 + 0xF0, 259, 260, 261)] == [b"\xf0", b" Hello", b"world", b" "]
    assert token_bytes(tokenizer, 2) == b"</s>"
    # its decoder makes one U+FFFD of each byte that forms no character: offsets count them as its text does
    from kvserve.server.detok import text_offsets

    ids = [3 + 0xF0, 3 + 0x9F, 259, 3 + 0xF0, 3 + 0x9F, 3 + 0x98, 3 + 0x80, 260]
    assert tokenizer.decode(ids) == "\ufffd\ufffd Hello\U0001f600world"
    assert text_offsets(tokenizer, ids) == [0, 1, 2, 8, 8, 8, 8, 9]


# -- 5. nothing silently ignored or emptied ------------------------------------------------------------------

@pytest.mark.parametrize("extra,named", [
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"response_format": {}}, "response_format"),
    ({"response_format": {"type": "text", "json_schema": {"name": "t", "schema": {}}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {}}, "extra": 1}},
     "response_format.extra"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schemas": {}}}},
     "response_format.json_schema.schemas"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace"),
    # null content is an assistant's with tool_calls only (those are served: tests/test_structured.py)
    ({"messages": [{"role": "user", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": []}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"text": "Hi"}]}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content"),
])
def test_input_that_would_be_ignored_or_emptied_is_a_400_naming_it(server_url, extra, named):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2} | extra
    response = post(server_url, CHAT, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == named and named.split(".")[-1] in error["message"]
    if named.startswith("function"):
        assert "tools" in error["message"]


@pytest.mark.parametrize("extra", [
    {"structured_outputs": {"regex": "[ab]", "whitespace_pattern": None, "disable_fallback": False,
                            "disable_any_whitespace": False, "json": None, "json_object": None}},
    {"structured_outputs": {"json_object": True}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "object"},
                                                                 "description": None, "strict": None}}},
    {"response_format": {"type": "text", "json_schema": None}},
])
def test_options_at_their_defaults_are_served(server_url, extra):
    """A client that dumps vLLM's or OpenAI's settings objects whole sends their unset options as null or false:
    they ask for nothing, so they are served (an option set to something else is a 400 naming it, above)."""
    response = post(server_url, CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                                       "temperature": 0} | extra)
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["message"]["content"]
    if extra.get("structured_outputs", {}).get("json_object") is True:
        assert text.startswith("{")
    if extra.get("structured_outputs", {}).get("regex"):
        assert text in ("a", "b")


@pytest.mark.parametrize("path", [CHAT, "/v1/responses"])
def test_openai_fields_for_what_is_not_served_are_taken_unset_and_refused_set(server_url, path):
    """OpenAI's fields for audio, predicted outputs, web search, reasoning effort and verbosity, as SDK wrappers
    send them unset (null; modalities ["text"]), ask for nothing: served. Set, each is a 400 naming it; so is a
    service tier OpenAI does not have (its own tiers are served as kvserve's one)."""
    base = ({"input": "Hi", "max_output_tokens": 2} if path != CHAT else
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    unset = {"service_tier": "flex"} | ({"audio": None, "prediction": None, "web_search_options": None,
                                         "reasoning_effort": None, "verbosity": None, "modalities": ["text"]}
                                        if path == CHAT else {})
    assert post(server_url, path, base | unset).status_code == 200
    refused = [("service_tier", "bogus")]
    if path == CHAT:
        refused += [("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
                    ("prediction", {"type": "content", "content": "x"}), ("reasoning_effort", "low"),
                    ("web_search_options", {}), ("verbosity", "low")]
    for field, value in refused:
        response = post(server_url, path, base | {field: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == field, (field, response.text)
    if path == CHAT:  # the document says which value each is taken at (it forbids properties it does not list)
        schema = httpx.get(server_url + "/openapi.json").json()["components"]["schemas"]["ChatCompletionRequest"]
        assert schema["additionalProperties"] is False
        assert schema["properties"]["audio"] == {"type": "null"}
        assert schema["properties"]["modalities"] == {"anyOf": [{"const": ["text"]}, {"type": "null"}]}
        assert schema["properties"]["skip_special_tokens"] == {"anyOf": [{"const": True}, {"type": "null"}]}


def test_the_model_card_was_created_when_the_server_started(server_url):
    card = httpx.get(server_url + "/v1/models").json()["data"][0]
    assert time.time() - 86_400 < card["created"] <= time.time()


def test_several_served_names_are_each_listed_and_accepted_and_responses_carry_the_first(smollm2):
    # vLLM's --served-model-name A B: every name in /v1/models and accepted as `model`; the first in responses
    with running_server(smollm2, ServeConfig(num_kv_blocks=32, served_model_name=("smol", "gpt-4o-mini"))) as url:
        assert [card["id"] for card in httpx.get(url + "/v1/models").json()["data"]] == ["smol", "gpt-4o-mini"]
        assert httpx.get(url + "/v1/models/gpt-4o-mini").json()["id"] == "gpt-4o-mini"
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        for name in ("smol", "gpt-4o-mini", "default"):
            response = post(url, CHAT, body | {"model": name})
            assert response.status_code == 200 and response.json()["model"] == "smol", response.text
        refused = post(url, CHAT, body | {"model": "other"})
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
        assert "'smol' or 'gpt-4o-mini'" in refused.json()["error"]["message"]
        long = post(url, CHAT, body | {"model": "x" * 100_000}).json()["error"]["message"]
        assert long.startswith("model '" + "x" * 80 + "'...") and len(long) < 200  # not echoed whole


def test_what_openai_accepts_is_still_served(server_url):
    for message in ({"role": "user", "content": ""}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}):
        body = {"messages": [message], "max_tokens": 2, "functions": None, "response_format": {"type": "text"}}
        assert post(server_url, CHAT, body).status_code == 200


# -- 6 and 7: Host guard, 401 challenge, idle connections, max_model_len -------------------------------------

def test_host_policy_names():
    from kvserve.server.hostguard import HostPolicy

    loopback = HostPolicy.for_server("127.0.0.1", None)
    assert all(loopback.allows(h) for h in ("localhost", "localhost:8000", "127.0.0.1:1", "127.1.2.3", "[::1]:80",
                                            "LOCALHOST", "[0:0:0:0:0:0:0:1]", None))
    assert not any(loopback.allows(h) for h in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example",
                                                "localhost.evil.example", "[::2]:80", "", "localhost.",
                                                "127.0.0.1:8000@evil.example", "evil.example@127.0.0.1",
                                                "127.0.0.1:8000 evil", "127.0.0.1:99999", "localhost:80:80",
                                                "[::1", "::1"))
    assert HostPolicy.for_server("0.0.0.0", None).allows("anything.example")
    listed = HostPolicy.for_server("0.0.0.0", ("api.example", "*.corp.example"))
    assert listed.allows("api.example:443") and listed.allows("a.corp.example") and listed.allows("localhost")
    assert not listed.allows("corp.example.evil") and not listed.allows("other.example")
    assert HostPolicy.for_server("127.0.0.1", ("*",)).allows("evil.example")


def test_a_loopback_server_answers_only_loopback_host_names(server_url):
    port = server_url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.nip.io:{port}"):
        for path in ("/health", "/v1/models"):
            response = httpx.get(server_url + path, headers={"host": host})
            assert response.status_code == 421, (host, path)
            assert response.json()["error"]["code"] == "host_not_allowed"
    for host in (f"localhost:{port}", f"[::1]:{port}", "127.0.0.1"):
        assert httpx.get(server_url + "/health", headers={"host": host}).status_code == 200


@pytest.fixture(scope="module")
def guarded_url(smollm2):
    """A server with an API key, one extra allowed host, a 1 s header deadline and a 4-block (64-token) pool."""
    config = ServeConfig(num_kv_blocks=4, block_size=16, api_key="sekrit", allowed_hosts=("kvserve.example",),
                         header_timeout_s=1.0)
    with running_server(smollm2, config) as url:
        yield url


AUTH = {"authorization": "Bearer sekrit"}


def test_allowed_hosts_widen_the_guard_and_a_401_names_its_scheme(guarded_url):
    assert httpx.get(guarded_url + "/v1/models", headers=AUTH | {"host": "kvserve.example"}).status_code == 200
    assert httpx.get(guarded_url + "/v1/models", headers=AUTH | {"host": "evil.example"}).status_code == 421
    refused = httpx.get(guarded_url + "/v1/models")
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"


def test_max_model_len_is_what_one_request_may_use(guarded_url):
    reported = httpx.get(guarded_url + "/v1/models", headers=AUTH).json()["data"][0]["max_model_len"]
    assert reported == 64  # 4 blocks of 16 tokens, not SmolLM2's 8192
    body = {"prompt": [42] * 60, "max_tokens": reported - 60, "temperature": 0}
    assert post(guarded_url, COMPLETIONS, body, headers=AUTH).status_code == 200
    refused = post(guarded_url, COMPLETIONS, body | {"max_tokens": reported - 59}, headers=AUTH)
    assert refused.status_code == 400 and str(reported) in refused.json()["error"]["message"]


def test_idle_and_half_header_connections_are_closed_and_never_block_a_request(guarded_url):
    host, port = guarded_url.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(500)]
    for sock in idle[::2]:  # half of them send half a request (slowloris), the rest nothing
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl")
    try:
        started = time.monotonic()
        response = post(guarded_url, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2}, headers=AUTH, timeout=30)
        assert response.status_code == 200 and time.monotonic() - started < 30
        # the 1 s header deadline closes every one of them: wait at most 10 s in all
        selector = selectors.DefaultSelector()  # epoll: socket numbers may pass select()'s 1024
        for sock in idle:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
        open_count, deadline = len(idle), time.monotonic() + 10
        while open_count and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.5):
                try:
                    ended = key.fileobj.recv(1) == b""
                except ConnectionResetError:
                    ended = True
                if ended:
                    selector.unregister(key.fileobj)
                    open_count -= 1
        selector.close()
        assert open_count == 0
    finally:
        for sock in idle:
            sock.close()


def test_an_assistant_turn_with_tool_calls_renders_its_calls_not_an_empty_turn():
    """An assistant turn that carries only tool_calls (once refused, now served): the call reaches the template as
    text, with its arguments."""
    from kvserve.server import tools
    from kvserve.server.schemas import ChatCompletionRequest

    body = ChatCompletionRequest(messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "18 C", "tool_call_id": "c1"}])
    turns, _ = tools.template_inputs(body.messages, None, "{{ messages }}")  # a template without `tools`
    assert turns[1]["role"] == "assistant"
    assert "get_weather" in turns[1]["content"] and '"city": "Paris"' in turns[1]["content"]
    assert turns[2] == {"role": "tool", "content": "18 C", "tool_call_id": "c1"}
