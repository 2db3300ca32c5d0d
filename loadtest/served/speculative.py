"""``python -m kvserve.loadtest speculative``: what speculative decoding gains and costs, served, and the chapter's table.

First the chapter's table (``loadtest.engine.spectable``: quantized copies of the model as drafts, in-process). Then
servers of the same model side by side: speculation off, ``--speculative ngram`` with
``--num-speculative-tokens auto`` and with a fixed γ (as peers ship it), and ``--speculative draft`` (the
served weights as an int4 draft) with auto. For two workloads, extraction (a
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
import contextlib
import re
import statistics
import time

import httpx

from kvserve.loadtest.procs.serverproc import kvserve_command, launch
from kvserve.loadtest.publish.benchmarks_md import update_section
from kvserve.speculation.policy import StepCost, expected_tokens

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
    parser.add_argument("--drafters", default="ngram,draft",
                        help="drafters served with auto, comma-separated: ngram, draft (default both)")
    parser.add_argument("--no-table", action="store_true",
                        help="skip the chapter's table (quantized copies as drafts, in-process)")
    parser.add_argument("--no-served", action="store_true", help="only the chapter's table: no servers")
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
    match = re.search(r"step cost by tokens (?:\([^)]*\))?: ([^;]*?) ms", log_text)
    pairs = re.findall(r"(\d+): ([\d.]+)", match.group(1)) if match else []
    return {int(n): float(ms) for n, ms in pairs}


def run(args: argparse.Namespace) -> int:
    if not args.no_table:
        from kvserve.loadtest.engine.spectable import table

        body = table()
        print(body)
        if not args.no_write:
            update_section("speculative-table", "Speculative decoding with quantized drafts: the chapter's table",
                           "python -m kvserve.loadtest speculative", body)
    if args.no_served:
        return 0
    streams = [int(s) for s in args.streams.split(",")]
    slots = str(max(streams))
    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    modes = {"off": []}
    for drafter in drafters:
        modes[f"{drafter} auto"] = ["--speculative", drafter]
    if "ngram" in drafters:
        modes[f"ngram γ={args.gamma}"] = ["--speculative", "ngram", "--num-speculative-tokens", str(args.gamma)]
    rates: dict[tuple[str, int, str], list[float]] = {}
    acceptance: dict[tuple[str, int, str], tuple[float, float]] = {}
    with contextlib.ExitStack() as stack:
        servers = {mode: stack.enter_context(launch(kvserve_command(["--max-num-seqs", slots] + flags),
                                                    name="spec-" + re.sub(r"\W+", "-", mode)))
                   for mode, flags in modes.items()}
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
        auto = next((servers[m] for m in servers if m.endswith(" auto")), None)
        costs = _step_costs(auto.log.read_text(errors="replace")) if auto is not None else {}
    body = _report(rates, acceptance, costs, streams, list(modes)[1:], args.gamma)
    print(body)
    if not args.no_write:
        command = (f"python -m kvserve.loadtest speculative --streams {args.streams} --requests {args.requests} "
                   f"--max-tokens {args.max_tokens} --rounds {args.rounds} --gamma {args.gamma} "
                   f"--drafters {','.join(drafters)}")
        # a partial rerun (other streams or drafters) gets a section of its own, next to the full one
        default = args.streams == "1,8,32" and drafters == ["ngram", "draft"]
        section = "speculative" if default else f"speculative-{'-'.join(drafters)}-{args.streams.replace(',', '-')}"
        update_section(section, "Speculative decoding, served side by side" + ("" if default else
                       f" ({', '.join(drafters)}; {args.streams} streams)"), command, body)
    return 0


def _report(rates, acceptance, costs: dict[int, float], streams: list[int], modes: list[str], gamma: int) -> str:
    fixed = f"ngram γ={gamma}"
    head = "| workload | streams | off tok/s | " + " | ".join(f"{m} tok/s | {m} vs off" for m in modes)
    head += " | acceptance " + " / ".join(modes) + (f" | predicted {fixed} vs off |" if fixed in modes else " |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for workload in WORKLOADS:
        for count in streams:
            median = {mode: statistics.median(rates[(workload, count, mode)]) for mode in ["off", *modes]}
            alphas = {}
            for mode in modes:
                drafted, accepted = acceptance[(workload, count, mode)]
                alphas[mode] = accepted / drafted if drafted else None
            cells = []
            for mode in modes:
                ratio = median[mode] / median["off"]
                cells.append(f"{median[mode]:.1f} | " + (f"**{ratio:.2f}x**" if ratio < 1 else f"{ratio:.2f}x"))
            shown = " / ".join("-" if a is None else f"{a:.0%}" for a in alphas.values())
            row = f"| {workload} | {count} | {median['off']:.1f} | " + " | ".join(cells) + f" | {shown} |"
            if fixed in modes:
                predicted = ""
                if count == 1 and alphas[fixed] is not None and costs:
                    cost = StepCost(costs)  # the curve, interpolated as the auto server does
                    predicted = f"{expected_tokens(alphas[fixed], gamma) / (cost(1 + gamma) / cost(1)):.2f}x"
                row += f" {predicted} |"
            lines.append(row)
    curve = ", ".join(f"{n}: {ms:.1f}" for n, ms in sorted(costs.items()))
    return ("\n".join(lines) + "\n\nRatios below 1x in bold. Acceptance: accepted / drafted tokens in those runs. "
            "ngram: prompt lookup; draft: the served model's own weights as int4 (`--speculative draft`). "
            f"Step cost an auto server measured at start (ms by tokens in a decode step): {curve}.\n")
