"""``python -m kvserve.loadtest peers --prefill``: prefill side by side: TTFT by prompt length, and the stall.

Per system, one server with a few slots and room for the longest prompt:
- TTFT of prompts of 512, 2,048 and 8,000 tokens (``--prefill-lengths``), one token out, each prompt starting
  with a different word so no prefix cache helps; the median of ``PROMPTS_PER_LENGTH`` prompts;
- the chunked-prefill stall: TTFT of short requests (32-token prompts, one token out, two at a time) alone, then
  while one prompt of the longest length is being prefilled: those sent after the long one and before its first
  token count, however long they waited. A server that gives them room beside the long prompt's chunks answers
  them within a step or two; one whose chunks take the whole step makes them wait for the whole prompt;
- kvserve's step times while the long prompt is prefilled (from its ``--step-log``: the median and longest wall
  time inside the runner of the steps that ended between the long prompt's send and its first token), so a short
  request's wait can be set against the steps it shared or sat behind.

The systems: llama.cpp's server (``python -m kvserve.loadtest llamacpp`` builds it), kvserve serving the file's
own blocks, and vLLM's CPU backend when ``python -m kvserve.loadtest vllm`` has installed it (outside the repo).
Figures are medians and percentiles in seconds; ratios are to kvserve (> 1: kvserve is faster).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from kvserve.loadtest.loadgen import workloads
from kvserve.loadtest.loadgen.client import RequestRecord, stream_request
from kvserve.loadtest.loadgen.report import median_over_repeats
from kvserve.loadtest.loadgen.runcmd import server_model

LENGTHS = (512, 2048, 8000)
PROMPTS_PER_LENGTH = 3
SLOTS = 4
SHORT_PROMPT_TOKENS = 32
SHORT_REQUESTS = 24  # alone; during the long prefill, as many as fit in it (two at a time)
SHORT_USERS = 2


@dataclass(slots=True)
class PrefillFigures:
    """One system's prefill figures (seconds); ``error`` says why a system could not be measured."""

    system: str
    ttft_s: dict[str, float] = field(default_factory=dict)  # str(prompt tokens) -> median TTFT
    short_alone_p50_s: float | None = None
    short_alone_p99_s: float | None = None
    short_during_p50_s: float | None = None
    short_during_p99_s: float | None = None
    short_during_count: int = 0
    long_ttft_s: float | None = None
    step_p50_s: float | None = None  # the server's steps during the long prefill (None: no step log)
    step_max_s: float | None = None
    steps: int = 0
    error: str | None = None


def prompt(tokens: int, key: int) -> workloads.RequestSpec:
    """A completion of one token whose prompt is about ``tokens`` tokens long in SmolLM2's vocabulary: a head that
    differs with ``key`` ("Part 17:", about 4 tokens), then " hello"s; no two keys share a prefix-cache block."""
    return workloads.fixed(1, 1, f"Part {key}:" + workloads.repeated_word_prompt(max(1, tokens - 4)))[0]


def context_tokens(lengths: tuple[int, ...] | list[int]) -> int:
    """Context a slot needs for the longest prompt, its token and the template's few tokens."""
    return max(lengths) + 64


async def _send(client: httpx.AsyncClient, spec: workloads.RequestSpec, model: str, start: float) -> RequestRecord:
    record = await stream_request(client, spec, model, 0, start, 1800.0)
    if not record.ok or record.ttft_s is None:
        raise RuntimeError(f"a request failed: status {record.status}, {record.error}")
    return record


async def _measure(url: str, lengths: list[int], step_log: Path | None) -> PrefillFigures:
    figures = PrefillFigures("")
    model = server_model(url)
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        start = time.perf_counter()
        await _send(client, prompt(SHORT_PROMPT_TOKENS, 0), model, start)  # warm-up
        for n, length in enumerate(lengths):
            ttfts = [(await _send(client, prompt(length, 1 + PROMPTS_PER_LENGTH * n + i), model, start)).ttft_s
                     for i in range(PROMPTS_PER_LENGTH)]
            figures.ttft_s[str(length)] = statistics.median(ttfts)
            print(f"  TTFT {length} tokens: {figures.ttft_s[str(length)]:.3f} s")

        async def shorts(count: int | None, until: asyncio.Event | None, first: int) -> list[RequestRecord]:
            records: list[RequestRecord] = []

            async def user(u: int) -> None:
                i = u
                while (count is None or i < count) and not (until is not None and until.is_set()):
                    spec = prompt(SHORT_PROMPT_TOKENS, first + i)
                    records.append(await _send(client, spec, model, start))
                    i += SHORT_USERS

            await asyncio.gather(*(user(u) for u in range(SHORT_USERS)))
            return records

        alone = [r.ttft_s for r in await shorts(SHORT_REQUESTS, None, 1000)]
        done = asyncio.Event()

        async def long_one() -> RequestRecord:
            try:
                return await _send(client, prompt(max(lengths), 999), model, start)
            finally:
                done.set()

        long_task = asyncio.create_task(long_one())
        await asyncio.sleep(0.05)  # the long prompt is admitted first
        during_records = await shorts(None, done, 2000)
        long_record = await long_task
        during = delayed(during_records, long_record)
    figures.short_alone_p50_s, figures.short_alone_p99_s = _p50_p99(alone)
    figures.short_during_p50_s, figures.short_during_p99_s = _p50_p99(during)
    figures.short_during_count, figures.long_ttft_s = len(during), long_record.ttft_s
    if step_log is not None:
        await asyncio.sleep(0.5)  # the server writes a step's line once its event loop takes the step
        sent = start + long_record.start_s
        durations = step_seconds(step_log.read_text(), sent, sent + long_record.ttft_s)
        figures.steps = len(durations)
        if durations:
            figures.step_p50_s, figures.step_max_s = statistics.median(durations), max(durations)
            print(f"  steps during the long prefill: {len(durations)}, p50/max {figures.step_p50_s:.3f}/"
                  f"{figures.step_max_s:.3f} s")
    print(f"  short TTFT alone p50/p99 {figures.short_alone_p50_s:.3f}/{figures.short_alone_p99_s:.3f} s; during a "
          f"{max(lengths)}-token prefill ({long_record.ttft_s:.1f} s): {len(during)} requests, p50/p99 "
          + (f"{figures.short_during_p50_s:.3f}/{figures.short_during_p99_s:.3f} s" if during else "-"))
    return figures


def delayed(shorts: list[RequestRecord], long: RequestRecord) -> list[float]:
    """TTFTs (s) of the short requests the long prompt's prefill could delay: those sent after it and before it got
    its first token, however long they then waited."""
    end = long.start_s + long.ttft_s
    return [r.ttft_s for r in shorts if long.start_s < r.start_s < end]


def step_seconds(step_log: str, after: float, until: float) -> list[float]:
    """Runner seconds of the steps in ``step_log`` (``kvserve serve --step-log`` text: one JSON line per step, its
    ``end_s`` on this machine's perf_counter() clock) that ended in (``after``, ``until``]."""
    steps = (json.loads(line) for line in step_log.splitlines() if line.strip())
    return [step["seconds"] for step in steps if after < step["end_s"] <= until]


def _p50_p99(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return float(np.median(values)), float(np.percentile(values, 99))


def measure_server(system: str, url: str, lengths: list[int], step_log: Path | None = None) -> PrefillFigures:
    """The prefill figures of the server at ``url`` (already started, with room for ``max(lengths)`` tokens);
    ``step_log``: the file its ``--step-log`` writes (kvserve), for the step times during the long prefill."""
    figures = asyncio.run(_measure(url, lengths, step_log))
    figures.system = system
    return figures


def render(results: dict[str, dict], lengths: list[int], served: str) -> str:
    """Markdown: TTFT per prompt length and the stall, one row per system, ratios to kvserve."""
    base = results.get("kvserve-gguf")

    def cell(r: dict, value: float | None, base_value: float | None) -> str:
        if value is None:
            return "-"
        ratio = f" ({value / base_value:.2f}x)" if base_value and r is not base else ""
        return f"{value:.2f} s{ratio}"

    head = ("| system | " + " | ".join(f"TTFT {n} tokens" for n in lengths)
            + f" | short p50 / p99 alone | short p50 / p99 during a {max(lengths)}-token prefill (n) "
            + "| step p50 / max during it (steps) | measured (UTC) |")
    rows = [head, "|---" * (len(lengths) + 5) + "|"]
    for name, r in results.items():
        if r.get("error"):
            rows.append(f"| {name} | failed: {r['error']} |" + " |" * (len(lengths) + 3))
            continue
        ttfts = [cell(r, r["ttft_s"].get(str(n)), (base or {}).get("ttft_s", {}).get(str(n))) for n in lengths]
        alone = (f"{r['short_alone_p50_s']:.3f} / {r['short_alone_p99_s']:.3f} s"
                 if r["short_alone_p50_s"] is not None else "-")
        during = (f"{r['short_during_p50_s']:.3f} / {r['short_during_p99_s']:.3f} s ({r['short_during_count']})"
                  if r["short_during_p50_s"] is not None else "none sent")
        steps = (f"{r['step_p50_s']:.3f} / {r['step_max_s']:.3f} s ({r['steps']})"
                 if r.get("step_p50_s") is not None else "-")
        rows.append(f"| {name} | " + " | ".join(ttfts) + f" | {alone} | {during} | {steps} "
                    f"| {r.get('measured_utc', '?')} |")
    return "\n".join(rows) + (
        f"\n\nEach system serves {served} with {SLOTS} slots and 2 threads. TTFT: the median of "
        f"{PROMPTS_PER_LENGTH} one-token completions whose prompts differ from the first token (in brackets, this "
        f"system's TTFT over kvserve's: > 1, kvserve is faster). Short requests: {SHORT_PROMPT_TOKENS}-token prompts, "
        f"one token out, {SHORT_USERS} at a time, first alone ({SHORT_REQUESTS} requests), then while one "
        f"{max(lengths)}-token prompt is prefilled (those sent after it and before its first token, n of them, "
        "however long they waited): a server whose prefill chunks leave room for them answers within a step or "
        "two; one whose chunks take the whole step answers them only after the long prompt's prefill. Steps "
        "(kvserve's --step-log): wall time inside the runner of the steps that ended while the long prompt was "
        "prefilled, so a short request's wait reads in steps. A row named with flags ran `kvserve serve` with "
        "them.")


def as_dict(figures: PrefillFigures) -> dict:
    return asdict(figures)


def median(figures: list[PrefillFigures]) -> dict:
    """Per-figure medians over repeats that succeeded (the last error if none did); the fewest short requests
    seen during the long prefill."""
    keys = ("short_alone_p50_s", "short_alone_p99_s", "short_during_p50_s", "short_during_p99_s", "long_ttft_s",
            "step_p50_s", "step_max_s")
    out = median_over_repeats(figures, keys, ("ttft_s",))
    if out["error"] is None:
        out["short_during_count"] = min(f.short_during_count for f in figures if f.error is None)
        out["steps"] = min(f.steps for f in figures if f.error is None)
    return out


def results_path(out_dir: Path, stem: str) -> Path:
    return out_dir / f"{stem}-prefill.json"
