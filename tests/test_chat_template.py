"""Chat templates as untrusted code (a bounded sandbox, checked at start-up) and what the Llama / Mistral / Qwen
families expect of the chat API: the template's own rendering of tools and system prompts, chat_template_kwargs,
a thinking model's reasoning apart from its answer, and the end-of-turn token as a stop token.

The Qwen3-shaped template (tests/data/qwen3_shape.jinja) is written for these tests; SmolLM2's tokenizer has its
ChatML tokens (<|im_start|>, <|im_end|>), and <think> tags are plain text to it, which the parser reads alike."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import httpx
import pytest
from jinja2.exceptions import TemplateError

from kvserve.server.chat_template import ChatTemplate, end_of_turn_ids, special_tokens
from kvserve.server.config import ServeConfig
from kvserve.server.reasoning import ReasoningSplit
from kvserve.server.state import ServerState
from tests.serverutil import serving

QWEN3_SHAPE = (Path(__file__).parent / "data" / "qwen3_shape.jinja").read_text()
CHAT = "/v1/chat/completions"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def with_template(loaded, template: str):
    """``loaded`` with a copy of its tokenizer that carries ``template`` (the model's weights are shared)."""
    tokenizer = copy.deepcopy(loaded.tokenizer)
    tokenizer.chat_template = template
    return dataclasses.replace(loaded, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def qwen3_url(smollm2):
    state = ServerState(with_template(smollm2, QWEN3_SHAPE), ServeConfig(num_kv_blocks=64, block_size=16))
    with serving(state) as url:
        yield url


# -- the sandbox's bounds --------------------------------------------------------------------------------------

@pytest.mark.parametrize("source", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # 10^10 empty iterations
    "{% for m in messages %}{% for a in m.content %}{% for b in m.content %}{% endfor %}{% endfor %}{% endfor %}",
    "{{ 'x' * 10**9 }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{% set ns = namespace(s=['a']) %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{{ 'a'|center(10**9) }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ '%999999999s' % 'a' }}",
    "{{ 10 ** 100000 }}",
    "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{{ messages[0].content + 1 }}",
])
def test_a_template_past_a_bound_or_failing_is_a_template_error(source):
    """Each of these held a CPU for minutes, took gigabytes, or raised a Python error through transformers'
    renderer (a 500 per request); here each is a TemplateError (a 400) within a fraction of a second."""
    template = ChatTemplate(source, {}, max_chars=1 << 20)
    with pytest.raises(TemplateError):
        template.render([{"role": "user", "content": "y" * 3000}])


def test_the_bounded_sandbox_renders_as_transformers_does(smollm2):
    tokenizer = smollm2.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nLet me check.", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "sunny"}]
    for source in (tokenizer.chat_template, QWEN3_SHAPE):
        ours = ChatTemplate(source, special_tokens(tokenizer), 1 << 20).render(messages, tools=[WEATHER])
        assert ours == tokenizer.apply_chat_template(messages, tools=[WEATHER], tokenize=False,
                                                     add_generation_prompt=True, chat_template=source)


@pytest.mark.parametrize("source,why", [
    ("{% if %}", "does not compile"),
    ("{{ raise_exception('this template renders nothing') }}", "cannot render a one-message chat"),
    ("{% for m in messages %}{{ m.content + 1 }}{% endfor %}", "cannot render a one-message chat"),
])
def test_a_broken_template_stops_the_start_with_one_line(smollm2, source, why):
    with pytest.raises(ValueError) as refused:
        ServerState(with_template(smollm2, source), ServeConfig(num_kv_blocks=4, block_size=16))
    assert why in str(refused.value) and "\n" not in str(refused.value)


def test_a_template_that_fails_on_some_messages_is_a_400_and_the_server_serves_on(smollm2):
    source = ("{% for m in messages %}{{ m.content }}{% if loop.index > 1 %}{{ m.content + 1 }}{% endif %}"
              "{% endfor %}")
    with serving(ServerState(with_template(smollm2, source), ServeConfig(num_kv_blocks=8))) as url:
        two = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
        refused = httpx.post(url + CHAT, json={"messages": two, "max_tokens": 1}, timeout=60)
        assert refused.status_code == 400 and "TypeError" in refused.json()["error"]["message"], refused.text
        one = httpx.post(url + CHAT, json={"messages": two[:1], "max_tokens": 1}, timeout=60)
        assert one.status_code == 200


# -- the Qwen3-shaped template: tools, system, chat_template_kwargs ---------------------------------------------

def _prompt(url: str, **body) -> str:
    response = httpx.post(url + "/tokenize", json=body, timeout=60)
    assert response.status_code == 200, response.text
    detok = httpx.post(url + "/detokenize", json={"tokens": response.json()["tokens"]}, timeout=60)
    return detok.json()["prompt"]


def test_tools_and_system_prompt_render_as_the_template_writes_them(qwen3_url):
    prompt = _prompt(qwen3_url, messages=[{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER])
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "\n<tools>\n" + json.dumps(WEATHER) + "\n</tools>\n" in prompt
    assert "You can call functions" not in prompt  # kvserve's own tool prompt is only for templates without tools
    assert prompt.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_kwargs_reach_the_template(qwen3_url):
    messages = [{"role": "user", "content": "Hi"}]
    thinking = _prompt(qwen3_url, messages=messages)
    direct = _prompt(qwen3_url, messages=messages, chat_template_kwargs={"enable_thinking": False})
    assert not thinking.endswith("</think>\n\n") and direct == thinking + "<think>\n\n</think>\n\n"
    refused = httpx.post(qwen3_url + CHAT, json={"messages": messages, "max_tokens": 1,
                                                 "chat_template_kwargs": {"messages": []}}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs.messages"


# -- reasoning ----------------------------------------------------------------------------------------------------

THINK_THEN_ANSWER = r"<think>[a-z]{3,12}( [a-z]{3,12}){0,3}</think>\n\n[A-Z][a-z]{2,12}\."


def _stream(url: str, body: dict) -> list[dict]:
    response = httpx.post(url + CHAT, json=body | {"stream": True}, timeout=120)
    assert response.status_code == 200, response.text
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_thinking_is_returned_as_reasoning_content_whole_and_streamed(qwen3_url):
    body = {"messages": [{"role": "user", "content": "Think, then name a colour."}], "max_tokens": 48,
            "temperature": 0, "guided_regex": THINK_THEN_ANSWER}
    whole = httpx.post(qwen3_url + CHAT, json=body, timeout=120)
    assert whole.status_code == 200, whole.text
    message = whole.json()["choices"][0]["message"]
    assert message["reasoning_content"] and message["reasoning"] == message["reasoning_content"]
    assert "<think>" not in message["reasoning_content"] and "think>" not in message["content"]
    assert message["content"][0].isupper() and message["content"].endswith(".")
    deltas = [chunk["choices"][0]["delta"] for chunk in _stream(qwen3_url, body)]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)


def test_an_assistant_prefill_that_opens_thinking_is_continued_as_reasoning(qwen3_url):
    """continue_final_message with an assistant message "<think>Hmm" left open: the reply continues the reasoning
    (cut here before any </think>: all reasoning), as when the generation prompt opens the block; a prefill without
    one is continued as answer, a user's own "<think>" text opening nothing. (A prefill that closes its block
    cannot be continued here: this template drops a turn's reasoning, so the final message is not shown as given:
    a 400.)"""
    def reply(messages):
        body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False,
                "max_tokens": 6, "temperature": 0}
        whole = httpx.post(qwen3_url + CHAT, json=body, timeout=120)
        assert whole.status_code == 200, whole.text
        deltas = [chunk["choices"][0]["delta"] for chunk in _stream(qwen3_url, body)]
        message = whole.json()["choices"][0]["message"]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == (message["reasoning_content"] or "")
        assert "".join(d.get("content") or "" for d in deltas) == (message["content"] or "")
        return message

    user = {"role": "user", "content": "What does <think> mean?"}
    message = reply([user, {"role": "assistant", "content": "<think>Hmm"}])
    assert message["reasoning_content"] and message["content"] is None
    message = reply([user, {"role": "assistant", "content": "It"}])
    assert message["reasoning_content"] is None and message["content"]


def test_a_constraint_starts_after_the_thinking_the_prompt_opened(qwen3_url, smollm2):
    """A forced choice, JSON or tool call on a prompt that opened <think> (here an assistant prefill): the model
    thinks unconstrained and the grammar starts past its "</think>" (vLLM's rule with a reasoning parser), so the
    constrained text is the content, not the reasoning. The bias makes this model write "</think>" at once; cut
    before it, the reply is all reasoning and ends for its length (the grammar never began), not in an error."""
    end = smollm2.tokenizer("</think>", add_special_tokens=False)["input_ids"]
    prefill = [{"role": "user", "content": "Yes or no?"}, {"role": "assistant", "content": "<think>Hmm"}]
    body = {"messages": prefill, "continue_final_message": True, "add_generation_prompt": False, "temperature": 0,
            "guided_choice": ["yes", "no"]}
    whole = httpx.post(qwen3_url + CHAT, json=body | {"max_tokens": 12, "logit_bias": {t: 40 for t in end}},
                       timeout=120).json()["choices"][0]
    assert whole["message"]["content"] in ("yes", "no") and whole["finish_reason"] == "stop", whole
    assert "</think>" not in (whole["message"]["reasoning_content"] or "")
    forced = {key: value for key, value in body.items() if key != "guided_choice"} | {
        "tools": [WEATHER], "tool_choice": "required", "max_tokens": 60, "logit_bias": {t: 40 for t in end}}
    called = httpx.post(qwen3_url + CHAT, json=forced, timeout=120).json()["choices"][0]
    assert called["finish_reason"] == "tool_calls", called
    assert called["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    cut = httpx.post(qwen3_url + CHAT, json=body | {"max_tokens": 4}, timeout=120).json()["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"] is None, cut
    assert cut["message"]["reasoning_content"] not in ("yes", "no")


def test_without_thinking_the_reply_is_all_content(qwen3_url):
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": False}}
    message = httpx.post(qwen3_url + CHAT, json=body, timeout=120).json()["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"]


def test_no_reasoning_fields_for_a_template_that_does_not_think(server_url):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    message = httpx.post(server_url + CHAT, json=body, timeout=60).json()["choices"][0]["message"]
    assert "reasoning_content" not in message


@pytest.mark.parametrize("thinking,pieces,reasoning,answer", [
    (False, ["<thi", "nk>a b", "</th", "ink>\n\n", "Yes."], "a b", "Yes."),
    (True, ["a b", "</think>", "  Yes."], "a b", "Yes."),     # the prompt opened the block (DeepSeek-R1's template)
    (False, ["Plain", " text <think>"], "", "Plain text <think>"),
    (True, ["cut before the end </thi"], "cut before the end </thi", ""),  # a reply cut while thinking
    (False, ["<", "b>bold</b>"], "", "<b>bold</b>"),
])
def test_the_split_holds_back_what_may_be_a_tag(thinking, pieces, reasoning, answer):
    split = ReasoningSplit(thinking)
    outputs = [split.feed(piece) for piece in pieces] + [split.finish()]
    assert "".join(r for r, _ in outputs) == reasoning and "".join(a for _, a in outputs) == answer


# -- stop tokens --------------------------------------------------------------------------------------------------

def test_the_token_that_ends_an_assistant_turn_is_a_stop_token(smollm2):
    tokenizer = smollm2.tokenizer
    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert endoftext not in ServerState(smollm2, ServeConfig(num_kv_blocks=4)).eos_ids
    own_end = "{% for m in messages %}{{ m.role }}: {{ m.content }}<|endoftext|>{% endfor %}" \
              "{% if add_generation_prompt %}assistant: {% endif %}"
    state = ServerState(with_template(smollm2, own_end), ServeConfig(num_kv_blocks=4))
    assert endoftext in state.eos_ids
    plain = ChatTemplate("{% for m in messages %}{{ m.content }}\n{% endfor %}", {}, 1 << 20)
    assert end_of_turn_ids(plain, tokenizer) == set()
    assert end_of_turn_ids(ChatTemplate(QWEN3_SHAPE, {}, 1 << 20), tokenizer) == {
        tokenizer.convert_tokens_to_ids("<|im_end|>")}


# DeepSeek-R1's shape: the generation prompt opens the thinking block, so the reply starts as reasoning
R1_SHAPE = QWEN3_SHAPE.replace("{{- '<|im_start|>assistant\\n' }}\n{%- if enable_thinking",
                               "{{- '<|im_start|>assistant\\n<think>\\n' }}\n{%- if enable_thinking")


def test_the_responses_api_returns_reasoning_as_a_reasoning_item(smollm2):
    """A reply cut while thinking is all reasoning: the chat API's reasoning_content, the Responses API's
    reasoning item (before an empty message), streamed as reasoning_text events the SDK's types accept."""
    import typing

    from openai.types.responses import Response, ResponseStreamEvent

    assert R1_SHAPE != QWEN3_SHAPE
    kinds = {typing.get_args(cls.model_fields["type"].annotation)[0]: cls
             for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}
    state = ServerState(with_template(smollm2, R1_SHAPE), ServeConfig(num_kv_blocks=32, block_size=16))
    with serving(state) as url:
        question = "Name a colour."
        chat = httpx.post(url + CHAT, timeout=120, json={
            "messages": [{"role": "user", "content": question}], "max_tokens": 6, "temperature": 0}).json()
        message = chat["choices"][0]["message"]
        assert message["content"] is None and message["reasoning_content"]
        body = {"input": question, "max_output_tokens": 6, "temperature": 0}
        whole = Response.model_validate(httpx.post(url + "/v1/responses", json=body, timeout=120).json())
        assert [item.type for item in whole.output] == ["reasoning", "message"]
        assert whole.output[0].content[0].text == message["reasoning_content"] and whole.output_text == ""
        streamed = httpx.post(url + "/v1/responses", json=body | {"stream": True}, timeout=120)
        events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")]
        for event in events:
            kinds[event["type"]].model_validate(event)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
        assert deltas == message["reasoning_content"]
        final = Response.model_validate(events[-1]["response"])
        done = [e["item"]["id"] for e in events if e["type"] == "response.output_item.done"]
        assert final.status == "incomplete" and [item.id for item in final.output] == done
        assert [item.type for item in final.output] == ["reasoning", "message"]
