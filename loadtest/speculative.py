"""``python -m loadtest speculative``: what speculative decoding (prompt lookup) gains and costs, served.

Three servers of the same model side by side: speculation off, ``--speculative ngram`` with
``--num-speculative-tokens auto`` and with a fixed γ (as peers ship it). For two workloads, extraction (a
document, then a request to quote part of it: the output copies the prompt) and free chat, and for 1, 8 and 32
concurrent clients (closed loop, greedy), it measures output tokens/s of each server, alternating between them
round by round so that a noisy machine weighs on all three alike, and reports the ratios to speculation off, the
acceptance rate (from each server's ``spec_decode`` counters) and, for the fixed γ at one stream, the speed-up
the chapter's formula predicts from that acceptance and the step-cost curve the auto server measured at start:

    predicted = E(γ) / (t(1 + γ) / t(1)),   E(γ) = (1 - α^(γ+1)) / (1 - α)

Greedy output is the same on all three servers (speculative decoding is exact), so each run does the same
model work. Talks only to 127.0.0.1 and stops by itself (a bounded number of requests).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import time

import httpx

from loadtest.benchmarks_md import update_section
from loadtest.serverproc import kvserve_command, launch
from scheduler.speculation import StepCost, expected_tokens

DOCUMENTS = [
    "The Harbour Street library opens at nine in the morning and closes at six in the evening on weekdays. On "
    "Saturdays it opens at ten and closes at four. It is closed on Sundays and public holidays. Members may "
    "borrow up to eight books at a time for three weeks. Books can be renewed twice online or at the front desk, "
    "unless another member has reserved them. Late returns cost twenty cents per book per day.",
    "To reset the router, unplug it from the wall and wait thirty seconds. Plug it back in and wait until the "
    "green light stops blinking. Then hold the reset button on the back for ten seconds with a paper clip. The "
    "router restarts with its factory settings: the network name and password are printed on the label under "
    "the device. Finally, open the setup page in a browser and choose a new password.",
    "Minutes of the garden committee. The committee agreed to plant twelve apple trees along the north fence in "
    "March. Maria will order the trees from the nursery on Elm Road before the end of January. The watering "
    "rota will start in April, with two volunteers each week. The budget for tools is three hundred euros, and "
    "any spending above fifty euros needs the approval of the treasurer.",
]
EXTRACTION = [f"{doc}\n\nCopy the text above word for word, then stop." for doc in DOCUMENTS]
CHAT = ["Write a short story about a dragon who is afraid of the dark.", "Explain how rainbows form.",
        "Give me some tips for learning to cook at home.", "What should I pack for a weekend camping trip?"]
WORKLOADS = {"extraction": EXTRACTION, "free chat": CHAT}
_COUNTERS = ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", default="1,8,32", help="concurrent clients, comma-separated (default 1,8,32)")
    parser.add_argument("--requests", type=int, default=2, help="requests per client per run (default 2)")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per request at most (default 96)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each server per point; median (default 2)")
    parser.add_argument("--gamma", type=int, default=4, help="the fixed draft length compared (default 4)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")


def _counters(url: str) -> tuple[float, float]:
    """(draft tokens, accepted tokens) so far, from /metrics (0, 0 without speculation)."""
    values = dict.fromkeys(_COUNTERS, 0.0)
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name = line.split("{", 1)[0].removeprefix("kvserve:")
        if name in values and not line.startswith("#"):
            values[name] = float(line.rsplit(" ", 1)[1])
    return values[_COUNTERS[0]], values[_COUNTERS[1]]


async def _load(url: str, prompts: list[str], clients: int, requests: int, max_tokens: int) -> float:
    """Output tokens/s of ``clients`` closed-loop clients sending ``requests`` each, cycling ``prompts``."""
    tokens = 0

    async def client(index: int, http: httpx.AsyncClient) -> None:
        nonlocal tokens
        for r in range(requests):
            body = {"messages": [{"role": "user", "content": prompts[(index + r) % len(prompts)]}],
                    "max_tokens": max_tokens, "temperature": 0}
            response = await http.post(url + "/v1/chat/completions", json=body, timeout=900)
            response.raise_for_status()
            tokens += response.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 4)) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(i, http) for i in range(clients)))
        return tokens / (time.perf_counter() - start)


def _step_costs(log_text: str) -> dict[int, float]:
    """The auto server's start-up step-cost curve (ms by tokens) from its log line."""
    match = re.search(r"step cost \(ms\) by tokens: (.*)", log_text)
    pairs = re.findall(r"(\d+): ([\d.]+)", match.group(1)) if match else []
    return {int(n): float(ms) for n, ms in pairs}


def run(args: argparse.Namespace) -> int:
    streams = [int(s) for s in args.streams.split(",")]
    slots = str(max(streams))
    modes = {"off": [], "auto": ["--speculative", "ngram"],
             f"γ={args.gamma}": ["--speculative", "ngram", "--num-speculative-tokens", str(args.gamma)]}
    rates: dict[tuple[str, int, str], list[float]] = {}
    acceptance: dict[tuple[str, int, str], tuple[float, float]] = {}
    with (launch(kvserve_command(["--max-num-seqs", slots] + modes["off"]), name="spec-off") as off,
          launch(kvserve_command(["--max-num-seqs", slots] + modes["auto"]), name="spec-auto") as auto,
          launch(kvserve_command(["--max-num-seqs", slots] + modes[f"γ={args.gamma}"]), name="spec-fixed") as fixed):
        servers = {"off": off, "auto": auto, f"γ={args.gamma}": fixed}
        for server in servers.values():  # warm-up: the first request pays one-time costs
            asyncio.run(_load(server.url, CHAT[:1], 1, 1, 8))
        for count in streams:
            for workload, prompts in WORKLOADS.items():
                for _ in range(args.rounds):
                    for mode, server in servers.items():
                        before = _counters(server.url)
                        rate = asyncio.run(_load(server.url, prompts, count, args.requests, args.max_tokens))
                        after = _counters(server.url)
                        key = (workload, count, mode)
                        rates.setdefault(key, []).append(rate)
                        drafted, accepted = acceptance.get(key, (0.0, 0.0))
                        acceptance[key] = (drafted + after[0] - before[0], accepted + after[1] - before[1])
                        print(f"{workload}, {count} streams, {mode}: {rate:.1f} tok/s", flush=True)
        costs = _step_costs(auto.log.read_text(errors="replace"))
    body = _report(rates, acceptance, costs, streams, args.gamma)
    print(body)
    if not args.no_write:
        command = (f"python -m loadtest speculative --streams {args.streams} --requests {args.requests} "
                   f"--max-tokens {args.max_tokens} --rounds {args.rounds} --gamma {args.gamma}")
        update_section("speculative", "Speculative decoding (prompt lookup), served side by side", command, body)
    return 0


def _report(rates, acceptance, costs: dict[int, float], streams: list[int], gamma: int) -> str:
    fixed = f"γ={gamma}"
    lines = [f"| workload | streams | off tok/s | auto tok/s | auto vs off | {fixed} tok/s | {fixed} vs off | "
             f"acceptance auto / {fixed} | predicted {fixed} vs off |", "|---|---|---|---|---|---|---|---|---|"]
    for workload in WORKLOADS:
        for count in streams:
            median = {mode: statistics.median(rates[(workload, count, mode)]) for mode in ("off", "auto", fixed)}
            alphas = []
            for mode in ("auto", fixed):
                drafted, accepted = acceptance[(workload, count, mode)]
                alphas.append(accepted / drafted if drafted else None)
            predicted = ""
            if count == 1 and alphas[1] is not None and costs:
                cost = StepCost(costs)  # the curve, interpolated as the auto server does
                predicted = f"{expected_tokens(alphas[1], gamma) / (cost(1 + gamma) / cost(1)):.2f}x"
            ratio = {mode: median[mode] / median["off"] for mode in ("auto", fixed)}
            cell = {mode: (f"**{ratio[mode]:.2f}x**" if ratio[mode] < 1 else f"{ratio[mode]:.2f}x")
                    for mode in ratio}
            shown = " / ".join("-" if a is None else f"{a:.0%}" for a in alphas)
            lines.append(f"| {workload} | {count} | {median['off']:.1f} | {median['auto']:.1f} | {cell['auto']} | "
                         f"{median[fixed]:.1f} | {cell[fixed]} | {shown} | {predicted} |")
    curve = ", ".join(f"{n}: {ms:.1f}" for n, ms in sorted(costs.items()))
    return ("\n".join(lines) + "\n\nRatios below 1x in bold. Acceptance: accepted / drafted tokens in those runs. "
            f"Step cost the auto server measured at start (ms by tokens in a decode step): {curve}.\n")
