"""clients/: the sync and async clients and the CLI against a fake OpenAI-style SSE server, plus one live run.

The fake server emits the documented chunk format (same id on every chunk, finish_reason and ``timings`` on the
final chunk, a ``choices: []`` usage chunk, ``data: [DONE]``). What it does is chosen by the prompt text:
BUSY -> 429 with Retry-After, BAD -> 400, BOOM -> an error event after two chunks, CUT -> no [DONE], TWO -> n=2.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.clients import AsyncKVServeClient, KVServeClient, KVServeError, ServerTimings
from kvserve.clients.cli import main as cli_main
from kvserve.clients.stream import parse_retry_after

PIECES = ["Hel", "lo", ",", " wor", "ld", " 😀", " 中文"]
TEXT = "".join(PIECES)
TIMINGS = {"queue_ms": 1.5, "ttft_ms": 12.25, "decode_tokens_per_s": 40.0, "prompt_tokens": 9,
           "completion_tokens": len(PIECES), "cached_tokens": 4}
USAGE = {"prompt_tokens": 9, "completion_tokens": len(PIECES), "total_tokens": 9 + len(PIECES)}


def _fake_app(requests: list[dict]) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": "test"}]}

    async def respond(request: Request, chat: bool):
        body = await request.json()
        requests.append(body)
        prompt = json.dumps(body["messages"] if chat else body["prompt"])
        if "BUSY" in prompt:
            error = {"message": "the queue is full (256 waiting)", "type": "rate_limit_error", "param": None,
                     "code": "queue_full"}
            return JSONResponse({"error": error}, status_code=429, headers={"Retry-After": "7"})
        if "BAD" in prompt:
            error = {"message": "max_tokens must be >= 1", "type": "invalid_request_error",
                     "param": "max_tokens", "code": None}
            return JSONResponse({"error": error}, status_code=400)

        def chunk(index: int, text: str, finish: str | None = None) -> str:
            delta = {"delta": {"content": text}} if chat else {"text": text}
            data = {"id": "cmpl-1", "object": "chat.completion.chunk" if chat else "text_completion",
                    "model": "fake-model", "choices": [{"index": index, **delta, "finish_reason": finish}]}
            if finish is not None:
                data["timings"] = TIMINGS
            return f"data: {json.dumps(data)}\n\n"

        async def events():
            if chat:  # the role-only first chunk OpenAI sends: no text, must not count as the first token
                yield ("data: " + json.dumps({"id": "cmpl-1", "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}) + "\n\n")
            yield ": ping\n\n"
            for position, piece in enumerate(PIECES):
                await asyncio.sleep(0.005)
                yield chunk(0, piece)
                if "TWO" in prompt:
                    yield chunk(1, piece.upper())
                if "BOOM" in prompt and position == 1:
                    yield 'data: {"error": {"message": "engine loop died", "type": "internal_error"}}\n\n'
                    return
                if "CUT" in prompt and position == 1:
                    return
            yield chunk(0, "", "length")
            if "TWO" in prompt:
                yield chunk(1, "", "stop")
            if body.get("stream_options", {}).get("include_usage"):
                yield "data: " + json.dumps({"id": "cmpl-1", "choices": [], "usage": USAGE}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await respond(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await respond(request, chat=False)

    return app


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[str, list[dict]]]:
    """(base URL, list of request bodies received) of a fake server on a free 127.0.0.1 port."""
    requests: list[dict] = []
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(_fake_app(requests), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", requests
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def test_sync_chat_joins_text_and_reads_timings(fake):
    url, requests = fake
    with KVServeClient(url) as client:
        with client.stream_chat("hello", system="be brief", max_tokens=7, temperature=0.0, seed=3) as stream:
            deltas = list(stream)
    result = stream.result
    assert deltas == PIECES
    assert result.text == TEXT
    assert result.finish_reason == "length"
    assert result.id == "cmpl-1"
    assert result.server_timings == ServerTimings(1.5, 12.25, 40.0, 9, 7, 4)
    assert result.usage == USAGE
    assert result.completion_tokens == 7
    assert result.text_deltas == 7
    assert 0 < result.ttft_s <= result.last_token_s <= result.elapsed_s
    assert result.tokens_per_s == pytest.approx(6 / (result.last_token_s - result.ttft_s))
    body = requests[-1]
    assert body["model"] == "fake-model"  # looked up from /v1/models
    assert body["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    assert (body["stream"], body["stream_options"]) == (True, {"include_usage": True})
    assert (body["max_tokens"], body["temperature"], body["seed"]) == (7, 0.0, 3)


def test_sync_completion_with_token_ids(fake):
    url, requests = fake
    with KVServeClient(url, model="m") as client:
        result = client.complete([1, 2, 3], max_tokens=7, ignore_eos=True)
    assert result.text == TEXT
    assert requests[-1]["prompt"] == [1, 2, 3]
    assert requests[-1]["model"] == "m"
    assert requests[-1]["ignore_eos"] is True
    assert "temperature" not in requests[-1]  # None fields are left to the server's defaults


def test_async_chat_and_completion(fake):
    url, _ = fake

    async def run():
        async with AsyncKVServeClient(url) as client:
            stream = await client.stream_chat([{"role": "user", "content": "hi"}], max_tokens=7)
            async with stream:
                deltas = [delta async for delta in stream]
            completion = await client.complete("Once upon", max_tokens=7)
            return deltas, stream.result, completion

    deltas, chat, completion = asyncio.run(run())
    assert "".join(deltas) == TEXT == chat.text == completion.text
    assert chat.server_timings.ttft_ms == 12.25
    assert completion.finish_reason == "length"


def test_two_choices_are_joined_separately(fake):
    url, _ = fake
    with KVServeClient(url) as client:
        result = client.chat("TWO", n=2)
    assert result.texts == [TEXT, TEXT.upper()]
    assert result.finish_reasons == ["length", "stop"]


def test_429_carries_message_and_retry_after(fake):
    url, _ = fake
    with KVServeClient(url) as client, pytest.raises(KVServeError) as caught:
        client.chat("BUSY")
    error = caught.value
    assert (error.status_code, error.retry_after_s, error.code) == (429, 7.0, "queue_full")
    assert error.message == "the queue is full (256 waiting)"
    assert str(error) == "HTTP 429: the queue is full (256 waiting) (rate_limit_error); retry after 7 s"


def test_400_names_the_field(fake):
    url, _ = fake
    with KVServeClient(url) as client, pytest.raises(KVServeError) as caught:
        client.complete("BAD")
    assert (caught.value.status_code, caught.value.param) == (400, "max_tokens")
    assert caught.value.retry_after_s is None


def test_error_event_mid_stream_is_raised_after_the_text_so_far(fake):
    url, _ = fake
    deltas = []
    with KVServeClient(url) as client, pytest.raises(KVServeError) as caught:
        with client.stream_chat("BOOM") as stream:
            for delta in stream:
                deltas.append(delta)
    assert deltas == PIECES[:2]
    assert caught.value.status_code is None
    assert caught.value.message == "engine loop died"
    with pytest.raises(RuntimeError):
        stream.result  # noqa: B018 - the property raises on an unfinished stream


def test_stream_without_done_is_an_error(fake):
    url, _ = fake
    with KVServeClient(url) as client, pytest.raises(KVServeError, match=r"\[DONE\]"):
        client.complete("CUT")


def test_cli_streams_text_then_timings(fake, capsys):
    url, requests = fake
    assert cli_main(["chat", "hello", "--url", url, "--max-tokens", "7", "--system", "sys"]) == 0
    out, err = capsys.readouterr()
    assert out == TEXT + "\n"
    assert "TTFT" in err and "tokens/s" in err
    assert "server: TTFT 12 ms, queue 2 ms, 40.0 tokens/s, 9 prompt tokens (4 cached)" in err
    assert requests[-1]["messages"][0] == {"role": "system", "content": "sys"}
    assert cli_main(["complete", "Once", "--url", url]) == 0
    assert capsys.readouterr().out == TEXT + "\n"
    assert requests[-1]["max_tokens"] == 64  # a one-shot answer, not 256 tokens of a small model repeating itself


def test_cli_reports_429_with_retry_after(fake, capsys):
    url, _ = fake
    assert cli_main(["chat", "BUSY", "--url", url]) == 1
    err = capsys.readouterr().err
    assert "HTTP 429: the queue is full (256 waiting)" in err
    assert "retry after 7 s" in err


def test_cli_reports_unreachable_server(capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens here now
    assert cli_main(["chat", "hi", "--url", f"http://127.0.0.1:{port}"]) == 1
    assert f"cannot reach http://127.0.0.1:{port}" in capsys.readouterr().err


def test_parse_retry_after():
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after("0.5") == 0.5
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date in the past: retry now


def test_live_server_stream_matches_non_streamed(server_url):
    """The real server: streamed text joins to the non-streamed text; timings agree with the token counts."""
    prompt = "Write one sentence about the sea."
    with KVServeClient(server_url) as client:
        result = client.chat(prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
        body = {"model": client.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12,
                "temperature": 0.0, "ignore_eos": True}
        plain = httpx.post(f"{server_url}/v1/chat/completions", json=body, timeout=120).json()
    assert result.text == plain["choices"][0]["message"]["content"]
    assert result.finish_reason == "length"
    assert result.completion_tokens == 12 == result.usage["completion_tokens"]
    assert result.server_timings.prompt_tokens == result.usage["prompt_tokens"] > 0
    assert result.server_timings.ttft_ms > 0
    assert result.ttft_s is not None and result.tokens_per_s is not None


def test_live_full_queue_gives_429_with_retry_after(smollm2, capsys):
    from kvserve.server.config import ServeConfig
    from tests.serverutil import running_server

    with running_server(smollm2, ServeConfig(kv_cache_memory="16MiB", max_queue=0)) as url:
        with KVServeClient(url) as client, pytest.raises(KVServeError) as caught:
            client.chat("hi", max_tokens=2)
        assert cli_main(["chat", "hi", "--url", url]) == 1
        # refused before its prompt is tokenized (a flood is refused at once): a prompt over the context, which
        # tokenizing would refuse with a 400, gets the 429
        long = httpx.post(url + "/v1/completions", json={"prompt": "word " * 20_000, "max_tokens": 1}, timeout=60)
        assert long.status_code == 429 and long.headers["retry-after"], long.text
    assert caught.value.status_code == 429 and caught.value.code == "queue_full"
    assert caught.value.retry_after_s is not None and caught.value.retry_after_s >= 1
    assert f"retry after {caught.value.retry_after_s:g} s" in capsys.readouterr().err


# The official openai SDK against the live server: the shapes tools built on the OpenAI API rely on.

@pytest.fixture(scope="module")
def sdk(server_url):
    from openai import OpenAI

    with OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client, client.models.list().data[0].id


GREEDY = {"temperature": 0.0, "max_tokens": 16}
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a large river."}]


def test_sdk_chat_streamed_equals_non_streamed_with_usage_chunk(sdk):
    client, model = sdk
    full = client.chat.completions.create(model=model, messages=CHAT, **GREEDY)
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content != ""
    assert len({c.id for c in chunks}) == 1
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == []
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens differ: the 2nd run hits
    assert [getattr(chunks[-1].usage, key) for key in counts] == [getattr(full.usage, key) for key in counts]
    assert all(c.usage is None for c in chunks[:-1])
    usage = full.usage
    assert usage.prompt_tokens + usage.completion_tokens == usage.total_tokens
    assert full.timings["completion_tokens"] == usage.completion_tokens  # the extra field rides along
    without = list(client.chat.completions.create(model=model, messages=CHAT, stream=True, **GREEDY))
    assert all(c.usage is None and c.choices for c in without)


def test_sdk_completions_text_and_token_ids_agree(sdk, server_url):
    client, model = sdk
    prompt = "The three primary colors are"
    full = client.completions.create(model=model, prompt=prompt, **GREEDY)
    streamed = "".join(c.choices[0].text for c in client.completions.create(model=model, prompt=prompt,
                                                                              stream=True, **GREEDY))
    ids = httpx.post(f"{server_url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    by_ids = client.completions.create(model=model, prompt=ids, **GREEDY)
    assert streamed == full.choices[0].text == by_ids.choices[0].text != ""
    assert full.usage.prompt_tokens == by_ids.usage.prompt_tokens == len(ids)


def test_sdk_stop_string_cuts_before_it(sdk):
    client, model = sdk
    prompt = "Count: one, two, three,"
    text = client.completions.create(model=model, prompt=prompt, temperature=0.0, max_tokens=24,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = text.strip().split()[1]  # a word a few tokens into the greedy answer
    expected = text[:text.index(stop)]
    cut = client.completions.create(model=model, prompt=prompt, temperature=0.0, max_tokens=24, stop=[stop])
    streamed = list(client.completions.create(model=model, prompt=prompt, temperature=0.0, max_tokens=24,
                                              stop=[stop], stream=True))
    assert cut.choices[0].text == expected == "".join(c.choices[0].text for c in streamed)
    assert cut.choices[0].finish_reason == "stop" == streamed[-1].choices[0].finish_reason


def test_sdk_n2_greedy_choices_match_n1(sdk):
    client, model = sdk
    one = client.chat.completions.create(model=model, messages=CHAT, **GREEDY)
    two = client.chat.completions.create(model=model, messages=CHAT, n=2, **GREEDY)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.message.content for c in two.choices] == [one.choices[0].message.content] * 2
    assert two.usage.completion_tokens == 2 * one.usage.completion_tokens
    assert two.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt is counted once


def test_sdk_logprobs(sdk):
    client, model = sdk
    chat = client.chat.completions.create(model=model, messages=CHAT, logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(max(top.logprob for top in entry.top_logprobs))  # greedy: top-1
    assert "".join(entry.token for entry in content) == chat.choices[0].message.content
    scored = client.completions.create(model=model, prompt="The sky is blue.", max_tokens=1, temperature=0.0,
                                       echo=True, logprobs=1)
    logprobs = scored.choices[0].logprobs
    assert len(logprobs.tokens) == scored.usage.prompt_tokens + 1
    assert logprobs.token_logprobs[0] is None and all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert scored.choices[0].text.startswith("The sky is blue.")
