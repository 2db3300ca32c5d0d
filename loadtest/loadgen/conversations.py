"""Multi-turn chat conversations driven at an OpenAI-compatible server, each turn resending the growing history; and
many tenants' long system prompts, each shared by all the tenant's requests.

A conversation's opening is unique to it, so its prefix is cached only where its earlier turns were served: the
workload that tells a cache-aware router from round robin (``python -m kvserve.loadtest cluster``). The system
prompts, more than one replica's cache holds, tell a router that knows what each replica holds (its KV events) from
one that guesses.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx

_WORDS = ("river stone lantern orchard signal harbor meadow copper window ladder engine garden violet "
          "compass winter ember canyon thread marble falcon pepper saddle quartz tundra velvet".split())


@dataclass(frozen=True)
class Workload:
    """Multi-turn chat: ``conversations`` of ``turns`` each, ``concurrency`` conversations at a time.

    The opening (system) message is ``opening_words`` words unique to the conversation (so no two share a
    cached block); each later turn appends the reply and a ``followup_words``-word question, after a think time.
    """

    conversations: int = 12
    turns: int = 4
    # not a multiple of the replica count: conversations moving in lockstep would meet round robin's cycle
    # and keep their replica by accident
    concurrency: int = 4
    max_tokens: int = 12
    opening_words: int = 160
    followup_words: int = 20
    think_s: float = 0.5  # a user reads the reply: a random pause of up to this before the next turn (s)
    timeout_s: float = 120.0  # one request, start to [DONE]
    ignore_eos: bool = False  # replies run to max_tokens (kvserve's extension): streams that last by construction


@dataclass
class Result:
    """One streamed request as the client saw it (times in s since the phase started)."""

    conversation: int
    turn: int
    start_s: float
    end_s: float = 0.0
    status: int = 0
    ttft_s: float | None = None
    done: bool = False  # [DONE] arrived
    error: str | None = None
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error is None


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


async def _one(client: httpx.AsyncClient, messages: list[dict], workload: Workload | SystemPrompts, result: Result,
               t0: float) -> None:
    body = {"messages": messages, "max_tokens": workload.max_tokens, "stream": True, "temperature": 0}
    if workload.ignore_eos:
        body["ignore_eos"] = True
    sent = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 timeout=httpx.Timeout(workload.timeout_s, connect=10.0)) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = (await response.aread()).decode(errors="replace")[:200]
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    result.done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # kvserve's error event
                    result.error = f"error event: {chunk['error'].get('message', '')}"[:200]
                    break
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece and result.ttft_s is None:
                        result.ttft_s = time.perf_counter() - sent
                    result.text += piece
        if not result.done and result.error is None:
            result.error = "stream ended without [DONE]"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200] or type(exc).__name__
    finally:
        result.end_s = time.perf_counter() - t0


async def run_conversations(base_url: str, workload: Workload, tag: str, deadline_s: float,
                            results: list[Result] | None = None) -> list[Result]:
    """Drive the workload at ``base_url``; a conversation stops at its first failed turn.

    ``tag`` makes every opening unique to this run (a later run never hits an earlier one's cache);
    ``results`` (appended to as requests start) lets a caller watch progress. Returns every request's Result.
    """
    results = [] if results is None else results
    t0 = time.perf_counter()
    gate = asyncio.Semaphore(workload.concurrency)

    async def conversation(i: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(f"{tag}-{i}")
        # The opening is the system message: without one, SmolLM2's template inserts its default system prompt,
        # a block every conversation shares, which every policy hits on every replica
        messages = [{"role": "system", "content": f"Conversation {tag}-{i}. Answer questions about these words: "
                                                  f"{_words(rng, workload.opening_words)}."},
                    {"role": "user", "content": "Which word comes first?"}]
        async with gate:
            for turn in range(workload.turns):
                if time.perf_counter() - t0 > deadline_s:
                    return
                result = Result(i, turn, time.perf_counter() - t0)
                results.append(result)
                await _one(client, messages, workload, result, t0)
                if not result.ok:
                    return
                messages += [{"role": "assistant", "content": result.text},
                             {"role": "user", "content": f"And then? {_words(rng, workload.followup_words)}"}]
                await asyncio.sleep(rng.uniform(0, workload.think_s))

    async with httpx.AsyncClient(base_url=base_url, limits=httpx.Limits(max_connections=64)) as client:
        await asyncio.gather(*(conversation(i, client) for i in range(workload.conversations)))
    return results


@dataclass(frozen=True)
class SystemPrompts:
    """Many tenants, each with a long system prompt of its own that all its requests share (agents, RAG templates):
    ``requests`` single-turn chats, ``concurrency`` at a time, each with one of ``prompts`` system prompts of
    ``prompt_words`` words (chosen at random, seeded) and a short question of its own. With more prompts than one
    replica's KV pool holds, where a request lands decides whether its prompt is prefilled again.
    """

    prompts: int = 12
    prompt_words: int = 300
    requests: int = 96
    concurrency: int = 4
    max_tokens: int = 8
    question_words: int = 8
    timeout_s: float = 120.0
    ignore_eos: bool = True  # every reply runs to max_tokens: the same decode work under every policy


async def run_system_prompts(base_url: str, workload: SystemPrompts, tag: str, deadline_s: float) -> list[Result]:
    """Drive ``workload`` at ``base_url``; ``tag`` makes the system prompts unique to this run (no policy meets the
    previous one's cache). Returns every request's Result (``conversation`` is the system prompt's index)."""
    rng = random.Random(tag)
    systems = [f"Tenant {tag}-{k}. You answer questions about these words only: "
               f"{_words(random.Random(f'{tag}-{k}'), workload.prompt_words)}." for k in range(workload.prompts)]
    picks = [rng.randrange(workload.prompts) for _ in range(workload.requests)]
    questions = [_words(rng, workload.question_words) for _ in range(workload.requests)]
    results: list[Result] = []
    t0 = time.perf_counter()
    gate = asyncio.Semaphore(workload.concurrency)

    async def one(i: int, client: httpx.AsyncClient) -> None:
        async with gate:
            if time.perf_counter() - t0 > deadline_s:
                return
            result = Result(picks[i], 0, time.perf_counter() - t0)
            results.append(result)
            messages = [{"role": "system", "content": systems[picks[i]]},
                        {"role": "user", "content": f"Which of these comes first: {questions[i]}?"}]
            await _one(client, messages, workload, result, t0)

    async with httpx.AsyncClient(base_url=base_url, limits=httpx.Limits(max_connections=64)) as client:
        await asyncio.gather(*(one(i, client) for i in range(workload.requests)))
    return results
