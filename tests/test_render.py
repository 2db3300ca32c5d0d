"""vLLM's render routes (server/render.py): the token ids a render answers are the ones the server prefills.

Checked three ways against a live server: equal to /tokenize's, as many as the generation's usage.prompt_tokens,
and, sent back as a token-id prompt, found in the prefix cache block for block (a single different token before the
last block would cut the cached run short). And the render routes answer bad input as the generation routes do.
"""

from __future__ import annotations

import httpx
import pytest

from kvserve.server.config import ServeConfig
from tests.serverutil import running_server

SYSTEM = {"role": "system", "content": "You answer in one word, always, whatever the question. " * 3}
USER = {"role": "user", "content": "Name a colour."}
BLOCK = 16  # the server's default block size: the prefix cache's unit


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def _cached_when_sent_as_ids(url: str, ids: list[int]) -> int:
    usage = _post(url, "/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0}).json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("messages", [[USER], [SYSTEM, USER]], ids=["no-system-prompt", "system-prompt"])
def test_a_chat_render_is_the_prompt_the_server_prefills(server_url, messages):
    rendered = _post(server_url, "/v1/chat/completions/render", {"messages": messages, "max_tokens": 1,
                                                                 "temperature": 0})
    assert rendered.status_code == 200
    body = rendered.json()
    ids = body["token_ids"]
    assert body["request_id"].startswith("chatcmpl-") and body["features"] is None
    assert body["sampling_params"]["max_tokens"] == 1 and body["sampling_params"]["temperature"] == 0
    assert ids == _post(server_url, "/tokenize", {"messages": messages}).json()["tokens"]
    usage = _post(server_url, "/v1/chat/completions", {"messages": messages, "max_tokens": 1,
                                                        "temperature": 0}).json()["usage"]
    assert usage["prompt_tokens"] == len(ids)
    # the chat request's blocks are in the prefix cache: the rendered ids find every full block but the last token's
    assert _cached_when_sent_as_ids(server_url, ids) >= len(ids) - BLOCK > 0


def test_a_system_prompt_changes_the_render_as_it_changes_the_prompt(server_url):
    without, with_system = (_post(server_url, "/v1/chat/completions/render", {"messages": m}).json()["token_ids"]
                            for m in ([USER], [SYSTEM, USER]))
    system_ids = _post(server_url, "/tokenize", {"prompt": SYSTEM["content"], "add_special_tokens": False}).json()
    assert len(with_system) > len(without)
    text = ",".join(map(str, with_system))
    assert ",".join(map(str, system_ids["tokens"][1:-1])) in text  # the system text, tokenized in its turn


def test_a_completions_render_has_one_request_per_prompt_with_the_prefilled_ids(server_url):
    prompts = ["The capital of France is", SYSTEM["content"] + "Once upon a time"]
    rendered = _post(server_url, "/v1/completions/render", {"prompt": prompts, "max_tokens": 2})
    assert rendered.status_code == 200
    items = rendered.json()
    assert [item["request_id"][-2:] for item in items] == ["-0", "-1"]
    assert items[0]["request_id"][:-2] == items[1]["request_id"][:-2] and items[0]["request_id"].startswith("cmpl-")
    tokenized = [_post(server_url, "/tokenize", {"prompt": p}).json()["tokens"] for p in prompts]
    assert [item["token_ids"] for item in items] == tokenized
    usage = _post(server_url, "/v1/completions", {"prompt": prompts, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == sum(len(ids) for ids in tokenized)
    long_ids = items[1]["token_ids"]
    assert _cached_when_sent_as_ids(server_url, long_ids) >= len(long_ids) - BLOCK > 0
    # one prompt: one request, its id without an index; a token-id prompt renders as itself
    single = _post(server_url, "/v1/completions/render", {"prompt": [5, 6, 7], "max_tokens": 2}).json()
    assert len(single) == 1 and single[0]["token_ids"] == [5, 6, 7] and not single[0]["request_id"].endswith("-0")


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [USER], "model": "no-such-model"}),
    ("/v1/completions", {"prompt": "Hi", "model": "no-such-model"}),
    ("/v1/chat/completions", {"messages": [USER], "max_tokens": 10**6}),
    ("/v1/completions", {"prompt": "Hi", "n": 0}),
    ("/v1/completions", {"prompt": [10**9], "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [USER], "priority": 3}),
], ids=["chat-model", "completions-model", "over-context", "n-0", "bad-token-id", "priority"])
def test_a_render_refuses_what_its_generation_route_refuses_with_the_same_answer(server_url, path, body):
    rendered, generated = _post(server_url, path + "/render", body), _post(server_url, path, body)
    assert 400 <= rendered.status_code < 500
    assert (rendered.status_code, rendered.json()) == (generated.status_code, generated.json())


def test_render_routes_need_the_api_key_and_are_in_the_openapi_document(smollm2):
    with running_server(smollm2, ServeConfig(num_kv_blocks=32, api_keys=("user",))) as url:
        body = {"prompt": "Hi", "max_tokens": 1}
        refused = _post(url, "/v1/completions/render", body)
        assert refused.status_code == 401 and refused.json()["error"]["message"]
        allowed = httpx.post(url + "/v1/completions/render", json=body, headers={"Authorization": "Bearer user"})
        assert allowed.status_code == 200 and allowed.json()[0]["token_ids"]
        paths = httpx.get(url + "/openapi.json").json()["paths"]
    for path, shape in (("/v1/chat/completions/render", "$ref"), ("/v1/completions/render", "items")):
        responses = paths[path]["post"]["responses"]
        assert shape in responses["200"]["content"]["application/json"]["schema"]
        assert {"400", "401", "404"} <= set(responses) and "422" not in responses


def test_continue_final_message_leaves_the_assistant_prefill_open_and_add_generation_prompt_false_opens_no_turn(
        server_url):
    def text(body: dict) -> str:
        ids = _post(server_url, "/v1/chat/completions/render", body).json()["token_ids"]
        return _post(server_url, "/detokenize", {"tokens": ids}).json()["prompt"]

    prefill = {"role": "assistant", "content": "The colour is"}
    opened = text({"messages": [USER]})
    closed = text({"messages": [USER], "add_generation_prompt": False})
    assert opened.startswith(closed) and len(opened) > len(closed)  # only the assistant turn's opening is added
    continued = text({"messages": [USER, prefill], "continue_final_message": True, "add_generation_prompt": False})
    assert continued.endswith("The colour is") and continued.startswith(opened)  # the open turn, then the prefill
    count = _post(server_url, "/tokenize", {"messages": [USER, prefill], "continue_final_message": True,
                                            "add_generation_prompt": False}).json()["count"]
    assert count == len(_post(server_url, "/tokenize", {"prompt": continued, "add_special_tokens": False}).json()[
        "tokens"])
    reply = _post(server_url, "/v1/chat/completions", {"messages": [USER, prefill], "continue_final_message": True,
                                                        "add_generation_prompt": False, "max_tokens": 2,
                                                        "temperature": 0})
    assert reply.status_code == 200
    both = _post(server_url, "/v1/chat/completions", {"messages": [USER, prefill], "continue_final_message": True})
    assert both.status_code == 400 and "add_generation_prompt" in both.json()["error"]["message"]
