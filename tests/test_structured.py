"""Structured outputs and tool calling against the live server, with real clients and real schemas."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import openai
import pydantic
import pytest
import torch

from kvserve.engine.constraints import GrammarCompiler, GrammarSpec

SCHEMAS = json.loads((Path(__file__).parent / "data" / "structured_schemas.json").read_text())
CHAT = "/v1/chat/completions"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"],
    "additionalProperties": False}}}


def chat(url: str, content: str, **kw) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 64} | kw
    return httpx.post(url + CHAT, json=body, timeout=300)


def schema_format(schema: dict, name: str = "out") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def client(server_url):
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0)


def test_every_schema_validates_at_temperature_0_and_1(server_url):
    """33 schemas of the kinds people send, each at temperature 0 and 1, all in flight at once: every reply
    closes within its 56 tokens (numbers bounded, the closing path forced at the end) and validates."""
    def one(case):
        entry, temperature = case
        response = chat(server_url, f"Give an example of {entry['name'].replace('_', ' ')} as JSON.",
                        temperature=temperature, seed=1, max_tokens=56,
                        response_format=schema_format(entry["schema"]))
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return entry, choice["message"]["content"], choice["finish_reason"]

    # the grammar tokenizer is built once per server, on the first constrained request: not in the flood below,
    # whose compiles each have 10 s
    assert chat(server_url, "Hi", max_tokens=1, response_format={"type": "json_object"}).status_code == 200
    cases = [(entry, t) for entry in SCHEMAS for t in (0.0, 1.0)]
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(one, cases))
    for entry, text, reason in results:
        assert reason == "stop", (entry["name"], text)
        jsonschema.validate(json.loads(text), entry["schema"])


def test_greedy_constrained_output_is_the_same_alone_and_batched(server_url):
    schema = next(e["schema"] for e in SCHEMAS if e["name"] == "event")
    kw = {"response_format": schema_format(schema)}
    alone = chat(server_url, "Describe a team meeting.", **kw).json()["choices"][0]["message"]["content"]
    prompts = ["Describe a team meeting.", "Describe a birthday party.", "Describe a concert.", "Hi"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        batched = list(pool.map(lambda p: chat(server_url, p, n=2, **kw).json(), prompts))
    assert [c["message"]["content"] for c in batched[0]["choices"]] == [alone, alone]
    for response in batched:
        for choice in response["choices"]:
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_json_cut_by_max_tokens_says_length(server_url):
    response = chat(server_url, "A person", max_tokens=3,
                    response_format=schema_format(SCHEMAS[0]["schema"])).json()["choices"][0]
    assert response["finish_reason"] == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(response["message"]["content"])


def test_json_object_logprobs_and_stop_strings(server_url):
    response = chat(server_url, "Give a JSON object about a cat.", response_format={"type": "json_object"},
                    logprobs=True, top_logprobs=2, max_tokens=40).json()["choices"][0]
    if response["finish_reason"] == "stop":
        assert isinstance(json.loads(response["message"]["content"]), dict)
    for token in response["logprobs"]["content"]:
        assert token["logprob"] > float("-inf") and token["top_logprobs"][0]["logprob"] >= token["logprob"]
    stopped = chat(server_url, "A person", stop=['"age"'],
                   response_format=schema_format(SCHEMAS[0]["schema"])).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and '"age"' not in stopped["message"]["content"]


def test_vllm_guided_fields(server_url):
    picked = chat(server_url, "Is the sky blue?", guided_choice=["yes", "no"]).json()["choices"][0]
    assert picked["message"]["content"] in ("yes", "no")
    date = chat(server_url, "When?", guided_regex=r"\d{4}-\d{2}-\d{2}").json()["choices"][0]["message"]["content"]
    assert len(date) == 10 and date[4] == "-" and date[:4].isdigit()
    newer = chat(server_url, "Pick", structured_outputs={"choice": ["red", "green"]}).json()
    assert newer["choices"][0]["message"]["content"] in ("red", "green")
    via_json = chat(server_url, "A person", guided_json=json.dumps(SCHEMAS[0]["schema"])).json()["choices"][0]
    jsonschema.validate(json.loads(via_json["message"]["content"]), SCHEMAS[0]["schema"])
    streamed = httpx.post(server_url + CHAT, timeout=120, json={
        "messages": [{"role": "user", "content": "Is water wet?"}], "guided_choice": ["yes", "no"],
        "temperature": 0, "stream": True})
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                   for line in streamed.text.splitlines() if line.startswith("data: {"))
    assert text in ("yes", "no")


@pytest.mark.parametrize("field, pattern", [
    ("guided_regex", r"\w{1,5}"), ("guided_regex", r"[\w.]{1,4} \d{1,3}"), ("guided_regex", r"\d{1,3}\s\W\S"),
    ("structured_outputs", r"[^\W]{3}\D"),
])
def test_a_regex_shorthand_class_is_ascii(server_url, field, pattern):
    """\\d, \\w, \\s and their negations are ASCII classes, as in vLLM's regex backends and JSON Schema: "é" (a
    Unicode word character, one token here) pushed by logit_bias is not a \\w."""
    value = {"regex": pattern} if field == "structured_outputs" else pattern
    body = {"messages": [{"role": "user", "content": "Answer"}], "max_tokens": 16, "temperature": 0,
            "logit_bias": {"2756": 100}, field: value}
    choice = httpx.post(server_url + CHAT, json=body, timeout=120).json()["choices"][0]
    text = choice["message"]["content"]
    assert choice["finish_reason"] == "stop" and re.fullmatch(pattern, text, re.ASCII), text


def test_ascii_shorthands_keep_other_escapes_and_classes():
    from kvserve.server.structured import ascii_shorthands

    assert ascii_shorthands(r"\d{4}-\d\D") == r"[0-9]{4}-[0-9][^0-9]"
    assert ascii_shorthands(r"[\d.]+[^\s]") == r"[[:digit:].]+[^[:space:]]"
    # inside a class one item, so a "-" after it is a member, not a range ("[\w-z]": \w, "-" and "z")
    assert ascii_shorthands(r"[\w-z][^]\W][[:digit:]\S]") == r"[[:word:]-z][^][:^word:]][[:digit:][:^space:]]"
    assert ascii_shorthands(r"\\d\.\p{L}\x41\u00e9") == r"\\d\.\p{L}\x41\u00e9"
    # a "-" before a shorthand is a member, not a range to it ("[+-\d]": "+", "-" or a digit); "--" stays an operator
    assert ascii_shorthands(r"[+-\d][\d-\w][\w--\d]") == r"[+\-[:digit:]][[:digit:]\-[:word:]][[:word:]--[:digit:]]"
    with pytest.raises(ValueError, match="lone backslash"):
        ascii_shorthands("ab\\")


@pytest.mark.parametrize("pattern, bias, text", [(r"[\w-z]", "29", "-"), (r"[\w-z]", "80", None),
                                                 (r"[+-\d]", "29", "-"), (r"[+-\d]", "80", None),
                                                 ("ab\\", None, None)])
def test_a_class_with_a_shorthand_then_a_hyphen_is_read_as_written(server_url, pattern, bias, text):
    """"[\\w-z]" is \\w, "-" or "z" (as ECMA-262 and vLLM's backends read it; Python's re refuses it): "-" pushed
    by logit_bias is written, "`" (inside the range "_-z" the class would make written out) is not; a pattern
    ending in a lone backslash is a 400 naming the field."""
    body = {"prompt": "x", "max_tokens": 30, "temperature": 0, "guided_regex": pattern,
            "logit_bias": {bias: 100} if bias else None}
    response = httpx.post(server_url + "/v1/completions", json=body, timeout=120)
    if bias is None:
        assert response.status_code == 400 and response.json()["error"]["param"] == "guided_regex"
        return
    written = response.json()["choices"][0]["text"]
    members = r"[0-9A-Za-z_\-z]" if "w" in pattern else r"[+\-0-9]"
    assert re.fullmatch(members, written) and (text is None or written == text), written


@pytest.mark.parametrize("body, names", [
    ({"response_format": schema_format({"type": "object", "if": {"type": "object"}, "then": {}})}, "if"),
    ({"response_format": schema_format({"type": "strin"})}, "not a valid JSON Schema"),
    ({"response_format": schema_format({"type": "string", "pattern": "(a"})}, "pattern"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": schema_format(json.loads("[" * 40 + "1" + "]" * 40))}, "JSON Schema object"),
    ({"response_format": schema_format({"type": "array", "items": json.loads('{"items": ' * 40 + "{}" + "}" * 40)})},
     "limit of 32 levels"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "not several"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"guided_grammar": "start: ("}, "guided_grammar"),
    ({"guided_regex": "(?=a)b"}, "look-around, including look-ahead and look-behind, is not supported"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0"),
])
def test_bad_grammars_get_400_naming_the_problem(server_url, body, names):
    response = chat(server_url, "Hi", **body)
    assert response.status_code == 400, response.text
    assert names in response.json()["error"]["message"]


def test_schema_checks_hold_when_the_same_schema_comes_again():
    """The checks' verdict is cached by schema text: a repeated bad schema is still a 400, a good one passes."""
    from kvserve.server.errors import ApiError
    from kvserve.server.structured import json_schema_spec

    for _ in range(2):
        with pytest.raises(ApiError, match="not a valid JSON Schema"):
            json_schema_spec({"type": "strin"}, "schema")
        with pytest.raises(ApiError, match="limit of 32 levels"):
            json_schema_spec({"items": json.loads('{"items": ' * 40 + "{}" + "}" * 40)}, "schema")
        assert json_schema_spec(PERSON, "schema") == GrammarSpec("json_schema", json.dumps(PERSON))


def test_huge_enum_is_served_or_refused_quickly_and_others_go_on(server_url):
    huge = {"type": "object", "properties": {"v": {"enum": [f"value-{i}" for i in range(4000)]}}, "required": ["v"]}
    response = chat(server_url, "Pick one", max_tokens=16, response_format=schema_format(huge))
    assert response.status_code in (200, 400), response.text
    if response.status_code == 200:
        assert json.loads(response.json()["choices"][0]["message"]["content"])["v"].startswith("value-")
    assert chat(server_url, "Hi", max_tokens=4).status_code == 200


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                          "city": {"type": "string", "maxLength": 12}},
          "required": ["name", "age", "city"], "additionalProperties": False}


def test_preempted_constrained_requests_validate_and_equal_their_output_alone(smollm2):
    """Four constrained requests in a pool that holds about one and a half of them: the newest are preempted,
    recomputed (in 16-token chunks) and resumed with their matchers; each output still validates and equals
    the same request served alone."""
    from kvserve.server.config import ServeConfig
    from kvserve.server.state import ServerState
    from tests.serverutil import serving

    # 10 blocks of 8 tokens; one request needs ~8 (a 36-token prompt, ~25 tokens of JSON), two need more than 10
    state = ServerState(smollm2, ServeConfig(num_kv_blocks=10, block_size=8, max_num_seqs=4,
                                             max_num_batched_tokens=16))
    prompts = [f"Describe {who} as JSON." for who in ("a person", "a pirate", "a chef", "a pilot")]
    with serving(state) as url:
        def reply(prompt: str) -> dict:
            response = chat(url, prompt, max_tokens=40, response_format=schema_format(PERSON))
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]

        alone = [reply(p) for p in prompts]
        before = state.core.scheduler.num_preemptions
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(reply, prompts))
        assert state.core.scheduler.num_preemptions > before
    for first, second in zip(alone, together):
        assert second["finish_reason"] == "stop"
        jsonschema.validate(json.loads(second["message"]["content"]), PERSON)
        assert second["message"]["content"] == first["message"]["content"]


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    unit: str = pydantic.Field(pattern="^(celsius|fahrenheit)$")
    days: int = pydantic.Field(ge=1, le=7)


def test_sdk_parse_returns_a_pydantic_object(client):
    completion = client.chat.completions.parse(
        model="SmolLM2-135M-Instruct", temperature=0, max_tokens=64, response_format=Weather,
        messages=[{"role": "user", "content": "Weather forecast for Paris for 3 days, in celsius."}])
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Weather) and 1 <= parsed.days <= 7


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call_parses(client, tool_choice):
    completion = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0, max_tokens=64, tools=[WEATHER, TIME],
        tool_choice=tool_choice, parallel_tool_calls=False,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"


# pydantic's shape for nested models: the parameters refer to their own $defs, and a tree refers to itself ("#")
ROUTE = {"type": "function", "function": {"name": "plan_route", "parameters": {
    "$defs": {"Stop": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                       "required": ["city"]}},
    "type": "object", "properties": {"stops": {"type": "array", "items": {"$ref": "#/$defs/Stop"}, "maxItems": 3},
                                     "then": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    "required": ["stops", "then"]}}}


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_forced_tool_calls_compile_parameters_with_defs_and_refs(client, tool_choice):
    completion = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0, max_tokens=96, tools=[ROUTE], tool_choice=tool_choice,
        parallel_tool_calls=False, messages=[{"role": "user", "content": "Plan a route from Paris to Rome."}])
    choice = completion.choices[0]
    if tool_choice == "auto" and choice.finish_reason != "tool_calls":
        return  # the model may answer in words: auto only parses
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments),
                        ROUTE["function"]["parameters"])


def test_streamed_tool_call_reassembles(client):
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0, max_tokens=64, tools=[WEATHER], stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        messages=[{"role": "user", "content": "What is the weather in Rome?"}])
    calls: dict[int, dict] = {}
    reasons = []
    fragments = empty = 0
    for chunk in stream:
        choice = chunk.choices[0]
        reasons.append(choice.finish_reason)
        # the call's opening tag is held back, not sent as chunks of empty content
        empty += not (choice.delta.role or choice.delta.content or choice.delta.tool_calls or choice.finish_reason)
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
            fragments += 1
    assert reasons[-1] == "tool_calls" and list(calls) == [0] and fragments > 2 and empty == 0
    assert calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


def test_tool_history_and_auto_and_none_are_served(client):
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"},
    ]
    for tool_choice in ("auto", "none"):
        completion = client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=24,
                                                    tools=[WEATHER], tool_choice=tool_choice, messages=history)
        choice = completion.choices[0]
        assert choice.finish_reason in ("stop", "length", "tool_calls")
        assert choice.message.content or choice.message.tool_calls
        if tool_choice == "none":
            assert not choice.message.tool_calls


def test_a_bad_tool_call_in_the_history_is_named_by_its_place(server_url):
    """A 400 whose param says which message and which call: messages.1.tool_calls.1 (an SDK or a proxy that
    mangled one call of one turn can find it)."""
    good = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    for bad, says in (({"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "{x"}},
                       "messages.1.tool_calls.1.function.arguments is not JSON"),
                      ({"id": "call_2", "type": "function"}, "an assistant message's tool_calls must be")):
        history = [{"role": "user", "content": "Weather?"},
                   {"role": "assistant", "content": None, "tool_calls": [good, bad]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
        response = httpx.post(server_url + "/v1/chat/completions", timeout=60, json={
            "messages": history, "tools": [WEATHER], "max_tokens": 4})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "messages.1.tool_calls.1", error
        assert error["message"].startswith(says), error


def test_two_tools_of_one_name_are_a_400_naming_the_second(server_url):
    # a call of that name could follow either one's parameters: ambiguous, so refused, not served as one of them
    response = chat(server_url, "Weather?", tools=[WEATHER, TIME, WEATHER | {"function": WEATHER["function"] | {
        "parameters": {"type": "object", "properties": {}}}}])
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "tools.2.function.name", error
    assert "'get_weather'" in error["message"] and "unique" in error["message"]


def test_matcher_follows_rollback_as_after_preemption(smollm2):
    """A matcher synced to fewer tokens (recompute after preemption, rejected drafts) allows what a fresh one does."""
    compiler = GrammarCompiler(smollm2.tokenizer, [smollm2.tokenizer.eos_token_id])
    grammar = compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMAS[0]["schema"])))
    assert compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMAS[0]["schema"]))) is grammar  # cached
    from kvserve.engine.masks import disallowed, fill_masks
    ids = smollm2.tokenizer('{"name": "Al", "age": 3', add_special_tokens=False)["input_ids"]
    fresh, moved = grammar.constraint(), grammar.constraint()
    expected = fill_masks([fresh], [ids[:2]])
    fill_masks([moved], [ids])
    assert moved.consumed == ids
    assert torch.equal(fill_masks([moved], [ids[:2]]), expected) and moved.consumed == ids[:2]
    banned = disallowed(expected)[0]
    assert banned[smollm2.tokenizer.eos_token_id] and not banned[ids[2]]


def test_a_constraint_after_a_thinking_block_starts_past_its_end(smollm2):
    """A prompt that opened <think> (DeepSeek-R1's, QwQ's templates): the grammar applies from the first token past
    the bytes of "</think>", whichever tokens spell them; before that every token but EOS is allowed. A rollback
    past the end (rejected drafts, preemption) thinks again; the budget that forces the closing path counts the
    tokens left after the thinking."""
    from kvserve.engine.constraints import unsatisfied
    from kvserve.engine.masks import disallowed, fill_masks

    tokenizer = smollm2.tokenizer
    eos = tokenizer.eos_token_id
    grammar = GrammarCompiler(tokenizer, [eos]).compile(GrammarSpec("regex", "[0-9]{2}"))

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    thought = ids("Hmm, two digits.</think>")
    assert tokenizer.decode(thought[-1:]) != "</think>"  # the end spelled over several tokens
    gated, plain = grammar.constraint(40, after=b"</think>"), grammar.constraint(40)
    banned = disallowed(fill_masks([gated], [thought[:3]]))[0]
    assert banned.nonzero().flatten().tolist()[:1] == [eos] and not banned[:len(tokenizer)][~(torch.arange(
        len(tokenizer)) == eos)].any()  # everything but EOS
    assert gated.thinking and unsatisfied(gated) is None  # stopped while thinking (a client's stop id): no verdict
    digits = ids("4")
    assert torch.equal(fill_masks([gated], [thought + digits]), fill_masks([plain], [digits]))
    assert not gated.thinking and gated.start == len(thought) and gated.consumed == digits
    banned = disallowed(fill_masks([gated], [thought[:-2]]))[0]  # rolled back into the thinking
    assert gated.thinking and gated.consumed == [] and not banned[ids("x")[0]]
    assert torch.equal(fill_masks([gated], [thought]), fill_masks([grammar.constraint(40)], [[]]))
    # a JSON object begun after T tokens of thinking, in a budget of B + T: the mask of one begun with a budget of
    # B, where B is small enough that its closing path is forced (a budget of 60 forces nothing yet)
    json_grammar = GrammarCompiler(tokenizer, [eos]).compile(GrammarSpec("json_schema",
                                                                          json.dumps(SCHEMAS[0]["schema"])))
    begun = ids('{"name": "Al')
    free = fill_masks([json_grammar.constraint(60)], [begun])
    budget = next(b for b in range(len(begun) + 1, 60)
                  if not torch.equal(fill_masks([json_grammar.constraint(b)], [begun]), free))
    filler = ids(" word" * 60)[:30 - len(thought)] + thought
    after_thinking = fill_masks([json_grammar.constraint(budget + 30, after=b"</think>")], [filler + begun])
    assert torch.equal(after_thinking, fill_masks([json_grammar.constraint(budget)], [begun]))


def packed(allowed: list[list[bool]]) -> torch.Tensor:
    """``fill_masks``'s layout of ``allowed`` ``[rows, vocab]``: bit j of int32 word w is token 32 * w + j."""
    rows = np.packbits(np.array(allowed, dtype=bool), axis=1, bitorder="little")  # [rows, ceil(vocab / 8)]
    rows = np.pad(rows, ((0, 0), (0, -rows.shape[1] % 4)))
    return torch.from_numpy(rows.view("<i4").astype(np.int32))  # [rows, words]


def test_bitmask_unpacks_in_token_order():
    from kvserve.engine.masks import disallowed

    allowed = [[t in (0, 31, 32, 40) for t in range(70)], [t == 69 for t in range(70)]]
    banned = disallowed(packed(allowed))  # [2, 96]
    assert banned.shape == (2, 96)
    assert torch.equal(~banned[:, :70], torch.tensor(allowed)) and banned[:, 70:].all()


def test_masked_rows_pick_only_allowed_tokens_and_other_rows_are_untouched():
    from kvserve.engine.masks import apply_masks
    from kvserve.engine.sampling import greedy_tokens, log_softmax

    logits = torch.tensor([[5.0, 1.0, 3.0, 0.5], [5.0, 1.0, 3.0, 0.5], [0.0, 0.0, 0.0, 9.0]])  # [3, vocab 4]
    allowed = packed([[False, True, True, False], [True, False, False, False]])  # rows 0 and 2 constrained
    original_row_1 = logits[1].clone()
    apply_masks(logits, [0, 2], allowed)
    picked = greedy_tokens(logits, [[], [], []])
    assert [t.token_id for t in picked] == [2, 0, 0]
    assert torch.equal(logits[1], original_row_1)
    # the logprob is under the masked distribution: allowed tokens' probabilities sum to 1
    assert abs(log_softmax(logits[0])[[1, 2]].exp().sum().item() - 1.0) < 1e-6
    assert picked[2].logprob == 0.0


def test_cpu_masks_equal_the_torch_path():
    """The in-place numpy path (CPU) against the torch path (other devices), with logits wider than the mask."""
    from kvserve.engine.masks import _apply_torch, apply_masks, disallowed

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 80, generator=generator)  # [rows, model vocab 80]; the mask covers 64
    allowed = (torch.rand(3, 64, generator=generator) < 0.3).tolist()
    masks = packed(allowed)
    ours, reference = logits.clone(), logits.clone()
    apply_masks(ours, [4, 0, 2], masks)
    _apply_torch(reference, [4, 0, 2], disallowed(masks), 64)
    assert torch.equal(ours, reference) and torch.equal(ours[[1, 3]], logits[[1, 3]])
    assert torch.isinf(ours[[4, 0, 2], 64:]).all()
    assert torch.equal(torch.isfinite(ours[4, :64]), torch.tensor(allowed[0]))
    half = logits.bfloat16()  # not float32: the torch path on a CPU too
    apply_masks(half, [4, 0, 2], masks)
    assert torch.equal(torch.isinf(half), torch.isinf(ours))


@pytest.mark.parametrize("pieces", [
    ['<tool_call>{"name": "f", "arguments": {"a": "}{", "b": [1, {"c": 2}]}}</tool_call>'],
    ["<tool", '_call>{"na', 'me": "f", "argu', 'ments": {"a": "}', '{", "b": [1, {"c"', ': 2}]}}</tool_', "call>"],
    ['<tool_call>{"name": "f", "arguments":', " ", '{"a": "}{", "b": [1, {"c": 2}]}}</tool_call>'],
])
def test_tool_call_stream_splits_any_chunking_into_the_same_call(pieces):
    from kvserve.server.tools import ToolCallStream

    stream = ToolCallStream(frozenset({"f"}), constrained=True)
    content, deltas = "", []
    for piece in pieces:
        text, more = stream.feed(piece)
        content, deltas = content + text, deltas + more
    text, more = stream.finish()
    content, deltas = content + text, deltas + more
    assert content == "" and deltas[0]["function"]["name"] == "f" and deltas[0]["id"].startswith("call_")
    arguments = "".join(d["function"]["arguments"] for d in deltas)
    assert arguments == '{"a": "}{", "b": [1, {"c": 2}]}'  # byte for byte, however the text was cut
    assert stream.calls[0]["function"]["arguments"] == arguments


def test_tool_call_stream_sends_one_entry_per_call_in_a_delta():
    """A call's header and its first argument fragment, cut from one piece of text, arrive as one entry (clients
    read ``delta.tool_calls`` by position); two calls in one piece are two entries, in order."""
    from kvserve.server.tools import ToolCallStream

    stream = ToolCallStream(frozenset({"f", "g"}), constrained=True)
    _, deltas = stream.feed('<tool_call>{"name": "f", "arguments": {"city": "')
    assert [(d["index"], d["function"]["name"], d["function"]["arguments"]) for d in deltas] == [(0, "f", '{"city": "')]
    _, deltas = stream.feed('P"}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>')
    assert [(d["index"], d["function"].get("name"), d["function"]["arguments"]) for d in deltas] == [
        (0, None, 'P"}'), (1, "g", "{}")]
    assert [c["function"]["arguments"] for c in stream.calls] == ['{"city": "P"}', "{}"]


CALL_F = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
OPEN_TAG = "<tool_call>"


@pytest.mark.parametrize("text, reason, handed_over", [
    (CALL_F, "stop", True),
    (CALL_F + CALL_F.replace('"f"', '"h"'), "stop", False),            # a function the request does not have
    (CALL_F.replace('{"a": 1}', '{"a": 1, }'), "stop", False),          # arguments that are not JSON
    ('<tool_call>{"name": "f", "arguments": {"a": "', "length", True),   # cut by max_tokens: OpenAI's partial call
    ('<tool_call>{"name": "f", "arguments": {"a": "', "stop", False),    # cut by a client's stop
    ('<tool_call>{"name": "f", "argu', "length", False),                # no call's name yet: the text is content
    ('<tool_call>{"name": "f", "arguments": {"a": b}}</tool_call>', "length", False),  # closed, not JSON
    ('<tool_call>{"name": "f", "arguments": {"a": 1} xyz}</tool_call>', "stop", False),  # the block not JSON
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool', "stop", True),  # a stop string at the close
])
def test_an_unconstrained_replys_calls_are_held_to_its_end_and_handed_over_as_a_whole_reply_would_be(
        text, reason, handed_over):
    # tool_choice auto: the stream sends nothing it may have to take back; at the end the calls the whole reply
    # would hand over, each in one delta, or the whole text as content
    from kvserve.server.tools import ToolCallStream

    stream = ToolCallStream(frozenset({"f"}))
    sent = [stream.feed(text[i:i + 7]) for i in range(0, len(text), 7)]
    assert all(piece == ("", []) for piece in sent)
    content, deltas = stream.finish(reason)
    if handed_over:
        assert content == "" and [d["index"] for d in deltas] == list(range(len(stream.calls)))
        assert [(d["function"]["name"], d["function"]["arguments"]) for d in deltas] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in stream.calls]
    else:
        assert (content, deltas, stream.calls) == (text, [], [])


def test_a_constrained_reply_cut_short_keeps_the_call_it_streamed():
    from kvserve.server.tools import ToolCallStream

    stream = ToolCallStream(frozenset({"f"}), constrained=True)
    _, deltas = stream.feed('<tool_call>{"name": "f", "arguments": {"a": "x')
    assert deltas and stream.finish("length") == ("", []) and stream.calls[0]["function"]["arguments"] == '{"a": "x'


def test_a_stop_string_inside_a_constrained_call_is_not_finish_reason_tool_calls(server_url):
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "temperature": 0,
            "max_tokens": 64, "tools": [WEATHER], "tool_choice": "required", "stop": ['"city']}
    whole, streamed = _reply(server_url, body, stream=False), _reply(server_url, body, stream=True)
    assert whole == streamed and whole[2] == "stop" and whole[1] and whole[1][0][0] == "get_weather", whole


def test_plain_reply_with_tools_stays_content():
    from kvserve.server.tools import ToolCallStream

    stream = ToolCallStream()
    assert stream.feed(" ") == ("", [])  # could still become a call
    assert stream.feed("Hello <tool") == (" Hello ", [])  # "<tool" may be a call's start: held
    assert stream.feed("s> and <b>") == ("<tools> and <b>", [])
    assert stream.feed(" <tool_call>") == (" ", [])
    assert stream.finish() == ("<tool_call>", []) and stream.calls == []  # no call in it: content after all


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
@pytest.mark.parametrize("after, handed_over", [
    (CALL_F, True),
    (CALL_F + "\n" + CALL_F.replace("1", "2"), True),       # two calls
    (CALL_F.replace('"f"', '"h"'), False),                  # a function the request does not have
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', False),
])
def test_text_before_a_call_is_content_and_the_call_is_a_call(size, after, handed_over):
    # tool_choice auto, as vLLM's Hermes parser: "Let me check.\n<tool_call>..." is content "Let me check.\n"
    # and the call, however the text arrives; a call that is not one leaves the whole reply content
    from kvserve.server.tools import ToolCallStream

    text = "Let me check <the> weather.\n" + after
    stream = ToolCallStream(frozenset({"f"}))
    sent = [stream.feed(text[i:i + size]) for i in range(0, len(text), size)]
    tail, deltas = stream.finish("stop")
    content = "".join(c for c, _ in sent) + tail
    assert all(d == [] for _, d in sent)  # held to the end
    if handed_over:
        assert content == "Let me check <the> weather.\n"
        assert [json.loads(d["function"]["arguments"])["a"] for d in deltas] == [1, 2][:after.count(OPEN_TAG)]
    else:
        assert (content, deltas, stream.calls) == (text, [], [])


def test_the_grammar_tokenizer_is_llguidances_own_without_its_copy(smollm2):
    # GrammarCompiler builds llguidance's tokenizer from the served tokenizer's JSON without the copy
    # llguidance.hf.from_tokenizer makes (a second Rust tokenizer held while it serializes): the same tokenizer,
    # so the same masks; and a tokenizer with padding or truncation on is serialized with them off, as there
    import copy

    import llguidance
    import llguidance.hf

    from kvserve.engine.constraints import compiled, tokenizer_json

    tokenizer = smollm2.tokenizer
    ours = GrammarCompiler(tokenizer, [tokenizer.eos_token_id]).tokenizer()
    theirs = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=tokenizer.eos_token_id)
    assert (ours.vocab_size, ours.eos_tokens, ours.is_canonical) == (
        theirs.vocab_size, theirs.eos_tokens, theirs.is_canonical)
    text = "Ünïcode <|im_end|> {\"a\": [1, 2.5e-3]}\n\tend"
    assert ours.tokenize_str(text) == theirs.tokenize_str(text)
    for spec in (GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "string"}}})),
                 GrammarSpec("regex", "[a-z]+ [0-9]{2}")):
        masks = [compiled(t, spec).compute_bitmask() for t in (ours, theirs)]
        assert masks[0] == masks[1]
    padded = copy.deepcopy(tokenizer)
    padded.backend_tokenizer.enable_padding(length=8)
    padded.backend_tokenizer.enable_truncation(16)
    assert tokenizer_json(padded) == tokenizer_json(tokenizer)
    assert padded.backend_tokenizer.padding is not None  # turned off in a copy, not in the tokenizer given


def test_tags_that_are_one_text_token_each_are_served_by_the_grammars(smollm2):
    """Qwen2.5's and Qwen3's <tool_call>, </tool_call>, <think> and </think> are added tokens that are text
    (``special`` false): a forced tool call's grammar walks to its end whether the model writes a tag as its one
    token or the mask's spelling, and a thinking block the one token </think> ends starts the grammar after it.
    Before, llguidance took them for control tokens: the mask allowed <tool_call>'s token, consuming it failed.
    Laid out as Qwen's own tokenizer.json lays them out (special tokens before and after the tags, added past the
    vocabulary), every token keeps its id; a tag that is a stop token stays a control token."""
    import copy

    from kvserve.engine.constraints import plain_tags
    from kvserve.engine.masks import disallowed, fill_masks
    from kvserve.server.tools import CLOSE, OPEN

    tokenizer = copy.deepcopy(smollm2.tokenizer)
    tags = [OPEN, CLOSE, "<think>", "</think>"]
    tokenizer.add_tokens(["<|q_start|>", "<|q_end|>"], special_tokens=True)
    tokenizer.add_tokens(tags[:2] + ["<|fim_x|>"], special_tokens=False)
    tokenizer.add_tokens(tags[2:] + ["<eot>"], special_tokens=False)
    tag_id = {tag: tokenizer.convert_tokens_to_ids(tag) for tag in tags}
    eos, eot = tokenizer.convert_tokens_to_ids("<|q_end|>"), tokenizer.convert_tokens_to_ids("<eot>")
    assert plain_tags(tokenizer, [eot]) == {i: tag for tag, i in tag_id.items()}
    assert tokenizer(OPEN, add_special_tokens=False)["input_ids"] == [tag_id[OPEN]]  # the model's one token
    compiler = GrammarCompiler(tokenizer, [eos, eot])
    ids = {i: t.content for i, t in tokenizer.added_tokens_decoder.items() if i >= len(smollm2.tokenizer)}
    assert {i: compiler.tokenizer().decode_bytes([i]) for i in ids} == {i: t.encode() for i, t in ids.items()}
    spec = GrammarSpec("lark", f'start: {json.dumps(OPEN)} "{{}}" {json.dumps(CLOSE)}')
    grammar = compiler.compile(spec)
    inside = GrammarCompiler(tokenizer, [eos, eot]).compile(GrammarSpec("regex", '"[a-z<>]*"')).constraint()
    banned = disallowed(fill_masks([inside], [tokenizer('"a', add_special_tokens=False)["input_ids"]]))[0]
    assert banned[eot] and not banned[tag_id["<think>"]]  # a stop token is not text inside a string; a tag is

    def walk(constraint, output: list[int], steps: int = 40) -> list[int]:
        """``output`` then the mask's lowest allowed token each step, to EOS."""
        for _ in range(steps):
            allowed = (~disallowed(fill_masks([constraint], [output]))[0][:len(tokenizer)]).nonzero().flatten()
            assert allowed.numel() > 0 and not constraint.matcher.is_error(), constraint.matcher.get_error()
            if allowed[0] == eos:
                return output
            output = output + [int(allowed[0])]
        raise AssertionError("no EOS")

    for start in ([], [tag_id[OPEN]]):  # the mask's spelling of the tag, or the model's token
        text = tokenizer.decode(walk(grammar.constraint(), start))
        assert text == OPEN + "{}" + CLOSE, text
    thought = tokenizer("Hmm", add_special_tokens=False)["input_ids"] + [tag_id["</think>"]]
    gated = grammar.constraint(40, after=b"</think>")
    fill_masks([gated], [thought])
    assert not gated.thinking and gated.start == len(thought)


def test_a_refused_token_leaves_only_eos(smollm2):
    """A matcher in its error state (a token the grammar refuses) allows only EOS, so the sequence ends."""
    from kvserve.engine.masks import disallowed, fill_masks

    tokenizer = smollm2.tokenizer
    grammar = GrammarCompiler(tokenizer, [tokenizer.eos_token_id]).compile(GrammarSpec("regex", "[0-9]+"))
    ids = tokenizer("12", add_special_tokens=False)["input_ids"] + tokenizer("ab", add_special_tokens=False)["input_ids"]
    good, bad = grammar.constraint(), grammar.constraint()
    banned = disallowed(fill_masks([good, bad], [ids[:1], ids]))  # [2, vocab]
    assert (~banned[0]).sum() > 1
    assert (~banned[1]).nonzero().flatten().tolist() == [tokenizer.eos_token_id]


class City(pydantic.BaseModel):
    name: str
    country: str
    population_millions: float


class Note(pydantic.BaseModel):
    """Unbounded strings and floats only: nothing in the schema ends a field."""
    title: str
    body: str
    score: float
    weight: float


@pytest.mark.parametrize("model, prompt", [(City, "Paris"), (City, "Tokyo"), (Note, "A note about the sea")])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("max_tokens", [40, 200])
def test_sdk_parse_closes_within_max_tokens(client, model, prompt, temperature, max_tokens):
    """The SDK's ``parse`` raises LengthFinishReasonError on a cut reply; unbounded numbers and strings must
    still close (finish_reason stop) within max_tokens, at either temperature."""
    completion = client.chat.completions.parse(
        model="SmolLM2-135M-Instruct", temperature=temperature, seed=3, max_tokens=max_tokens, response_format=model,
        messages=[{"role": "user", "content": f"{prompt} as JSON."}])
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, model)
    assert completion.usage.completion_tokens <= max_tokens


def test_numbers_are_bounded_and_a_runaway_reply_closes(smollm2):
    """A model that always prefers digits, then one that prefers a letter in strings: the number stops at 20
    mantissa digits and 3 exponent digits, every reply closes with EOS within its budget, exactly at it when
    the budget is tight."""
    from kvserve.engine.closing import MAX_EXPONENT_DIGITS, MAX_MANTISSA_DIGITS
    from kvserve.engine.masks import disallowed, fill_masks

    tokenizer = smollm2.tokenizer
    eos = tokenizer.eos_token_id
    from kvserve.server.structured import strict_schema

    grammar = GrammarCompiler(tokenizer, [eos]).compile(  # as the SDK's parse sends it: strict
        GrammarSpec("json_schema", json.dumps(strict_schema(City.model_json_schema()))))
    ids = {text: tokenizer.encode(text, add_special_tokens=False)[0] for text in ("3", "e", "a", '"')}

    def generate(prefer: list[int], budget: int, start: tuple[int, ...] = ()) -> list[int]:
        """Greedy over a fixed preference: the first allowed of ``prefer``, else the lowest allowed token."""
        constraint, out = grammar.constraint(budget), list(start)
        while len(out) < budget and (not out or out[-1] != eos):
            allowed = (~disallowed(fill_masks([constraint], [out]))[0][:len(tokenizer)]).nonzero().flatten().tolist()
            out.append(next((t for t in prefer if t in allowed), allowed[0]))
        return out

    prefix = tokenizer.encode('{"name": "Paris", "country": "France", "population_millions": ',
                              add_special_tokens=False)
    out = generate([ids["3"], ids["e"]], 200, tuple(prefix))
    text = tokenizer.decode(out[:-1])
    assert out[-1] == eos and len(out) < 200
    mantissa, exponent = text.split(": ")[-1].rstrip("}").split("e")
    assert mantissa == "3" * MAX_MANTISSA_DIGITS and exponent == "3" * MAX_EXPONENT_DIGITS
    assert City.model_validate_json(text).population_millions == float("inf")  # 3.3e352: valid JSON, past a double
    for budget in (30, 40, 80):  # strings that never end
        out = generate([ids["a"]], budget)
        assert out[-1] == eos and len(out) <= budget
        City.model_validate_json(tokenizer.decode(out[:-1]))
    assert len(generate([ids["a"]], 30)) >= 30 - 4  # the closing path is forced only at the end (the slack: 4)
    too_tight = generate([ids["a"]], 12)  # the path from the start is longer: nothing forced, cut
    assert len(too_tight) == 12 and too_tight[-1] != eos


@pytest.mark.parametrize("schema, where", [
    ({"type": "object", "properties": {"id": {"const": 123456789012345678901234}}}, "properties/id/const"),
    ({"type": "number", "multipleOf": 123456789012345678901}, "multipleOf"),
    ({"enum": [1, 2.5, 123456789012345678901]}, "enum"),
])
def test_schemas_asking_for_longer_numbers_are_refused_by_name(server_url, schema, where):
    response = chat(server_url, "Hi", response_format=schema_format(schema))
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert where in message and "20 digits before the exponent" in message


# what LangChain's with_structured_output(Weather, method="function_calling") sends: no additionalProperties
LANGCHAIN_TOOL = {"type": "function", "function": {
    "name": "Weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}


def _allows_after(smollm2, spec: GrammarSpec, text: str, next_text: str) -> bool:
    """Whether the grammar of ``spec`` allows ``next_text``'s first token after ``text``."""
    from kvserve.engine.masks import disallowed, fill_masks

    tokenizer = smollm2.tokenizer
    grammar = GrammarCompiler(tokenizer, [tokenizer.eos_token_id]).compile(spec)
    ids = tokenizer.encode(text, add_special_tokens=False)
    constraint = grammar.constraint()
    banned = disallowed(fill_masks([constraint], [ids]))[0]
    assert constraint.consumed == ids and not constraint.matcher.is_error()
    return not banned[tokenizer.encode(next_text, add_special_tokens=False)[0]].item()


def test_tool_arguments_and_strict_schemas_allow_no_unnamed_properties(smollm2):
    """Unspecified additionalProperties is false for tool arguments and for response_format with strict: true
    (xgrammar's strict mode); with strict: false the schema is read as JSON Schema says (extra keys allowed)."""
    from types import SimpleNamespace

    from kvserve.server import tools
    from kvserve.server.structured import grammar_spec, tool_parameters

    body = SimpleNamespace(tools=[LANGCHAIN_TOOL], tool_choice={"type": "function", "function": {"name": "Weather"}},
                           parallel_tool_calls=False)
    call = tools.forced_grammar(body, tool_parameters)
    done = '<tool_call>{"name": "Weather", "arguments": {"city": "Paris", "unit": "celsius"'
    assert not _allows_after(smollm2, call, done, ",") and _allows_after(smollm2, call, done, "}}")
    schema = {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "where": {"type": "object", "properties": {"x": {"type": "integer"}}}}}
    for strict, extra, given in ((True, False, schema), (False, True, schema), (True, False, json.dumps(schema))):
        # a schema given as JSON text is read strictly too (it was served as if strict were false)
        fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": given, "strict": strict}}
        spec = grammar_spec(SimpleNamespace(response_format=fmt, structured_outputs=None, tools=None,
                                            tool_choice=None, parallel_tool_calls=None))
        assert _allows_after(smollm2, spec, '{"city": "Paris", "where": {"x": 1', ",") is extra  # nested too
        assert _allows_after(smollm2, spec, '{"city": "Paris", "where": {"x": 1}', ",") is extra


def test_strict_schema_keeps_what_a_schema_says():
    from kvserve.server.structured import strict_schema

    schema = {"type": "object", "properties": {"properties": {"type": "object"}, "a": {"type": "array", "items": {
        "type": "object", "properties": {}}}, "m": {"type": "object", "additionalProperties": {"type": "integer"}}},
        "$defs": {"d": {"properties": {"k": {}}}}, "anyOf": [{"type": "object"}, {"type": "string"}]}
    strict = strict_schema(schema)
    assert strict["additionalProperties"] is False and "additionalProperties" not in schema
    assert strict["properties"]["properties"] == {"type": "object", "additionalProperties": False}
    assert strict["properties"]["a"]["items"]["additionalProperties"] is False
    assert strict["properties"]["m"]["additionalProperties"] == {"type": "integer"}
    assert strict["$defs"]["d"]["additionalProperties"] is False
    assert strict["anyOf"] == [{"type": "object", "additionalProperties": False}, {"type": "string"}]
    assert set(strict["properties"]) == {"properties", "a", "m"}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_langchain_shaped_forced_tool_call_parses_without_extra_keys(client, temperature):
    completion = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=temperature, seed=5, max_tokens=48, tools=[LANGCHAIN_TOOL],
        tool_choice={"type": "function", "function": {"name": "Weather"}}, parallel_tool_calls=False,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    arguments = json.loads(choice.message.tool_calls[0].function.arguments)
    jsonschema.validate(arguments, LANGCHAIN_TOOL["function"]["parameters"] | {"additionalProperties": False})


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_and_whole_tool_calls_are_byte_identical(client, tool_choice):
    kw = dict(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=64, tools=[WEATHER, TIME],
              tool_choice=tool_choice, messages=[{"role": "user", "content": "What is the weather in Oslo?"}])
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    streamed: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for delta in chunk.choices[0].delta.tool_calls or []:
            name_and_args = streamed.setdefault(delta.index, ["", ""])
            name_and_args[0] += delta.function.name or ""
            name_and_args[1] += delta.function.arguments or ""
    assert [[c.function.name, c.function.arguments] for c in whole] == [streamed[i] for i in sorted(streamed)]
    assert whole[0].function.arguments.startswith("{")
    # no content: null in the whole message and in every delta (the SDK's stream helper then ends with null too)
    with client.chat.completions.stream(**kw) as stream:
        contents = [event.chunk.choices[0].delta.content for event in stream if event.type == "chunk"]
        final = stream.get_final_completion().choices[0].message
    assert contents and set(contents) == {None} and final.content is None and final.tool_calls


def _reply(server_url: str, body: dict, stream: bool) -> tuple[str | None, list[list[str]], str]:
    """(content, [[name, arguments] per call], finish_reason) of one chat reply, streamed or whole."""
    if not stream:
        choice = httpx.post(server_url + CHAT, json=body, timeout=300).json()["choices"][0]
        calls = choice["message"].get("tool_calls") or []
        return (choice["message"]["content"], [[c["function"]["name"], c["function"]["arguments"]] for c in calls],
                choice["finish_reason"])
    content, calls, reason = "", {}, None
    with httpx.stream("POST", server_url + CHAT, json=body | {"stream": True}, timeout=300) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[len("data: "):])["choices"][0]
            content += choice["delta"].get("content") or ""
            for delta in choice["delta"].get("tool_calls") or []:
                call = calls.setdefault(delta["index"], ["", ""])
                call[0] += delta["function"].get("name") or ""
                call[1] += delta["function"].get("arguments") or ""
            reason = choice["finish_reason"] or reason
    return content or None, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("case", ["unknown function", "known function", "required, cut", "auto, cut"])
def test_a_streamed_reply_hands_over_the_calls_the_whole_reply_does(server_url, case):
    # the regexes stand in for what a model may write in auto mode: a call of a function the request does not
    # have is content in both modes (a client must never receive a call it did not offer); a reply cut by
    # max_tokens hands over its partial call in both modes, finish_reason length (as OpenAI's API does)
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "temperature": 0,
            "max_tokens": 64, "tools": [WEATHER]}
    call = '<tool_call>{"name": "NAME", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
    if case == "unknown function":
        body["guided_regex"] = re.escape(call.replace("NAME", "get_time"))
        expected = (call.replace("NAME", "get_time"), [], "stop")
    elif case == "known function":
        body["guided_regex"] = re.escape(call.replace("NAME", "get_weather"))
        expected = (None, [["get_weather", '{"city": "Paris", "unit": "celsius"}']], "tool_calls")
    elif case == "required, cut":
        body |= {"tool_choice": "required", "max_tokens": 20}
        expected = None
    else:
        body |= {"guided_regex": re.escape(call.replace("NAME", "get_weather")), "max_tokens": 20}
        expected = None
    whole, streamed = _reply(server_url, body, stream=False), _reply(server_url, body, stream=True)
    assert whole == streamed
    if expected is not None:
        assert whole == expected
    else:  # the call's name, then part of its arguments
        assert whole[0] is None and whole[2] == "length" and len(whole[1]) == 1, whole
        assert whole[1][0][0] == "get_weather" and whole[1][0][1].startswith("{") and not whole[1][0][1].endswith("}")


# integer bounds at the ends of 64 bits: each of these ended the server with a segmentation fault in llguidance
CRASHING = [{"type": "integer", "minimum": -2**63 + 1, "maximum": -2**63 + 2},
            {"type": "integer", "minimum": -2**63, "maximum": -2**63},
            {"type": ["integer", "null"], "minimum": -2**63 + 1, "maximum": -2**63 + 2, "multipleOf": 3}]


@pytest.mark.parametrize("schema", CRASHING[:2])
@pytest.mark.parametrize("field", ["response_format", "guided_json", "structured_outputs", "completions",
                                   "tool_choice"])
def test_integer_bounds_at_the_ends_of_64_bits_are_refused_and_the_server_serves_on(server_url, schema, field):
    body = {"messages": [{"role": "user", "content": "A number"}], "temperature": 0, "max_tokens": 8}
    path, param = CHAT, field
    if field == "response_format":
        body["response_format"], param = schema_format(schema), "response_format.json_schema.schema"
    elif field == "guided_json":
        body["guided_json"] = schema
    elif field == "structured_outputs":
        body["structured_outputs"], param = {"json": schema}, "structured_outputs.json"
    elif field == "completions":
        path, body = "/v1/completions", {"prompt": "A number:", "max_tokens": 8, "guided_json": json.dumps(schema)}
        param = "guided_json"
    else:
        tool = {"type": "function", "function": {"name": "pick", "parameters": {
            "type": "object", "properties": {"n": schema}, "required": ["n"]}}}
        body |= {"tools": [tool], "tool_choice": "required"}
        param = "tools.0.function.parameters"
    response = httpx.post(server_url + path, json=body, timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert param in error["message"] and "no value kvserve can generate" in error["message"], error
    after = chat(server_url, "Hi", response_format=schema_format({"type": "integer", "minimum": 1, "maximum": 9}))
    assert after.status_code == 200 and 1 <= int(after.json()["choices"][0]["message"]["content"]) <= 9


@pytest.mark.parametrize("schema", [
    {"type": "integer", "minimum": 0, "maximum": 2**64 - 1},              # served as at most 2^62
    {"type": "integer", "minimum": -2**70, "maximum": -5},
    {"type": "integer", "exclusiveMinimum": 2**61, "exclusiveMaximum": 2**66},
    {"type": "number", "minimum": -1e300, "maximum": 1e300},               # refused by the compiler before
    {"type": "number", "minimum": 0.1, "maximum": 0.1},
    {"type": "object", "properties": {"n": {"type": ["integer", "string"], "minimum": 2**63, "maximum": 2**64}},
     "required": ["n"]},                                                   # only a string can be generated
])
@pytest.mark.parametrize("temperature", [0, 1])
def test_what_is_generated_validates_against_the_schema_as_the_client_sent_it(server_url, schema, temperature):
    response = chat(server_url, "Give a value", response_format=schema_format(schema), temperature=temperature,
                    max_tokens=48, seed=7)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


@pytest.mark.parametrize("schema, where, why", [
    ({"type": "integer", "minimum": 2**63, "maximum": 2**63 + 1}, "/", "integer within ±2^62"),
    ({"type": "number", "minimum": 1e20, "maximum": 1e20}, "/", "within ±10^18"),
    ({"type": "number", "minimum": 1e-30, "maximum": 2e-30}, "/", "at most 20 digits"),
    ({"type": "integer", "exclusiveMinimum": 5, "exclusiveMaximum": 6}, "/", "no integer"),
    ({"properties": {"a": {"type": "array", "minItems": 2**40}}}, "/properties/a/minItems", "limit"),
    ({"$defs": {"n": {"type": "integer", "minimum": -2**63, "maximum": -2**63}}, "$ref": "#/$defs/n"},
     "/$defs/n", "integer within"),
])
def test_a_schema_whose_numbers_cannot_be_generated_is_refused_by_where(schema, where, why):
    from kvserve.server.schema_numbers import SchemaNumberError, bounded

    with pytest.raises(SchemaNumberError) as caught:
        bounded(schema)
    assert str(caught.value).startswith(where + " ") and why in str(caught.value)


def test_bounds_are_narrowed_never_widened_and_the_clients_schema_is_untouched():
    from kvserve.server.schema_numbers import INTEGER_LIMIT, bounded

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": -2**80, "exclusiveMaximum": 2**64},
                                               "x": {"type": "number", "maximum": 1e300},
                                               "s": {"type": ["integer", "string"], "minimum": 2**63}}}
    original = json.dumps(schema)
    out = bounded(schema)
    assert json.dumps(schema) == original
    assert out["properties"]["n"] == {"type": "integer", "minimum": -INTEGER_LIMIT, "maximum": INTEGER_LIMIT}
    assert out["properties"]["x"] == {"type": "number", "maximum": 10**18}
    assert out["properties"]["s"] == {"type": "string"}
    plain = {"type": "integer", "minimum": 1, "maximum": 9}
    assert bounded(plain) is plain


def test_a_grammar_that_crashes_the_compiler_ends_only_the_worker(smollm2):
    """Compiled without the server's checks: the worker process dies, the grammar is refused, and the next one
    compiles in a new worker."""
    from kvserve.engine.compile_worker import CompileSandbox
    from kvserve.engine.constraints import GrammarError

    tokenizer = smollm2.tokenizer
    sandbox = CompileSandbox(tokenizer, [tokenizer.eos_token_id])
    compiler = GrammarCompiler(tokenizer, [tokenizer.eos_token_id], sandbox=sandbox)
    try:
        for schema in CRASHING:
            with pytest.raises(GrammarError, match="crashed on this grammar"):
                compiler.compile(GrammarSpec("json_schema", json.dumps(schema)))
            grammar = compiler.compile(GrammarSpec("json_schema", json.dumps({"type": "integer", "maximum": 5})))
            assert grammar.constraint() is not None
        with pytest.raises(GrammarError, match="invalid regex"):  # the worker's own refusals pass through
            compiler.compile(GrammarSpec("regex", "["))
    finally:
        sandbox.close()


@pytest.mark.parametrize("field", ["guided_grammar", "structured_outputs"])
def test_a_gbnf_grammar_constrains_as_a_lark_one_does(server_url, field):
    """docs/api.md: guided_grammar takes Lark or GBNF. GBNF went to the Lark parser and was a 400."""
    grammar = 'root ::= answer "."\nanswer ::= "yes" | "no"'
    extra = {"guided_grammar": grammar} if field == "guided_grammar" else {"structured_outputs": {"grammar": grammar}}
    response = chat(server_url, "Is the sky blue?", max_tokens=8, temperature=0, **extra)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] in ("yes.", "no.")
    assert response.json()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("call", ['{"name": "get_weather", "arguments": {bad}}',
                                  '{"name": "nope", "arguments": {"city": "Rome"}}'])
def test_an_auto_reply_that_is_not_a_call_to_a_given_function_comes_back_as_content(server_url, call):
    """tool_choice auto does not constrain the reply: a call whose arguments are not JSON, or to a function the
    request did not give, is the model's text (as vLLM's Hermes parser returns it), not a tool call a client
    would run."""
    reply = f"<tool_call>{call}</tool_call>"
    response = chat(server_url, "What is the weather in Rome?", tools=[WEATHER], max_tokens=48,
                    guided_regex=re.escape(reply))
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["message"].get("tool_calls") is None and choice["message"]["content"] == reply
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_an_auto_reply_whose_calls_put_arguments_before_name_is_handed_over_as_calls(server_url, stream):
    """A model may write a call's keys in the other order (`{"arguments": ..., "name": ...}`); vLLM's Hermes
    parser reads each block with json.loads, so key order does not matter there. Here such a reply was content.
    Now its calls are handed over, streamed or not: such a block's arguments as json.dumps writes them, a
    name-first block's as the model wrote them."""
    reply = ('<tool_call>{"arguments": {"city": "Rome", "unit": "celsius"}, "name": "get_weather"}</tool_call>\n'
             '<tool_call>{"name": "get_weather", "arguments": {"city":"Oslo","unit":"celsius"}}</tool_call>')
    body = {"messages": [{"role": "user", "content": "Weather in Rome and Oslo?"}], "tools": [WEATHER],
            "max_tokens": 80, "guided_regex": re.escape(reply)}
    content, calls, reason = _reply(server_url, body, stream)
    assert content is None and reason == "tool_calls", (content, calls, reason)
    assert calls == [["get_weather", '{"city": "Rome", "unit": "celsius"}'],
                     ["get_weather", '{"city":"Oslo","unit":"celsius"}']]


_ROME = '<tool_call>{"arguments": {"city": "Zürich"}, "name": "get_weather"}</tool_call>'
_OSLO = '<tool_call>{"name": "get_weather", "arguments": {"city":"Oslo"}}</tool_call>'
_DEEP = '{"x": ' + "[" * 1000 + "]" * 1000 + "}"  # past Python's recursion limit for json


@pytest.mark.parametrize("text, reason, calls", [
    (_ROME, "stop", ['{"city": "Zürich"}']),  # re-serialized as json.dumps(ensure_ascii=False) writes it
    (_OSLO + "\n" + _ROME, "stop", ['{"city":"Oslo"}', '{"city": "Zürich"}']),  # name first: its own bytes
    (_ROME + " " + _OSLO, "stop", ['{"city": "Zürich"}', '{"city":"Oslo"}']),
    (_ROME + " and so", "stop", ['{"city": "Zürich"}']),  # text after the calls dropped, as for name-first ones
    (_OSLO + " and so", "stop", ['{"city":"Oslo"}']),
    # not calls: content, all of it
    ('<tool_call>{"arguments": {"city": "Rome"}, "name": "nope"}</tool_call>', "stop", None),  # not a given function
    ('<tool_call>{"arguments": {"city": "Rome"}, "name": "get_weather", "id": 1}</tool_call>', "stop", None),
    ('<tool_call>{"arguments": "Rome", "name": "get_weather"}</tool_call>', "stop", None),  # not an object
    ('<tool_call>{"arguments": {"city": "Rome"}, "name": "get_weather"}', "length", None),  # cut short
    (f'<tool_call>{{"arguments": {_DEEP}, "name": "get_weather"}}</tool_call>', "stop", None),  # too deep to read
    (f'<tool_call>{{"name": "get_weather", "arguments": {_DEEP}}}</tool_call>', "stop", None),
])
def test_an_auto_reply_is_calls_whatever_its_keys_order_or_else_all_content(text, reason, calls):
    # vLLM's Hermes parser reads each block with json.loads: key order does not matter, text after the blocks is
    # dropped; a reply that is not calls of the request's functions is content (and nesting too deep for
    # Python's json, a 500 once, too)
    from kvserve.server.tools import ToolCallStream

    stream = ToolCallStream(frozenset({"get_weather"}))
    sent = [stream.feed(text[i:i + 7]) for i in range(0, len(text), 7)]
    assert all(piece == ("", []) for piece in sent)
    content, deltas = stream.finish(reason)
    if calls is None:
        assert (content, deltas, stream.calls) == (text, [], [])
    else:
        assert content == "" and [d["function"]["arguments"] for d in deltas] == calls
        assert [d["index"] for d in deltas] == list(range(len(calls)))
        assert {d["function"]["name"] for d in deltas} == {"get_weather"}


ITEMS = {"type": "object", "required": ["items"], "properties": {"items": {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "qty": {"type": "integer"}},
    "required": ["name", "qty"]}}}}


@pytest.mark.parametrize("schema, max_tokens", [
    (ITEMS, 40), (ITEMS, 60),
    ({"type": "object", "properties": {"b": {"type": "string", "format": "email"}}, "required": ["b"]}, 40),
    ({"type": "object", "properties": {"b": {"type": "string", "format": "uri"}}, "required": ["b"]}, 40),
    ({"type": "object", "properties": {"b": {"type": "string", "pattern": "^[a-z0-9-]+@[a-z]+\\.com$"}},
      "required": ["b"]}, 40),
])
def test_a_reply_closes_within_the_budget_where_one_token_opens_a_long_way_to_close(server_url, schema, max_tokens):
    """engine.closing: in an array of objects one `},` adds a whole item to the closing path (more than the fixed
    slack), and a string whose format or pattern refuses the closing quote was forced one token at a time from a
    fresh walk each step (which repeated its first token without end). Both ended `length` with broken JSON."""
    response = chat(server_url, "Order 2 apples and 3 pears, then tell me where Barcelona is.", max_tokens=max_tokens,
                    response_format=schema_format(schema))
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_a_pattern_with_unicode_classes_is_served(server_url):
    """ECMA-262's \\p{L} is valid in a JSON Schema pattern and the grammar compiler takes it; the metaschema check
    went through Python's re, which lacks it, and refused the schema as "not a 'regex'"."""
    schema = {"type": "object", "properties": {"w": {"type": "string", "pattern": "^\\p{L}{1,12}$"}}, "required": ["w"]}
    response = chat(server_url, "One word for joy", max_tokens=40, response_format=schema_format(schema))
    assert response.status_code == 200, response.text
    word = json.loads(response.json()["choices"][0]["message"]["content"])["w"]
    assert 1 <= len(word) <= 12 and word.isalpha()
