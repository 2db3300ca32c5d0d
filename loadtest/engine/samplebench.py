"""``python -m kvserve.loadtest kernelbench --sampling``: one sampled token's cost by vocabulary and filter.

A sampled row (temperature > 0; OpenAI's default is 1) goes through ``engine.sampling.sample_token``: on a CPU
with the built ops, native/csrc/sample_row.cpp (top-k, min-p and top-p by a histogram and the crossing bucket's
sort, the inverse CDF at one uniform draw); without them, or on a GPU, the same with torch's ops
(``filter_logits`` in float64, a cumulative sum). Side by side in one run, each on the same logits: those two,
and what sample_token ran before the kernel (``filter_logits`` in float32, ``torch.multinomial`` over the
softmax), with greedy's argmax for scale, and a row with a repetition penalty over 4,500 ids. Rows: SmolLM2's
49,152-token vocabulary, Llama 3's 128,256 and Qwen2.5's 151,936; logits drawn as N(0, 3^2) with one token 12
nats ahead (a peaked distribution, as a trained model's often is) and as N(0, 1) (flat: a random-weight model's,
the worst case for top-p's crossing bucket). Median of 7 rounds of 20 calls each; one row runs on one thread
(sample_row; a step's rows spread over the threads in sample_rows), torch's ops on ``torch.get_num_threads()``.

With ``--model FILE``, served too: ``kvserve serve --model FILE`` on 127.0.0.1, completions of 128 tokens
(``ignore_eos``) at 1 and 32 streams, greedy, temperature 1 and temperature 0.7 with top-p 0.9, output tokens
per second side by side in one run, the settings in turn for 3 rounds (sampling's cost is what it takes from
greedy's rate). Written into
BENCHMARKS.md's "sampling" section.
"""

from __future__ import annotations

import statistics
import time

import torch

VOCABS = ((49152, "SmolLM2"), (128256, "Llama 3"), (151936, "Qwen2.5"))
# (label, temperature, top_k, top_p, min_p)
# (label, temperature, top_k, top_p, min_p, repetition_penalty); a penalized row has 4,000 prompt and 500 output ids
SETTINGS = (("temperature 1", 1.0, 0, 1.0, 0.0, 1.0), ("0.7, top-p 0.9", 0.7, 0, 0.9, 0.0, 1.0),
            ("1, top-k 40", 1.0, 40, 1.0, 0.0, 1.0), ("1, min-p 0.05", 1.0, 0, 1.0, 0.05, 1.0),
            ("1, repetition 1.1", 1.0, 0, 1.0, 0.0, 1.1))


def _work(params, vocab: int):
    """One sequence's step work with ``params``: 4,000 prompt and 500 output ids where it is penalized, else one
    each."""
    from kvserve.engine.plan import SeqWork

    g = torch.Generator().manual_seed(1)
    prompt, output = ([1], [2]) if not params.needs_penalties else \
        (torch.randint(vocab, (4000,), generator=g).tolist(), torch.randint(vocab, (500,), generator=g).tolist())
    return SeqWork(seq_id=0, token_ids=[1], start_pos=0, block_table=[], slot_mapping=[], sample=True,
                   params=params, prompt_ids=prompt, output_ids=output)


def _before(logits: torch.Tensor, work) -> int:
    """What sample_token ran for a sampled row before sample_row.cpp: the repetition penalty over a sorted set of
    the ids (torch.tensor of a list), the float32 filter, softmax, multinomial, and the full log-softmax for the
    token's logprob."""
    from kvserve.engine.sampling import filter_logits, finite_logits, log_softmax

    params = work.params
    if params.repetition_penalty != 1.0:
        logits = logits.clone()
        seen = torch.tensor(sorted(set(work.prompt_ids) | set(work.output_ids)))
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    processed = filter_logits(finite_logits(logits / params.temperature), params.top_k, params.top_p, params.min_p)
    token = int(torch.multinomial(processed.softmax(-1), 1))
    float(log_softmax(logits)[token])
    return token


def _torch_path(logits: torch.Tensor, work) -> int:
    """sample_token's work for a sampled row without the built ops: its penalties, the torch path of ``draw`` and
    the full log-softmax for the token's logprob."""
    from kvserve.engine.sampling import apply_penalties, draw_torch, finite_logits, log_softmax, uniform

    params = work.params
    if params.needs_penalties:
        logits = apply_penalties(logits, work)
    scaled = finite_logits(logits / params.temperature)
    token, _ = draw_torch(scaled, params.top_k, params.top_p, params.min_p, uniform(None, 0, logits.device))
    float(log_softmax(logits)[token])
    return token


def _ms(fn, reps: int) -> float:
    """Median over 7 rounds of the mean wall ms of ``fn()`` over ``reps`` calls, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    rounds = []
    for _ in range(7):
        started = time.perf_counter()
        for _ in range(reps):
            fn()
        rounds.append((time.perf_counter() - started) / reps * 1e3)
    return statistics.median(rounds)


def _logits(vocab: int, peaked: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(vocab)
    if not peaked:
        return torch.randn(vocab, generator=g)
    logits = torch.randn(vocab, generator=g) * 3
    logits[7] = logits.max() + 12
    return logits


SERVED = (("greedy", {"temperature": 0.0}), ("temperature 1", {"temperature": 1.0}),
          ("0.7, top-p 0.9", {"temperature": 0.7, "top_p": 0.9}))
ROUNDS = 3


def served(model: str, tokens: int = 128) -> list[str]:
    """Output tok/s of ``kvserve serve --model model`` at 1 stream (2 requests) and 32 (32 requests, 32 slots) for
    each of ``SERVED``'s settings, the median of ``ROUNDS`` rounds; the table's lines.

    Raises:
        RuntimeError: the server did not start, or a request failed.
    """
    import asyncio

    import httpx

    from kvserve.loadtest.loadgen.runcmd import server_model
    from kvserve.loadtest.procs.serverproc import ServerStartError, kvserve_command, launch

    async def rate(url: str, name: str, streams: int, count: int, params: dict) -> float:
        async with httpx.AsyncClient(timeout=900) as client:
            async def one(max_tokens: int) -> int:
                body = {"model": name, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
                        **params}
                response = await client.post(f"{url}/v1/completions", json=body)
                if response.status_code != 200:
                    raise RuntimeError(f"a request failed: {response.status_code} {response.text[:200]}")
                return response.json()["usage"]["completion_tokens"]

            await one(4)
            gate = asyncio.Semaphore(streams)

            async def gated() -> int:
                async with gate:
                    return await one(tokens)

            started = time.perf_counter()
            done = sum(await asyncio.gather(*(gated() for _ in range(count))))
            return done / (time.perf_counter() - started)

    lines = ["", f"Served: `kvserve serve --model {model}`, {tokens}-token completions (2 requests at 1 stream, 32 at "
             f"32), output tok/s, the median of {ROUNDS} rounds taking the settings in turn (ratio to greedy's).", "", "| streams | " + " | ".join(label for label, _ in SERVED) + " |",
             "|---:|" + "---:|" * len(SERVED)]
    try:
        with launch(kvserve_command(["--model", model, "--max-num-seqs", "32"]), name="samplebench") as server:
            name = server_model(server.url)
            for streams, count in ((1, 2), (32, 32)):
                # the settings in turn, ROUNDS times, and each one's median: a shared machine's bandwidth drifts
                rounds = [[asyncio.run(rate(server.url, name, streams, count, params)) for _, params in SERVED]
                          for _ in range(ROUNDS)]
                rates = [statistics.median(column) for column in zip(*rounds)]
                cells = [f"{rates[0]:.1f}"] + [f"{r:.1f} ({r / rates[0]:.2f}x)" for r in rates[1:]]
                lines.append(f"| {streams} | " + " | ".join(cells) + " |")
                print(lines[-1], flush=True)
    except (ServerStartError, OSError) as exc:
        raise RuntimeError(f"the server did not start: {exc}") from exc
    return lines


@torch.inference_mode()
def measure(reps: int = 20, write: bool = True, model: str | None = None) -> str:
    """Time every (vocabulary, distribution, setting) three ways and greedy once, and with ``model`` the served
    rates (``served``); print and (``write``) publish the tables. Returns their markdown.

    Raises:
        RuntimeError: the native ops are not built; with ``model``, the server did not start or a request failed.
    """
    from kvserve import native
    from kvserve.engine import sampling
    from kvserve.engine.plan import SamplingParams
    from kvserve.loadtest.publish.benchmarks_md import update_section

    ops = native.load_ops(build=False)
    if ops is None:
        raise RuntimeError("the native ops are not built: run `python -m kvserve.native --build` first")

    lines = [f"ms per sampled token (wall, median of 7 rounds of {reps} calls); the kernel's row on one thread, torch's "
             f"ops on {torch.get_num_threads()}. "
             "kernel: `sample_token` as served (sample_row.cpp); torch: the same without the built ops (what a GPU "
             "or a machine without them runs); before: the float32 filter and `torch.multinomial` it replaced. "
             "Greedy: `sample_token`'s argmax and logprob (the batched greedy path is cheaper still). The repetition "
             "penalty's row has 4,000 prompt and 500 output ids (before: their sorted set through torch.tensor).", "",
             "| vocabulary | logits | greedy | sampling | kernel ms | torch ms | before ms | before / kernel |",
             "|---|---|---:|---|---:|---:|---:|---:|"]
    for vocab, name in VOCABS:
        for peaked in (True, False):
            logits = _logits(vocab, peaked)
            greedy_work = _work(SamplingParams(temperature=0.0), vocab)
            greedy = _ms(lambda: sampling.sample_token(logits, greedy_work), reps)
            for label, temperature, top_k, top_p, min_p, repetition in SETTINGS:
                work = _work(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                            repetition_penalty=repetition), vocab)
                kernel = _ms(lambda: sampling.sample_token(logits, work), reps)
                plain = _ms(lambda: _torch_path(logits, work), max(1, reps // 4))
                before = _ms(lambda: _before(logits, work), max(1, reps // 4))
                row = (f"| {vocab:,} ({name}) | {'peaked' if peaked else 'flat'} | {greedy:.3f} | {label} | "
                       f"{kernel:.3f} | {plain:.2f} | {before:.2f} | {before / kernel:.1f}x |")
                lines.append(row)
                print(row, flush=True)
    if model is not None:
        lines += served(model)
    body = "\n".join(lines)
    if write:
        command = "python -m kvserve.loadtest kernelbench --sampling" + (f" --model {model}" if model else "")
        update_section("sampling", "Sampling a token: the kernel against torch's ops, by vocabulary and filter",
                       command, body)
    return body
