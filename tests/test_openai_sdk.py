"""The official openai SDK, unmodified, against the live server."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def client(server_url):
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0)


def test_chat_non_streamed(client):
    response = client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=32,
                                              messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in response.choices[0].message.content
    assert response.choices[0].finish_reason in ("stop", "length")
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_chat_streamed_with_usage_chunk(client):
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=8,
                                            messages=[{"role": "system", "content": "Be brief."},
                                                      {"role": "user", "content": "Say hello"}],
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 8
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-2].choices[0].finish_reason in ("stop", "length")


def test_completions_streamed_and_not(client):
    whole = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The sky is", max_tokens=10,
                                      temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="The sky is", max_tokens=10, temperature=0, stream=True))
    assert streamed == whole.choices[0].text and whole.usage.completion_tokens <= 10


def test_stop_n2_and_logprobs(client):
    stopped = client.completions.create(model="SmolLM2-135M-Instruct", prompt="1, 2, 3, 4,", max_tokens=20,
                                        temperature=0, stop=[" 6"])
    assert " 6" not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    two = client.chat.completions.create(model="SmolLM2-135M-Instruct", n=2, max_tokens=6, seed=7,
                                         messages=[{"role": "user", "content": "Name an animal."}])
    assert [c.index for c in two.choices] == [0, 1]
    lp = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=3, temperature=0, logprobs=True,
                                        top_logprobs=3, messages=[{"role": "user", "content": "Hi"}])
    tokens = lp.choices[0].logprobs.content
    assert len(tokens) == lp.usage.completion_tokens and len(tokens[0].top_logprobs) == 3


def test_sdk_sees_openai_errors(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=7,
                                       messages=[{"role": "user", "content": "Hi"}])
    assert caught.value.body["param"] == "temperature"
    assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
