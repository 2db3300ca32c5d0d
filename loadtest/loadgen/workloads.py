"""Workloads: what the load generator sends. Each request is one ``RequestSpec``; a workload is a list of them.

- ``seed64``: the shared 64-request workload with skewed output lengths (median 18, longest 231, 1,874 tokens).
  Every request asks for exactly its length: ``max_tokens = min_tokens = length`` and ``ignore_eos``, so a
  server cannot finish early and every policy produces the same tokens in total.
- ``chat``: chat-shaped requests that share one long system prompt (what prefix caching is for).
- ``fixed``: N identical-length requests (peers: 128-token outputs, or a 512-token prompt for TTFT).
"""

from __future__ import annotations

import enum
import json
import random
from dataclasses import dataclass
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
SEED64_SHARED = _REPO.parent / "shared" / "workloads" / "seed64.json"
SEED64_LOCAL = Path(__file__).resolve().parent / "workloads" / "seed64.json"

_TOPICS = ("the sea", "a lighthouse", "bread", "the moon", "a fox", "rain", "an old clock", "trains",
           "mountains", "a library", "bees", "winter", "a violin", "the desert", "a garden", "rivers")

SYSTEM_PROMPT = (
    "You are a patient assistant for a public library. Answer in plain English, in short paragraphs. "
    "When a question is about borrowing, mention that loans last three weeks and can be renewed twice "
    "online. When a question is about opening hours, say that the library opens at nine and closes at "
    "eight on weekdays, and closes at five on Saturdays. Never invent a book title; if unsure, suggest "
    "asking a librarian at the front desk. Keep every answer friendly, factual and under a hundred words."
)
_QUESTIONS = ("How long can I keep a book?", "When do you open on Saturday?", "Can I renew a loan online?",
              "Do you have books about bees?", "Where do I return a book after hours?",
              "Can children get a library card?", "Is there a quiet room for study?",
              "How do I reserve a book that is out?")


class Endpoint(enum.Enum):
    """Which OpenAI route a request goes to."""

    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


@dataclass(slots=True, frozen=True)
class RequestSpec:
    """One request of a workload.

    Attributes:
        endpoint: the route.
        prompt: the text prompt (completions) or None.
        messages: chat messages (chat) or None.
        max_tokens: output length asked for (tokens).
        exact: pin the output length (``ignore_eos`` and ``min_tokens = max_tokens``).
    """

    endpoint: Endpoint
    prompt: str | None
    messages: tuple[tuple[str, str], ...] | None
    max_tokens: int
    exact: bool = True

    def body(self, model: str) -> dict:
        """The JSON request body (streamed, greedy, with a final usage chunk)."""
        body: dict = {"model": model, "max_tokens": self.max_tokens, "temperature": 0.0, "stream": True,
                      "stream_options": {"include_usage": True}}
        if self.endpoint is Endpoint.CHAT:
            body["messages"] = [{"role": role, "content": content} for role, content in self.messages or ()]
        else:
            body["prompt"] = self.prompt
        if self.exact:
            body["ignore_eos"] = True
            body["min_tokens"] = self.max_tokens
        return body


class WorkloadName(enum.Enum):
    """``--workload`` choices."""

    SEED64 = "seed64"
    CHAT = "chat"
    FIXED = "fixed"


def seed64_lengths(path: Path | None = None) -> list[int]:
    """Output lengths of seed64 (tokens), from the shared file or the copy under loadtest/loadgen/workloads/.

    Raises:
        FileNotFoundError: neither file exists.
    """
    for candidate in ([path] if path else [SEED64_SHARED, SEED64_LOCAL]):
        if candidate.exists():
            return [int(n) for n in json.loads(candidate.read_text())["output_tokens"]]
    raise FileNotFoundError(f"seed64.json not found at {SEED64_SHARED} or {SEED64_LOCAL}")


def seed64_prompt(i: int) -> str:
    """A short prompt for request ``i`` (about 15 tokens); prompts differ so no prefix is shared."""
    return f"Request {i}: write a few plain sentences about {_TOPICS[i % len(_TOPICS)]}, number {i * 7 % 101}."


def seed64(path: Path | None = None) -> list[RequestSpec]:
    """The 64 seed requests, in file order, each pinned to its output length."""
    return [RequestSpec(Endpoint.COMPLETIONS, seed64_prompt(i), None, n) for i, n in enumerate(seed64_lengths(path))]


def chat(count: int = 32, seed: int = 0, min_tokens: int = 16, max_tokens: int = 96) -> list[RequestSpec]:
    """Chat requests sharing ``SYSTEM_PROMPT``, with uniform random output lengths in [min_tokens, max_tokens]."""
    rng = random.Random(seed)
    return [RequestSpec(Endpoint.CHAT, None, (("system", SYSTEM_PROMPT), ("user", _QUESTIONS[i % len(_QUESTIONS)])),
                        rng.randint(min_tokens, max_tokens)) for i in range(count)]


def fixed(count: int, max_tokens: int, prompt: str | None = None) -> list[RequestSpec]:
    """``count`` completions of exactly ``max_tokens`` tokens each, with distinct short prompts by default."""
    return [RequestSpec(Endpoint.COMPLETIONS, prompt if prompt is not None else seed64_prompt(i), None, max_tokens)
            for i in range(count)]


def repeated_word_prompt(num_tokens: int, word: str = " hello") -> str:
    """A prompt of ``num_tokens`` copies of ``word``; " hello" is one token each in SmolLM2's BPE vocabulary."""
    return word * num_tokens


def build(name: WorkloadName, count: int | None = None, max_tokens: int = 128) -> list[RequestSpec]:
    """A named workload; ``count`` trims seed64 or sizes chat/fixed."""
    if name is WorkloadName.SEED64:
        specs = seed64()
        return specs[:count] if count else specs
    if name is WorkloadName.CHAT:
        return chat(count or 32)
    return fixed(count or 32, max_tokens)
