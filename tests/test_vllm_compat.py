"""What vLLM's clients send and read, against the live server: several prompts per completions request,
logit_bias, best_of, suffix, /tokenizer_info and x-request-id."""

from __future__ import annotations

import json
import re

import httpx
import pytest

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def post(url: str, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120, **kwargs)


def completion(url: str, **body) -> dict:
    response = post(url, COMPLETIONS, body)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + COMPLETIONS, json=body | {"stream": True}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


PROMPTS = ["The sky is", "One, two, three,"]


def test_several_prompts_are_numbered_prompt_major_with_summed_usage(server_url):
    alone = [completion(server_url, prompt=p, max_tokens=5, temperature=0, n=2) for p in PROMPTS]
    together = completion(server_url, prompt=PROMPTS, max_tokens=5, temperature=0, n=2)
    assert [c["index"] for c in together["choices"]] == [0, 1, 2, 3]
    # prompt i, choice j is index i * n + j, with the text that prompt gives alone
    for i, single in enumerate(alone):
        for j in range(2):
            assert together["choices"][i * 2 + j]["text"] == single["choices"][j]["text"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert together["usage"][key] == sum(single["usage"][key] for single in alone)


def test_several_prompts_streamed(server_url):
    whole = completion(server_url, prompt=PROMPTS, max_tokens=5, temperature=0)
    chunks = streamed(server_url, {"prompt": PROMPTS, "max_tokens": 5, "temperature": 0,
                                   "stream_options": {"include_usage": True}})
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert chunks[-1]["usage"] == whole["usage"]


def test_token_id_prompts_with_echo_and_logprobs_as_lm_eval_sends_them(server_url):
    ids = [httpx.post(server_url + "/tokenize", json={"prompt": p}).json()["tokens"] for p in PROMPTS]
    body = completion(server_url, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1)
    for prompt, prompt_ids, choice in zip(PROMPTS, ids, body["choices"]):
        assert choice["text"].startswith(prompt)
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(prompt_ids) + 1  # the prompt's tokens, then the generated one
        assert logprobs["token_logprobs"][0] is None and all(lp <= 0 for lp in logprobs["token_logprobs"][1:])


def test_a_bad_prompt_among_several_is_a_400(server_url):
    response = post(server_url, COMPLETIONS, {"prompt": [[1, 2], [10**9]], "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert post(server_url, COMPLETIONS, {"prompt": ["Hi", []], "max_tokens": 2}).status_code == 400


def first_token_id(url: str, prompt: str) -> int:
    body = completion(url, prompt=prompt, max_tokens=1, temperature=0, logprobs=0)
    token = body["choices"][0]["logprobs"]["tokens"][0]
    return httpx.post(url + "/tokenize", json={"prompt": token, "add_special_tokens": False}).json()["tokens"][0]


def test_logit_bias_bans_and_forces_tokens(server_url):
    greedy = first_token_id(server_url, "The sky is")
    banned = completion(server_url, prompt="The sky is", max_tokens=1, temperature=0, logprobs=0,
                        logit_bias={str(greedy): -100})
    assert first_token_id(server_url, "The sky is") == greedy  # unbiased requests are unaffected
    banned_text = banned["choices"][0]["logprobs"]["tokens"][0]
    forced_id = httpx.post(server_url + "/tokenize", json={"prompt": " banana", "add_special_tokens": False}
                           ).json()["tokens"][0]
    forced = completion(server_url, prompt="The sky is", max_tokens=3, temperature=0, logit_bias={str(forced_id): 100})
    decoded = httpx.post(server_url + "/detokenize", json={"tokens": [forced_id]}).json()["prompt"]
    assert banned_text != httpx.post(server_url + "/detokenize", json={"tokens": [greedy]}).json()["prompt"]
    assert forced["choices"][0]["text"] == decoded * 3
    # sampling too: +100 leaves no other token any probability mass
    sampled = completion(server_url, prompt="Hi", max_tokens=2, temperature=1.0, seed=3,
                         logit_bias={str(forced_id): 100})
    assert sampled["choices"][0]["text"] == decoded * 2


@pytest.mark.parametrize("bias,why", [({"42": 101}, "between -100 and 100"), ({"42": -100.5}, "between -100"),
                                      ({"abc": 1}, "invalid key"), ({"10000000": 1}, "must be in [0, 49151]"),
                                      ({"-1": 1}, "invalid key"), ({" 12": 1}, "invalid key"),
                                      ({"12 ": 1}, "invalid key"), ({"+12": 1}, "invalid key")])
def test_logit_bias_range_checks(server_url, bias, why):
    for path, body in ((COMPLETIONS, {"prompt": "Hi"}), (CHAT, {"messages": [{"role": "user", "content": "Hi"}]})):
        response = post(server_url, path, body | {"max_tokens": 2, "logit_bias": bias})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "logit_bias" and why in error["message"]


def test_best_of_returns_the_candidates_with_the_highest_cumulative_logprob(server_url):
    common = {"prompt": "My favourite animal is", "max_tokens": 6, "temperature": 1.0, "seed": 5, "logprobs": 0}
    every = completion(server_url, n=3, **common)  # the same three candidates: choice j samples with seed + j
    best = completion(server_url, n=1, best_of=3, **common)
    totals = {c["text"]: sum(c["logprobs"]["token_logprobs"]) for c in every["choices"]}
    (choice,) = best["choices"]
    assert choice["index"] == 0 and choice["text"] == max(totals, key=totals.get)
    assert best["usage"]["completion_tokens"] == every["usage"]["completion_tokens"]  # all candidates count
    two = completion(server_url, n=2, best_of=3, **common)
    ranked = sorted(totals, key=totals.get, reverse=True)
    assert [c["text"] for c in two["choices"]] == ranked[:2] and [c["index"] for c in two["choices"]] == [0, 1]


@pytest.mark.parametrize("path,extra,named", [
    (COMPLETIONS, {"best_of": 3, "stream": True}, "best_of"),
    (COMPLETIONS, {"best_of": 1, "n": 2}, "best_of"),
    (COMPLETIONS, {"best_of": 17}, "best_of"),
    (CHAT, {"best_of": 2}, "best_of"),
    (CHAT, {"suffix": "x"}, "suffix"),
])
def test_best_of_and_suffix_refusals(server_url, path, extra, named):
    body = {"prompt": "Hi"} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "Hi"}]}
    response = post(server_url, path, body | {"max_tokens": 2} | extra)
    assert response.status_code == 400 and named in response.json()["error"]["message"]


def test_suffix_needs_fim_tokens(server_url, smollm2):
    from kvserve.server.fim import fim_tokens

    response = post(server_url, COMPLETIONS, {"prompt": "def add(a, b):\n", "suffix": "\n    return c\n",
                                              "max_tokens": 4, "temperature": 0})
    if fim_tokens(smollm2.tokenizer) is None:
        assert response.status_code == 400 and response.json()["error"]["param"] == "suffix"
    else:
        assert response.status_code == 200


def test_fim_prompt_layouts():
    from kvserve.server.errors import ApiError
    from kvserve.server.fim import fim_prompt

    class Vocab:
        def __init__(self, tokens):
            self.tokens = tokens

        def get_vocab(self):
            return {t: i for i, t in enumerate(self.tokens)}

    starcoder = Vocab(["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "a"])
    assert fim_prompt(starcoder, "P", "S") == "<fim_prefix>P<fim_suffix>S<fim_middle>"
    qwen = Vocab(["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"])
    assert fim_prompt(qwen, "P", "S") == "<|fim_prefix|>P<|fim_suffix|>S<|fim_middle|>"
    with pytest.raises(ApiError) as refused:
        fim_prompt(Vocab(["<fim_prefix>", "a"]), "P", "S")
    assert refused.value.status == 400


def test_tokenizer_info_has_vllms_shape(server_url, smollm2):
    info = httpx.get(server_url + "/tokenizer_info", timeout=10).json()
    tokenizer = smollm2.tokenizer
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template
    assert not any(key.endswith("_file") for key in info)


def test_request_id_is_honoured_or_made(server_url):
    mine = post(server_url, COMPLETIONS, {"prompt": "Hi", "max_tokens": 1}, headers={"x-request-id": "trace-42"})
    assert mine.headers["x-request-id"] == "trace-42" and mine.json()["id"] == "cmpl-trace-42"
    made = post(server_url, COMPLETIONS, {"prompt": "Hi", "max_tokens": 1})
    assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])
    assert made.json()["id"] == "cmpl-" + made.headers["x-request-id"]
    # errors and non-/v1 routes carry one too; a forged header (control characters) is replaced
    error = post(server_url, COMPLETIONS, {"prompt": "Hi", "max_tokens": 0}, headers={"x-request-id": "a\tb"})
    assert error.status_code == 400 and re.fullmatch(r"[0-9a-f]{32}", error.headers["x-request-id"])
    assert httpx.get(server_url + "/health").headers["x-request-id"]


VLLM_FAMILIES = ("request_prompt_tokens", "request_generation_tokens", "time_per_output_token_seconds",
                 "request_inference_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "iteration_tokens_total", "request_params_n", "request_params_max_tokens", "cache_config_info",
                 "time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "request_success",
                 "prompt_tokens", "generation_tokens", "request_max_num_generation_tokens")


def test_metrics_carry_model_name_and_vllms_families_under_both_prefixes(smollm2):
    from prometheus_client.parser import text_string_to_metric_families

    from kvserve.server.config import ServeConfig
    from tests.serverutil import running_server

    with running_server(smollm2, ServeConfig(kv_cache_memory="64MiB", vllm_metric_names=True)) as url:
        completion(url, prompt=PROMPTS, max_tokens=4, temperature=0, n=2, ignore_eos=True)
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    for prefix in ("kvserve:", "vllm:"):
        missing = [name for name in VLLM_FAMILIES if prefix + name not in families]
        assert not missing, (prefix, missing)
    assert "vllm:gpu_cache_usage_perc" in families and "kvserve:gpu_cache_usage_perc" not in families
    for family in families.values():
        assert all(s.labels.get("model_name") == "SmolLM2-135M-Instruct" for s in family.samples), family.name

    def sample(name: str) -> float:
        return next(s.value for family in families.values() for s in family.samples if s.name == name)

    ttft_bounds = [s.labels["le"] for s in families["vllm:time_to_first_token_seconds"].samples
                   if s.name.endswith("_bucket")]
    assert ttft_bounds[-3:] == ["640.0", "2560.0", "+Inf"]  # vLLM's: past 160 s
    # two prompts x n=2: four sequences of four tokens, each with its prompt's length
    assert sample("vllm:request_generation_tokens_count") == 4
    assert sample("vllm:request_generation_tokens_sum") == 16
    assert sample("vllm:request_params_n_count") == 2 and sample("vllm:request_params_n_sum") == 4
    assert sample("vllm:request_params_max_tokens_sum") == 8
    assert sample("kvserve:time_per_output_token_seconds_count") == 4 * 3
    # tokens per step: the prompts' computed tokens, then one input token per later generated token
    computed = sample("kvserve:prompt_tokens_total") + sample("kvserve:generation_tokens_total") - 4
    assert sample("kvserve:iteration_tokens_total_sum") == computed
    decode, prefill, inference = (sample(f"kvserve:request_{phase}_time_seconds_sum")
                                  for phase in ("decode", "prefill", "inference"))
    assert decode > 0 and prefill > 0 and inference == pytest.approx(decode + prefill, rel=1e-6)
    (info,) = families["vllm:cache_config_info"].samples
    assert info.value == 1 and info.labels["enable_prefix_caching"] == "True" and int(info.labels["block_size"]) > 0


def test_min_tokens_holds_back_stop_strings_too(server_url):
    """vLLM's min_tokens suppresses stop strings as well as stop tokens until that many tokens are out; a stop
    string in the first min_tokens tokens' text was ending the reply there."""
    body = {"prompt": "List fruits: apple, banana,", "max_tokens": 12, "temperature": 0, "stop": [","]}
    early = post(server_url, "/v1/completions", body).json()
    assert early["usage"]["completion_tokens"] < 5  # the premise: without min_tokens the stop string comes early
    held = post(server_url, "/v1/completions", body | {"min_tokens": 5}).json()
    assert held["usage"]["completion_tokens"] >= 5
    text = held["choices"][0]["text"]
    assert "," in text and text.startswith(early["choices"][0]["text"])


def test_completions_top_logprobs_list_the_sampled_token_too(server_url):
    """OpenAI's legacy API and vLLM: up to logprobs + 1 entries, the sampled token always among them; logprobs: 0
    gives it alone (it gave empty objects)."""
    alone = completion(server_url, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=0)
    logprobs = alone["choices"][0]["logprobs"]
    assert [list(top) for top in logprobs["top_logprobs"]] == [[token] for token in logprobs["tokens"]]
    assert [top[token] for top, token in zip(logprobs["top_logprobs"], logprobs["tokens"])] == \
        logprobs["token_logprobs"]
    sampled = completion(server_url, prompt="Once upon a time", max_tokens=24, temperature=2.0, seed=3, logprobs=1)
    lp = sampled["choices"][0]["logprobs"]
    assert all(token in top and 1 <= len(top) <= 2 for top, token in zip(lp["top_logprobs"], lp["tokens"]))
    assert any(len(top) == 2 for top in lp["top_logprobs"])  # at temperature 2 some pick is not the most likely
