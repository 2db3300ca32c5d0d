"""``python -m kvserve.loadtest structured``: what constrained decoding costs.

1. Grammar compile time of every test schema (tests/data/structured_schemas.json) with the served model's
   tokenizer, cold and on a cache hit, and the mask time per token for 1 and 32 sequences (in-process); the
   same fill without a token budget and with one (the closing path walked each step), side by side.
2. Output tokens/s of a served model under 32 concurrent clients (closed loop: each sends its next request when
   the last one ends), three loads on one server: all unconstrained, all constrained to a mid-sized schema, and
   10% constrained. Every request runs to ``max_tokens`` (unconstrained ones ignore EOS; the schema's output is
   longer than ``max_tokens``; a reply that ends early is counted and reported), with the same prompt, so the
   loads do the same model work and differ only by the masks. After a warm-up round, the three loads run in
   ``--rounds`` rounds, each in another order (a load's place in a round does not favour it); each ratio is
   taken against the unconstrained load of its own round, so a slow spell of a shared machine cancels out, and
   the median and the range of the rounds are reported.

Talks only to 127.0.0.1 and stops by itself (a bounded number of requests).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx

from kvserve.loadtest.procs.serverproc import kvserve_command, launch
from kvserve.loadtest.publish.benchmarks_md import update_section

SCHEMAS = Path(__file__).resolve().parents[2] / "tests" / "data" / "structured_schemas.json"
_ITEM = {"type": "object", "properties": {
    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
    "name": {"type": "string", "maxLength": 24},
    "qty": {"type": "integer", "minimum": 1, "maximum": 99},
    "category": {"enum": ["food", "tools", "books", "toys", "garden"]},
    "price": {"type": "number", "minimum": 0, "maximum": 1000}},
    "required": ["sku", "name", "qty", "category", "price"], "additionalProperties": False}
# mid-sized: nested objects, an array, enums, a pattern, bounds; its output is longer than the runs' max_tokens
MID_SCHEMA = {"type": "object", "properties": {
    "order_id": {"type": "string", "format": "uuid"},
    "customer": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                                  "email": {"type": "string", "format": "email"}},
                 "required": ["name", "email"], "additionalProperties": False},
    "items": {"type": "array", "items": _ITEM, "minItems": 20, "maxItems": 30}},
    "required": ["order_id", "customer", "items"], "additionalProperties": False}
PROMPT = "Write a large shop order as JSON: a customer and many items."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients (default 32)")
    parser.add_argument("--requests", type=int, default=2, help="requests per client per run (default 2)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default 32)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three loads (default 3)")
    parser.add_argument("--compile-only", action="store_true", help="only the compile and mask figures (no server)")
    parser.add_argument("--closing-only", action="store_true", help="only the closing-path cost per step (no server)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")


def _trajectory(tokenizer) -> list[int]:
    """The tokens of one MID_SCHEMA order, its last 3 cut (the masks of a reply still open)."""
    text = json.dumps({"order_id": "0b7e4f0e-3c1a-4d55-9a8e-5f2d1c3b4a6e",
                       "customer": {"name": "Ada", "email": "ada@example.com"},
                       "items": [{"sku": "ABC-1234", "name": "Hammer", "qty": 2, "category": "tools", "price": 9.5}]})
    return tokenizer(text, add_special_tokens=False)["input_ids"][:-3]


def _compile_figures() -> tuple[list[float], list[float], dict[int, float]]:
    """Cold compile ms per test schema, cache-hit ms, and mask ms per step (fill and apply to the logits) for 1 and
    32 sequences."""
    import torch

    from kvserve.engine.constraints import GrammarCompiler, GrammarSpec
    from kvserve.engine.masks import apply_masks, fill_masks
    from kvserve.engine.loader import load_model
    from kvserve.server.structured import json_schema_spec

    tokenizer = load_model(None).tokenizer
    compiler = GrammarCompiler(tokenizer, [tokenizer.eos_token_id])
    compiler.tokenizer()  # built once per server (its own figure in the log), not per schema
    cold, hit = [], []
    for entry in json.loads(SCHEMAS.read_text()):
        spec = json_schema_spec(entry["schema"], "schema")
        start = time.perf_counter()
        compiler.compile(spec)
        cold.append((time.perf_counter() - start) * 1000)
        start = time.perf_counter()
        compiler.compile(spec)
        hit.append((time.perf_counter() - start) * 1000)
    grammar = compiler.compile(GrammarSpec("json_schema", json.dumps(MID_SCHEMA)))
    ids = _trajectory(tokenizer)
    masks_ms = {}
    for rows in (1, 32):
        constraints = [grammar.constraint() for _ in range(rows)]
        logits = torch.zeros(rows, compiler.vocab_size)  # [rows, vocab]
        times = []
        for step in range(1, len(ids)):
            start = time.perf_counter()
            apply_masks(logits, list(range(rows)), fill_masks(constraints, [ids[:step]] * rows))
            times.append((time.perf_counter() - start) * 1000)
        masks_ms[rows] = statistics.median(times)
    return cold, hit, masks_ms


def _closing_figures(repeats: int = 1) -> dict[int, tuple[float, float, float, float]]:
    """What the closing path costs: mask fill (``fill_masks``) of each step of the mid-sized schema's trajectory,
    without a budget and with a far one (the path walked every RECHECK_EVERY tokens), side by side in one run
    (interleaved per step; each step once, as served: a walk happens on the steps it is due), and one walk
    alone; per rows (1, 32): (mean ms without, mean ms with, mean path tokens, us per path token of a walk)."""
    from transformers import AutoTokenizer

    from kvserve.engine.closing import closing_path
    from kvserve.engine.constraints import GrammarCompiler, GrammarSpec
    from kvserve.engine.masks import fill_masks
    from kvserve.engine.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    compiler = GrammarCompiler(tokenizer, [tokenizer.eos_token_id])
    grammar = compiler.compile(GrammarSpec("json_schema", json.dumps(MID_SCHEMA)))
    ids = _trajectory(tokenizer)
    figures = {}
    for rows in (1, 32):
        plain = [grammar.constraint() for _ in range(rows)]
        budgeted = [grammar.constraint(10_000) for _ in range(rows)]
        without, with_budget, lengths, walks = [], [], [], []
        for step in range(1, len(ids)):
            for constraints, times in ((plain, without), (budgeted, with_budget)):
                best = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    fill_masks(constraints, [ids[:step]] * rows)
                    best = min(best, time.perf_counter() - start)
                times.append(best * 1000)
            c = budgeted[0]
            start = time.perf_counter()
            lengths.append(len(closing_path(c.matcher, c.lex[-1], c.table, 10_000) or []))
            walks.append(time.perf_counter() - start)
        figures[rows] = (statistics.mean(without), statistics.mean(with_budget), statistics.mean(lengths),
                         sum(walks) / sum(lengths) * 1e6)
    return figures


def _closing_body(figures: dict[int, tuple[float, float, float, float]]) -> str:
    from kvserve.engine.closing import RECHECK_EVERY

    lines = ["| rows | mask fill per step, no budget (ms) | with a far budget (ms) | ratio |", "|---|---|---|---|"]
    for rows, (without, with_budget, _, _) in figures.items():
        lines.append(f"| {rows} | {without:.3f} | {with_budget:.3f} | {with_budget / without:.2f}x |")
    path, per_token = figures[1][2], figures[1][3]
    return ("\n".join(lines) + f"\n\nMid-sized schema (the loads' `MID_SCHEMA`, at least 20 items: a long path), "
            f"each step of one order's trajectory once (mean over steps, both variants interleaved per step); "
            f"a far budget walks the path every {RECHECK_EVERY} tokens, all rows on the first step. One walk "
            f"costs {per_token:.1f} us "
            f"per path token ({path:.0f} tokens on average here, {path * per_token / 1000:.2f} ms); nearer the "
            f"budget it is walked after a quarter of the gap to the point of forcing, capped at the tokens left. It "
            f"runs on the mask thread, during the forward pass.\n")


LOADS = ("unconstrained", "all constrained", "10% constrained")


async def _run_load(url: str, clients: int, requests: int, max_tokens: int, constrained: int) -> tuple[float, int]:
    """Output tokens/s with ``constrained`` of the ``clients`` constrained to MID_SCHEMA, and how many replies
    ended before ``max_tokens`` (which would make the loads' model work differ)."""
    tokens, short = 0, 0

    async def client(index: int, http: httpx.AsyncClient) -> None:
        nonlocal tokens, short
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens, "temperature": 0}
        if index < constrained:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "order", "schema": MID_SCHEMA}}
        else:
            body["ignore_eos"] = True
        for _ in range(requests):
            response = await http.post(url + "/v1/chat/completions", json=body, timeout=600)
            response.raise_for_status()
            produced = response.json()["usage"]["completion_tokens"]
            tokens += produced
            short += produced < max_tokens

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 4)) as http:
        warm = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2,
                "response_format": {"type": "json_schema", "json_schema": {"name": "order", "schema": MID_SCHEMA}}}
        (await http.post(url + "/v1/chat/completions", json=warm, timeout=600)).raise_for_status()  # compile once
        start = time.perf_counter()
        await asyncio.gather(*(client(i, http) for i in range(clients)))
        return tokens / (time.perf_counter() - start), short


def _ratio_cell(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def run(args: argparse.Namespace) -> int:
    closing = _closing_body(_closing_figures())
    print(closing)
    if not args.no_write:
        update_section("structured-closing", "Structured outputs: closing within the budget, cost per step",
                       "python -m kvserve.loadtest structured --closing-only", closing)
    if args.closing_only:
        return 0
    cold, hit, masks_ms = _compile_figures()
    compile_body = (f"Grammar compile time of the {len(cold)} test schemas (llguidance, SmolLM2's 49,152-token "
                    f"vocabulary; the tokenizer is converted once per server): p50 {statistics.median(cold):.1f} ms, "
                    f"max {max(cold):.1f} ms; a cache hit {statistics.median(hit) * 1000:.0f} us. Mask per decode "
                    f"step (mid-sized schema, p50; filled, then applied to the logits): {masks_ms[1]:.2f} ms for 1 "
                    f"sequence, {masks_ms[32]:.2f} ms for 32 (the fill runs on its own thread while the forward pass "
                    f"runs).\n")
    print(compile_body)
    if not args.no_write:
        update_section("structured-compile", "Structured outputs: grammar compile and mask time",
                       "python -m kvserve.loadtest structured --compile-only", compile_body)
    if args.compile_only:
        return 0
    constrained = {"unconstrained": 0, "all constrained": args.clients,
                   "10% constrained": max(1, round(args.clients / 10))}
    rates: dict[str, list[float]] = {label: [] for label in LOADS}
    short = 0
    with launch(kvserve_command(["--max-num-seqs", str(args.clients)]), name="structured") as server:
        for label in LOADS:  # warm-up, not counted: first-touch allocations, thread start-up
            asyncio.run(_run_load(server.url, args.clients, 1, args.max_tokens, constrained[label]))
        for round_index in range(args.rounds):
            order = LOADS[round_index % len(LOADS):] + LOADS[:round_index % len(LOADS)]
            for label in order:
                rate, ended_early = asyncio.run(_run_load(server.url, args.clients, args.requests, args.max_tokens,
                                                          constrained[label]))
                rates[label].append(rate)
                short += ended_early
                print(f"round {round_index + 1} {label}: {rate:.1f} output tokens/s", flush=True)
    base = rates["unconstrained"]
    ratios = {label: [r / b for r, b in zip(rates[label], base)] for label in LOADS}
    body = (f"| {args.clients} clients, {args.max_tokens} tokens per request, greedy | output tokens/s (median of "
            f"{args.rounds} rounds) | vs unconstrained: median (range) | target |\n|---|---|---|---|\n"
            f"| unconstrained | {statistics.median(base):.1f} | 1.00x | |\n"
            f"| all constrained (mid-sized schema) | {statistics.median(rates['all constrained']):.1f} | "
            f"{_ratio_cell(ratios['all constrained'])} | >= 0.9x |\n"
            f"| 10% constrained | {statistics.median(rates['10% constrained']):.1f} | "
            f"{_ratio_cell(ratios['10% constrained'])} | >= 0.97x |\n\n"
            f"Replies that ended before {args.max_tokens} tokens: {short} (the loads did the same model work when 0).\n")
    print(body)
    if not args.no_write:
        command = (f"python -m kvserve.loadtest structured --clients {args.clients} --requests {args.requests} "
                   f"--max-tokens {args.max_tokens} --rounds {args.rounds}")
        update_section("structured", "Structured outputs: the cost of token masks under load", command, body)
    return 0
