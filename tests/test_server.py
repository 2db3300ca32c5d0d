"""The live server on 127.0.0.1 with a real HTTP client: SSE shape, text integrity, stops, usage, errors.

Each kind from ../shared/cases/api_cases.json is a test here, with our own prompts as well.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def sse_events(url: str, path: str, body: dict) -> tuple[httpx.Response, list[str]]:
    """POST a streaming request; return the response and the raw data payloads, checking the SSE framing."""
    with httpx.stream("POST", url + path, json=body, timeout=120) as response:
        raw = response.read().decode() if response.status_code != 200 else "".join(response.iter_text())
    if response.status_code != 200:
        return response, []
    payloads = []
    for block in raw.replace("\r\n", "\n").split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        assert len(lines) == 1 and lines[0].startswith("data: "), block
        payloads.append(lines[0][len("data: "):])
    return response, payloads


def stream_chunks(url: str, path: str, body: dict) -> list[dict]:
    response, payloads = sse_events(url, path, body | {"stream": True})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def joined(chunks: list[dict], chat: bool) -> str:
    key = (lambda c: c["delta"].get("content") or "") if chat else (lambda c: c["text"])
    return "".join(key(c) for chunk in chunks for c in chunk["choices"])


def text_of(response: dict, chat: bool) -> str:
    choice = response["choices"][0]
    return choice["message"]["content"] if chat else choice["text"]


def post(url: str, path: str, body: dict) -> httpx.Response:
    """POST JSON as a careless client may: lone surrogates escaped, NaN allowed (httpx's json= refuses both)."""
    return httpx.post(url + path, content=json.dumps(body).encode(), timeout=120,
                      headers={"content-type": "application/json"})


def chat_body(content: str, **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], "temperature": 0} | kw


def test_capital_of_france_streams_paris(server_url):
    chunks = stream_chunks(server_url, CHAT, chat_body("What is the capital of France?", max_tokens=32))
    assert "Paris" in joined(chunks, chat=True)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


def test_sse_shape_ids_and_finish_reason(server_url):
    chunks = stream_chunks(server_url, CHAT, chat_body("Tell a long story.", max_tokens=24))
    assert len({c["id"] for c in chunks}) == 1
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[:-1] == [None] * (len(reasons) - 1)
    assert reasons[-1] == "length"
    timings = chunks[-1]["timings"]
    assert timings["completion_tokens"] == 24 and timings["ttft_ms"] > 0 and timings["decode_tokens_per_s"] > 0


def test_finish_reason_stop_on_eos(server_url):
    chunks = stream_chunks(server_url, CHAT, chat_body("Say hello"))
    finals = [c for c in chunks if c["choices"][0]["finish_reason"] is not None]
    assert len(finals) == 1 and finals[0] is chunks[-1]
    assert finals[0]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("content", [
    "Reply with only three emoji that express joy.",
    "Write two sentences about the sea.",
    "Translate 'good morning, my friend' into Chinese and Japanese.",
    "Write a haiku about autumn leaves, then three flag emoji.",
])
def test_streamed_text_equals_non_streamed(server_url, content):
    body = chat_body(content, max_tokens=48)
    streamed = joined(stream_chunks(server_url, CHAT, body), chat=True)
    whole = text_of(post(server_url, CHAT, body).json(), chat=True)
    assert streamed == whole
    assert "\ufffd" not in streamed
    assert " " in streamed  # word spaces survive


def test_stop_string_is_never_streamed(server_url):
    body = {"prompt": "Here is the English alphabet: ABC", "max_tokens": 20, "temperature": 0}
    free = text_of(post(server_url, COMPLETIONS, body).json(), chat=False)
    stop = "DEFGHIJ" if "DEFGHIJ" in free else free[3:9]
    assert stop and stop in free
    stopped = body | {"stop": [stop]}
    chunks = stream_chunks(server_url, COMPLETIONS, stopped)
    streamed = joined(chunks, chat=False)
    assert streamed == free[:free.index(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    whole = post(server_url, COMPLETIONS, stopped).json()
    assert text_of(whole, chat=False) == streamed and whole["choices"][0]["finish_reason"] == "stop"


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(server_url):
    chunks = stream_chunks(server_url, CHAT, chat_body("Hi", max_tokens=5, temperature=0)
                           | {"stream_options": {"continuous_usage_stats": True}})
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and 1 <= counts[-1] <= 5 and counts[0] < counts[-1]
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in chunks)


@pytest.mark.parametrize("body, param", [({"stream_options": {"include_usage": True}}, "stream_options"),
                                         ({"stream": True, "stream_options": {"bogus": 1}}, "stream_options.bogus"),
                                         ({"stream": True, "stream_options": {"include_obfuscation": True}},
                                          "stream_options.include_obfuscation")])
def test_stream_options_that_would_be_ignored_are_a_400_naming_them(server_url, body, param):
    response = post(server_url, CHAT, chat_body("Hi", max_tokens=2) | body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("options, expect_usage", [({"include_usage": True}, True), ({}, False), (None, False)])
def test_usage_chunk(server_url, options, expect_usage):
    body = chat_body("Hi", max_tokens=5) | ({"stream_options": options} if options is not None else {})
    chunks = stream_chunks(server_url, CHAT, body)
    with_usage = [c for c in chunks if c.get("usage")]
    if not expect_usage:
        assert with_usage == []
        return
    assert with_usage == [chunks[-1]] and chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    assert 1 <= usage["completion_tokens"] <= 5
    assert usage["prompt_tokens"] + usage["completion_tokens"] == usage["total_tokens"]


def test_non_streamed_carries_usage_and_timings(server_url):
    body = post(server_url, COMPLETIONS, {"prompt": "The sky is", "max_tokens": 6, "temperature": 0,
                                          "ignore_eos": True}).json()
    assert body["usage"]["completion_tokens"] == 6
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 6
    assert body["timings"]["completion_tokens"] == 6


def test_prompt_as_token_ids_equals_text_prompt(server_url):
    ids = httpx.post(server_url + "/tokenize", json={"prompt": "The sky is"}).json()["tokens"]
    by_ids = post(server_url, COMPLETIONS, {"prompt": ids, "max_tokens": 8, "temperature": 0}).json()
    by_text = post(server_url, COMPLETIONS, {"prompt": "The sky is", "max_tokens": 8, "temperature": 0}).json()
    assert text_of(by_ids, False) == text_of(by_text, False)
    assert httpx.post(server_url + "/detokenize", json={"tokens": ids}).json()["prompt"] == "The sky is"


def test_min_tokens_and_ignore_eos_give_exact_lengths(server_url):
    for n in (1, 7, 19):
        body = post(server_url, CHAT, chat_body("Say hi", max_tokens=n, min_tokens=n, ignore_eos=True)).json()
        assert body["usage"]["completion_tokens"] == n



@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_begun_within_min_tokens_stops_where_it_ends_past_them(server_url, stream):
    """vLLM's min_tokens: a stop string that begins in the first min_tokens tokens' text and ends past it cuts
    the text where it begins; one wholly within them does not stop. Six stops, as lm-eval sends, are served."""
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "logprobs": 0}
    free = post(server_url, COMPLETIONS, body).json()["choices"][0]
    first, second = free["logprobs"]["tokens"][:2]
    assert len(first) >= 2 and second and free["text"].startswith(first + second)
    spanning, within = first[-1] + second[0], first[-2:]
    assert free["text"].index(spanning) == len(first) - 1 and free["text"].index(within) == len(first) - 2
    stops = [spanning, within, "\nclass", "\ndef", "\n#", "<|im_end|>"]
    sent = post(server_url, COMPLETIONS, body | {"stop": stops, "min_tokens": 1, "stream": stream, "logprobs": None})
    if stream:
        events = [json.loads(line[6:]) for line in sent.text.splitlines() if line.startswith("data: {")]
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]
    else:
        text, finish = sent.json()["choices"][0]["text"], sent.json()["choices"][0]["finish_reason"]
    assert (text, finish) == (first[:-1], "stop")


def test_same_seed_same_sample_and_n_choices(server_url):
    body = chat_body("Name a colour.", temperature=1.0, seed=1234, max_tokens=12, n=2)
    first, second = post(server_url, CHAT, body).json(), post(server_url, CHAT, body).json()
    texts = [c["message"]["content"] for c in first["choices"]]
    assert texts == [c["message"]["content"] for c in second["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1]


def test_logprobs_chat_and_completion_echo(server_url):
    chat = post(server_url, CHAT, chat_body("Hi", max_tokens=4, logprobs=True, top_logprobs=2)).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"]
    assert all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in content)
    assert content[0]["top_logprobs"][0]["logprob"] >= content[0]["logprob"] - 1e-6  # greedy picks the top
    echo = post(server_url, COMPLETIONS, {"prompt": "The cat sat on the", "max_tokens": 1, "temperature": 0,
                                          "echo": True, "logprobs": 1}).json()
    lp = echo["choices"][0]["logprobs"]
    prompt_len = echo["usage"]["prompt_tokens"]
    assert echo["choices"][0]["text"].startswith("The cat sat on the")
    assert len(lp["tokens"]) == prompt_len + 1
    assert lp["token_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_is_the_prompt_alone(server_url, stream):
    """vLLM's and the legacy API's echo without generation (scoring harnesses): the prompt and its logprobs, as
    the same request with one token has them, and no token; "length"; usage counts no completion token."""
    prompts = ["Paris is in France.", "Tokyo is a city in"]
    body = {"prompt": prompts, "echo": True, "logprobs": 2, "temperature": 0}
    one = post(server_url, COMPLETIONS, body | {"max_tokens": 1}).json()
    sent = post(server_url, COMPLETIONS, body | {"max_tokens": 0, "stream": stream, "n": 2} |
                ({"stream_options": {"include_usage": True}} if stream else {}))
    assert sent.status_code == 200, sent.text
    if stream:
        events = [json.loads(line[6:]) for line in sent.text.splitlines() if line.startswith("data: {")]
        usage = events[-1]["usage"]
        choices = {}
        for event in events:
            for c in event["choices"]:
                got = choices.setdefault(c["index"], {"text": "", "logprobs": None, "finish_reason": None})
                got["text"] += c["text"]
                got["logprobs"] = got["logprobs"] or c["logprobs"]
                got["finish_reason"] = c["finish_reason"] or got["finish_reason"]
        choices = [choices[i] for i in sorted(choices)]
    else:
        choices, usage = sent.json()["choices"], sent.json()["usage"]
    assert len(choices) == 4 and usage["completion_tokens"] == 0
    assert usage["prompt_tokens"] == one["usage"]["prompt_tokens"]
    for index, choice in enumerate(choices):
        alike = one["choices"][index // 2]
        prompt_tokens = len(alike["logprobs"]["tokens"]) - 1
        assert choice["finish_reason"] == "length"
        assert choice["text"] == alike["text"][:alike["logprobs"]["text_offset"][-1]]
        assert choice["logprobs"]["tokens"] == alike["logprobs"]["tokens"][:prompt_tokens]
        assert choice["logprobs"]["token_logprobs"] == alike["logprobs"]["token_logprobs"][:prompt_tokens]
    refused = post(server_url, COMPLETIONS, {"prompt": "Hi", "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"

    def asked() -> tuple[float, float]:  # the max_tokens histogram's count and sum
        lines = httpx.get(server_url + "/metrics").text.splitlines()
        return tuple(float(next(line for line in lines if line.startswith(f"kvserve:request_params_max_tokens_{k}"))
                           .rsplit(" ", 1)[1]) for k in ("count", "sum"))

    before = asked()
    post(server_url, COMPLETIONS, {"prompt": "Hi", "max_tokens": 0, "echo": True})
    assert asked() == (before[0] + 1, before[1])  # it asked for none (its request computes one)


@pytest.mark.parametrize("path, body, param", [
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "temperature": 5}, "temperature"),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "top_p": 0}, "top_p"),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "n": 0}, "n"),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "stop": ["s%d" % i for i in range(65)]}, "stop"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "Hi"}]}, "messages"),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {"prompt": [10**9]}, "prompt"),
    (COMPLETIONS, {}, "prompt"),
    (COMPLETIONS, {"prompt": "Hi", "stop_token_ids": [10**9], "min_tokens": 2}, "stop_token_ids"),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages.0.content"),
    (COMPLETIONS, {"prompt": "hi \ud800"}, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "temperature": float("nan")}, "temperature"),
    (COMPLETIONS, {"prompt": None}, "prompt"),
    # 1e400 reads as infinity: a tool schema holding it could not be written back for the grammar
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "number", "maximum": float("inf")}}}]}, "tools.0.function.parameters"),
    (COMPLETIONS, {"prompt": "Hi", "logit_bias": {"1000000000000": 5}}, "logit_bias"),
])
def test_bad_input_is_a_400_naming_the_field(server_url, path, body, param):
    for stream in (False, True):
        response = post(server_url, path, body | {"stream": stream})
        assert response.status_code == 400, response.text
        assert response.headers["content-type"].startswith("application/json")
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"].startswith(param)


def test_malformed_json_and_unknown_fields(server_url):
    response = httpx.post(server_url + CHAT, content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] is None and "not valid JSON" in response.json()["error"]["message"]
    for path, body, unknown in ((CHAT, chat_body("Hi", max_tokens=2, some_future_field={"x": 1}), "some_future_field"),
                                (COMPLETIONS, {"prompt": "Hi", "max_tokens": 2, "include_stop_str_in_output": True},
                                 "include_stop_str_in_output"),
                                (CHAT, chat_body("Hi", max_tokens=2, prompt="Hi"), "prompt")):
        refused = post(server_url, path, body)  # never silently ignored: OpenAI's "unrecognized request argument"
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == unknown and "unrecognized request argument" in error["message"]
    for name, value in (("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto")):
        refused = post(server_url, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2, name: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == name  # chat's fields, named
    harmless = chat_body("Hi", max_tokens=2, metadata={"team": "a"}, service_tier="auto", prompt_cache_key="k")
    assert post(server_url, CHAT, harmless).status_code == 200  # OpenAI's fields that change no reply
    routed = chat_body("Hi", max_tokens=2, no_stop_trim=False, skip_special_tokens=True, separate_reasoning=True,
                       stream_reasoning=True, include_reasoning=True, return_hidden_states=False)
    assert post(server_url, CHAT, routed).status_code == 200  # what vllm-router writes into every request
    changed = post(server_url, CHAT, chat_body("Hi", max_tokens=2, skip_special_tokens=False))
    assert changed.status_code == 400 and changed.json()["error"]["param"] == "skip_special_tokens"
    stored = post(server_url, CHAT, chat_body("Hi", max_tokens=2, store=True))
    assert stored.status_code == 400 and "store" in stored.json()["error"]["message"]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, "/tokenize"])
def test_a_body_that_is_not_sent_as_json_is_415_naming_the_content_type(server_url, path):
    body = json.dumps({"prompt": "Hi"} if path == "/tokenize" else {"prompt": "Hi", "max_tokens": 2}
                      if path == COMPLETIONS else chat_body("Hi", max_tokens=2)).encode()
    for content_type in ("application/x-www-form-urlencoded", "text/plain"):  # curl -d without -H; a form post
        response = httpx.post(server_url + path, content=body, headers={"content-type": content_type})
        assert response.status_code == 415, response.text
        error = response.json()["error"]
        assert content_type in error["message"] and "application/json" in error["message"]
    response = httpx.post(server_url + path, content=body)  # raw content: httpx sends no Content-Type
    assert "content-type" not in response.request.headers
    assert response.status_code == 415 and "no Content-Type" in response.json()["error"]["message"]
    for content_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
        response = httpx.post(server_url + path, content=body, headers={"content-type": content_type})
        assert response.status_code == 200, response.text


def test_unknown_model_is_404(server_url):
    response = post(server_url, CHAT, chat_body("Hi", model="gpt-17"))
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"


def test_over_long_prompt_is_400_with_counts(server_url):
    limit = httpx.get(server_url + "/v1/models").json()["data"][0]["max_model_len"]
    response = post(server_url, COMPLETIONS, {"prompt": [42] * (limit + 1), "max_tokens": 16})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert str(limit) in message and str(limit + 1) in message


def test_validation_happens_before_any_sse_byte(server_url):
    limit = httpx.get(server_url + "/v1/models").json()["data"][0]["max_model_len"]
    body = chat_body("Hi", max_tokens=limit + 1)
    streamed, plain = post(server_url, CHAT, body | {"stream": True}), post(server_url, CHAT, body)
    assert streamed.status_code == plain.status_code == 400
    assert streamed.headers["content-type"].startswith("application/json")
    assert streamed.json() == plain.json()
    assert str(limit) in plain.json()["error"]["message"]


def test_models_health_metrics(server_url):
    models = httpx.get(server_url + "/v1/models").json()
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
    assert httpx.get(server_url + "/health").json() == {"status": "ok"}
    text = httpx.get(server_url + "/metrics").text
    for name in ("kvserve:num_requests_running", "kvserve:kv_cache_usage_perc", "kvserve:num_preemptions_total",
                 "kvserve:time_to_first_token_seconds_bucket", "kvserve:request_success_total",
                 "kvserve:prefix_cache_hits_total", "kvserve:generation_tokens_total"):
        assert name in text


def test_prefix_cache_hit_is_reported(server_url):
    system = "You are a meticulous assistant. " * 12
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
            "max_tokens": 2, "temperature": 0}
    post(server_url, CHAT, body)
    again = post(server_url, CHAT, body | {"messages": body["messages"][:1] + [{"role": "user", "content": "Yo"}]})
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64


def test_n_choices_share_the_prompt_blocks(server_url):
    prompt = "A unique note about giraffes, their long necks and their quiet habits at dawn. " * 4
    body = post(server_url, COMPLETIONS, {"prompt": prompt, "n": 3, "max_tokens": 4, "temperature": 0.8,
                                          "seed": 3, "logprobs": 0}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
    # usage counts each choice's own tokens once (the shared prompt blocks are not generated tokens)
    assert body["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in body["choices"])


def test_huge_seed_is_sampled_not_a_500(server_url):
    body = chat_body("Hi", temperature=1.0, seed=2**63 - 1, max_tokens=4)
    response = post(server_url, CHAT, body)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_every_signed_64_bit_seed_is_its_own_sample(server_url):
    """OpenAI's and vLLM's seed is a signed 64-bit integer (clients send -1): each one samples its own tokens,
    again the same; seed 2**63 - 1 is not seed 0, and choice 1 of seed S is not choice 0 of seed S + 1."""
    def texts(seed, n=1):
        body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 1.5, "ignore_eos": True,
                "seed": seed, "n": n}
        response = post(server_url, COMPLETIONS, body)
        assert response.status_code == 200, response.text
        return [c["text"] for c in response.json()["choices"]]

    seeds = [0, 1, -1, -2**63, 2**63 - 1]
    samples = {seed: texts(seed)[0] for seed in seeds}
    assert len(set(samples.values())) == len(seeds)
    assert texts(-1) == [samples[-1]]
    assert texts(0, n=2)[1] != samples[1] and texts(0, n=2)[0] == samples[0]
    for seed in (2**63, -2**63 - 1):
        refused = post(server_url, COMPLETIONS, {"prompt": "Hi", "seed": seed})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "seed"


def test_completions_max_tokens_null_means_16(server_url):
    body = post(server_url, COMPLETIONS, {"prompt": "Once", "max_tokens": None, "ignore_eos": True}).json()
    assert body["usage"]["completion_tokens"] == 16


NULLABLE = ("temperature", "top_p", "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "top_k",
            "min_p", "stop", "seed", "stream", "stream_options", "logprobs", "top_logprobs", "ignore_eos",
            "min_tokens", "stop_token_ids", "user", "logit_bias", "tools")


def test_null_means_the_default(server_url):
    # OpenAI marks these fields nullable and SDKs/proxies send explicit nulls: null is the default, not a 400
    body = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 6, "seed": 11}
    nulls = {name: None for name in NULLABLE if name != "seed"}
    alone, with_nulls = (post(server_url, CHAT, b) for b in (body, body | nulls))
    assert with_nulls.status_code == 200, with_nulls.text
    assert text_of(with_nulls.json(), True) == text_of(alone.json(), True)  # temperature 1.0: a seeded sample
    done = post(server_url, COMPLETIONS, {"prompt": "Once", "max_tokens": 3, "echo": None, "logprobs": None,
                                          "temperature": None, "seed": 2})
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3
    required = post(server_url, CHAT, {"messages": None})
    assert required.status_code == 400 and required.json()["error"]["param"] == "messages"


def test_tokenize_bad_input_is_400(server_url):
    for body in ({"messages": []}, {"prompt": "a \ud800"}, {}):
        response = post(server_url, "/tokenize", body)
        assert response.status_code == 400 and "error" in response.json()


def test_model_card_and_head_health(server_url):
    assert httpx.get(server_url + "/v1/models/SmolLM2-135M-Instruct").json()["id"] == "SmolLM2-135M-Instruct"
    assert httpx.get(server_url + "/v1/models/nope").status_code == 404
    assert httpx.head(server_url + "/health").status_code == 200


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/SmolLM2-135M-Instruct", "/metrics", "/tokenizer_info",
                                  "/live"])
def test_every_get_route_answers_head_with_its_headers_and_no_body(server_url, path):
    got, head = httpx.get(server_url + path), httpx.head(server_url + path)
    assert head.status_code == got.status_code == 200
    assert head.content == b"" and head.headers["content-type"] == got.headers["content-type"]
    assert httpx.head(server_url + "/v1/models/nope").status_code == 404


def test_tokenize_and_detokenize_check_their_fields_and_model(server_url):
    """As the generation routes: an unknown field is a 400 naming it, another model a 404; vLLM's
    return_token_strs is served; an empty prompt counts the token generation starts it with."""
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        unknown = post(server_url, path, body | {"foo": 1})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "foo", unknown.text
        other = post(server_url, path, body | {"model": "nope"})
        assert other.status_code == 404 and other.json()["error"]["param"] == "model", other.text
        assert post(server_url, path, body | {"model": "SmolLM2-135M-Instruct"}).status_code == 200
    strs = post(server_url, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert strs["token_strs"] == ["Hello", "Ġworld"] and len(strs["tokens"]) == 2
    assert "token_strs" not in post(server_url, "/tokenize", {"prompt": "Hello world"}).json()
    empty = post(server_url, "/tokenize", {"prompt": ""}).json()
    reply = post(server_url, COMPLETIONS, {"prompt": "", "max_tokens": 1, "temperature": 0}).json()
    assert empty["count"] == reply["usage"]["prompt_tokens"] == 1
    assert post(server_url, "/tokenize", {"prompt": "", "add_special_tokens": False}).json()["tokens"] == []


def test_logprobs_give_the_raw_bytes_of_partial_characters(server_url):
    ids = httpx.post(server_url + "/tokenize", json={"prompt": "😀", "add_special_tokens": False}).json()["tokens"]
    body = post(server_url, COMPLETIONS, {"prompt": ids, "max_tokens": 1, "temperature": 0, "echo": True,
                                          "logprobs": 0}).json()
    tokens = body["choices"][0]["logprobs"]["tokens"][:len(ids)]
    assert tokens[0] == "bytes:\\xf0\\x9f" and all(t.startswith("bytes:") for t in tokens)
    chat = post(server_url, CHAT, chat_body("Reply with one emoji: 😀", max_tokens=8, logprobs=True)).json()
    raw = b"".join(bytes(t["bytes"]) for t in chat["choices"][0]["logprobs"]["content"])
    assert b"\xef\xbf\xbd" not in raw  # the bytes are real, never U+FFFD


@pytest.mark.parametrize("stream", [False, True])
def test_text_offset_counts_characters_split_across_tokens(server_url, stream):
    # " 🍕" arrives as three byte tokens: each starts where the character starts, and the character counts once
    body = {"prompt": "I love 🍕 and 🌊 ok", "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 1}
    if stream:
        chunks = stream_chunks(server_url, COMPLETIONS, body)
        text = joined(chunks, chat=False)
        logprobs = {k: [v for c in chunks for v in c["choices"][0]["logprobs"][k]] for k in ("tokens", "text_offset")}
    else:
        choice = post(server_url, COMPLETIONS, body).json()["choices"][0]
        text, logprobs = choice["text"], choice["logprobs"]
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    assert offsets == sorted(offsets) and offsets[tokens.index(" and")] == len("I love 🍕")
    for token, offset in zip(tokens, offsets):
        if not token.startswith("bytes:"):
            assert text[offset:offset + len(token)] == token


def test_text_offset_skips_generated_special_tokens(server_url):
    # the chat-template prompt makes the model emit <|im_end|> / <|im_start|>, which the text leaves out
    body = {"prompt": "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\nHi<|im_end|>\n",
            "max_tokens": 16, "logprobs": 0, "ignore_eos": True, "temperature": 0}
    choice = post(server_url, COMPLETIONS, body).json()["choices"][0]
    tokens, offsets = choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
    assert "<|im_end|>" in tokens or "<|im_start|>" in tokens  # the case this test is about
    assert all(offset <= len(choice["text"]) for offset in offsets)
    for token, offset in zip(tokens, offsets):
        if not token.startswith("bytes:") and not token.startswith("<|"):
            assert choice["text"][offset:offset + len(token)] == token
    echoed = post(server_url, COMPLETIONS, body | {"echo": True, "max_tokens": 1}).json()["choices"][0]
    prompt_offsets = echoed["logprobs"]["text_offset"]
    assert echoed["text"][prompt_offsets[1]:].startswith("user")  # echoed special tokens are in the text


def test_step_log_and_step_counters(smollm2, tmp_path):
    from kvserve.server.config import ServeConfig
    from tests.serverutil import running_server
    log = tmp_path / "steps.jsonl"
    with running_server(smollm2, ServeConfig(kv_cache_memory="64MiB", step_log=str(log))) as url:
        prompt = "Count the steps of this request, please."
        post(url, COMPLETIONS, {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True})
        text = httpx.get(url + "/metrics").text
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    # one prefill step (that samples the first token), then one decode step per further token
    assert [(s["prefills"], s["decodes"]) for s in steps] == [(1, 0)] + [(0, 1)] * 4
    assert steps[0]["prefill_tokens"] == len(smollm2.tokenizer(prompt)["input_ids"])
    assert [s["max_context"] for s in steps[1:]] == [steps[0]["prefill_tokens"] + i for i in range(1, 5)]
    assert all(s["seconds"] > 0 for s in steps)
    ends = [s["end_s"] for s in steps]  # perf_counter() at each step's end: increasing, each a step's time apart
    assert all(b - a >= s["seconds"] for a, b, s in zip(ends, ends[1:], steps[1:]))
    assert ends[-1] <= time.perf_counter()
    counters = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
                if line.startswith(("kvserve:engine_steps_total", "kvserve:engine_step_seconds_total"))}
    assert counters["kvserve:engine_steps_total"] == 5
    assert counters["kvserve:engine_step_seconds_total"] == pytest.approx(sum(s["seconds"] for s in steps), rel=1e-3)


def test_a_failing_step_log_never_stops_serving(smollm2):
    from kvserve.server.config import ServeConfig
    from tests.serverutil import running_server
    with running_server(smollm2, ServeConfig(kv_cache_memory="64MiB", step_log="/dev/full")) as url:  # ENOSPC
        for _ in range(2):
            response = post(url, COMPLETIONS, {"prompt": "The capital of France is", "max_tokens": 3,
                                               "temperature": 0})
            assert response.status_code == 200
        assert httpx.get(url + "/health").status_code == 200


def test_a_one_token_prompt_chunk_is_prefill_not_decode():
    from kvserve.engine.plan import SamplingParams, SeqWork
    greedy = SamplingParams(temperature=0.0)
    chunk = SeqWork(0, [14], 4, [0], [4], True, greedy, [10, 11, 12, 13, 14], [])  # last prompt token
    decode = SeqWork(0, [99], 5, [0], [5], True, greedy, [10, 11, 12, 13, 14], [99])
    assert (chunk.is_decode, decode.is_decode) == (False, True)


@pytest.mark.parametrize("path,extra,named", [
    (COMPLETIONS, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (CHAT, {"response_format": {"type": "yaml"}}, "response_format"),
    (CHAT, {"top_logprobs": 3}, "top_logprobs requires logprobs"),
    (CHAT, {"stream": "yes"}, "stream"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "image_url"),
    (CHAT, {"best_of": 3}, "best_of"),  # served by completions only (tests/test_vllm_compat.py)
])
def test_unimplemented_openai_fields_are_refused_not_ignored(server_url, path, extra, named):
    body = (chat_body("Hi", max_tokens=2) if path == CHAT else {"prompt": "Hi", "max_tokens": 2}) | extra
    response = post(server_url, path, body)
    assert response.status_code == 400
    assert named in response.json()["error"]["message"]


@pytest.mark.parametrize("path,extra,param", [
    (CHAT, {"best_of": 2}, "best_of"),
    (CHAT, {"top_logprobs": 3}, "top_logprobs"),
    (CHAT, {"continue_final_message": True}, "continue_final_message"),
    (COMPLETIONS, {"best_of": 1, "n": 2}, "best_of"),
    (COMPLETIONS, {"best_of": 3, "n": 2, "stream": True}, "best_of"),
    ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}], "continue_final_message": True},
     "continue_final_message"),
    ("/tokenize", {}, "prompt"),
    ("/v1/responses", {"store": True}, "store"),
    ("/v1/responses", {"previous_response_id": "resp_1"}, "previous_response_id"),
    ("/v1/responses", {"text": {"format": {"type": "json_object"}}}, "text.format"),
    ("/v1/responses", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/responses", {"input": []}, "input"),
    ("/v1/responses", {"input": [{"role": "user", "content": None}]}, "input.0.content"),
    ("/v1/responses", {"input": [{"role": "user"}]}, "input.0.content"),
    ("/v1/responses", {"input": [{"role": "user", "content": []}]}, "input.0.content"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input.0.content"),
])
def test_a_refusal_of_one_field_names_it_as_its_param(server_url, path, extra, param):
    """The 400 of a check across fields (a model validator) names the field at fault, as a field's own check does,
    and a responses input message without text is refused as chat's is (never served as an empty turn)."""
    body = {CHAT: chat_body("Hi", max_tokens=2), COMPLETIONS: {"prompt": "Hi", "max_tokens": 2},
            "/v1/responses": {"input": "Hi", "max_output_tokens": 2}, "/tokenize": {}}[path] | extra
    response = post(server_url, path, {k: v for k, v in body.items() if v is not None})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text
    assert "store false" not in response.json()["error"]["message"] or param in ("store", "previous_response_id")


def test_harmless_values_of_those_fields_are_accepted(server_url):
    body = chat_body("Hi", max_tokens=2) | {"response_format": {"type": "text"}, "tool_choice": "none",
                                            "logit_bias": {}, "top_logprobs": 0}
    assert post(server_url, CHAT, body).status_code == 200
    assert post(server_url, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2, "best_of": 1}).status_code == 200


def test_chat_without_a_usable_template_is_a_400_not_a_500(smollm2):
    # a base model's directory has no chat template; a template may also refuse messages (raise_exception)
    import copy
    from types import SimpleNamespace

    from kvserve.server.chat_template import ChatTemplate, chat_templates
    from kvserve.server.errors import ApiError
    from kvserve.server.prepare import chat_prompt_ids
    from kvserve.server.schemas import ChatCompletionRequest

    messages = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]}).messages
    tokenizer = copy.deepcopy(smollm2.tokenizer)
    state = SimpleNamespace(tokenizer=tokenizer, model_name="base", chat_templates=chat_templates(tokenizer, 1 << 20))
    assert chat_prompt_ids(state, messages)  # the real template works
    tokenizer.chat_template = None
    state.chat_templates = chat_templates(tokenizer, 1 << 20)
    with pytest.raises(ApiError) as no_template:
        chat_prompt_ids(state, messages)
    # a template that refuses these messages (one refusing every chat would stop the start: test_chat_template.py)
    state.chat_templates = {"default": ChatTemplate("{{ raise_exception('Conversation roles must alternate') }}",
                                                    {}, 1 << 20)}
    with pytest.raises(ApiError) as refused:
        chat_prompt_ids(state, messages)
    assert no_template.value.status == refused.value.status == 400
    assert "no chat template" in no_template.value.message and "/v1/completions" in no_template.value.message
    assert "roles must alternate" in refused.value.message
