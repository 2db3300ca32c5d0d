"""Turn one row of logits per sequence into a token: penalties, temperature, top-k/top-p/min-p, seed.

Greedy rows never touch a random generator, so greedy output is identical alone and batched.
"""

from __future__ import annotations

import array
import math

import torch

from kvserve.engine.plan import SeqWork, TokenLogprob
from kvserve import native

_MASK64 = 2**64 - 1  # torch generators take seeds in [0, 2**64)


def _splitmix64(x: int) -> int:
    """SplitMix64's step (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014):
    a bijection of 64-bit integers whose outputs of nearby inputs look independent."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def mix_seed(*values: int) -> int:
    """One 64-bit generator seed from integers (a request's seed, a choice's index, a step), each taken modulo
    2**64 (a negative seed too) and mixed in turn, so distinct tuples give distinct-looking seeds: seed 2**63 - 1
    is not seed 0, and choice 1 of seed S is not choice 0 of seed S + 1."""
    mixed = 0
    for value in values:
        mixed = _splitmix64(mixed ^ (value & _MASK64))
    return mixed


def apply_penalties(logits: torch.Tensor, work: SeqWork) -> torch.Tensor:
    """Apply OpenAI presence/frequency and CTRL repetition penalties to ``logits`` ``[vocab]``."""
    params = work.params
    logits = logits.clone()
    if work.output_ids and (params.presence_penalty or params.frequency_penalty):
        ids, counts = _id_tensor(work.output_ids, logits.device).unique(return_counts=True)
        logits[ids] -= params.presence_penalty + params.frequency_penalty * counts.to(logits.dtype)
    if params.repetition_penalty != 1.0:
        # every id as often as it occurs: a repeated id gets the same value from its one original logit
        seen = _id_tensor(work.prompt_ids + work.output_ids, logits.device)
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / params.repetition_penalty,
                                   picked * params.repetition_penalty)
    return finite_logits(logits)


def _id_tensor(ids: list[int], device: torch.device) -> torch.Tensor:
    """``ids`` as an int64 tensor ``[len(ids)]`` on ``device``, through an array's buffer: torch.tensor on a list of
    Python ints took ~0.4 ms per 4,500 ids (a long prompt's, every step of a penalized request), this ~0.06 ms.

    Raises:
        OverflowError: an id does not fit in int64.
    """
    if not ids:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.frombuffer(array.array("q", ids), dtype=torch.int64).to(device, copy=True)


def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` with +inf (a tiny repetition penalty or temperature overflowing float32) at the dtype's largest
    value and NaN masked out, so the limit of such a value is what samples (the largest logits win) and
    softmax never sees inf - inf. Masked tokens (-inf) stay masked."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max, neginf=float("-inf"))


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    """Add OpenAI's ``logit_bias`` (token id -> value) to ``logits`` ``[vocab]``; a new tensor."""
    ids = torch.tensor(list(bias), device=logits.device)  # [num_biased]
    values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)  # [num_biased]
    return logits.index_add(0, ids, values)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask ``logits`` ``[vocab]`` outside top-k, the top-p nucleus (Holtzman et al. 2020) and min-p."""
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        outside = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
        outside[0] = False  # and always the most likely one: a top_p below float32's resolution is greedy
        logits = logits.masked_fill(outside.scatter(0, order, outside), float("-inf"))
    return logits


def sample_token(logits: torch.Tensor, work: SeqWork) -> TokenLogprob:
    """Pick the next token for one sequence.

    Args:
        logits: ``[vocab]`` float32 logits for the sequence's last position.
        work: the sequence's step work (params, history, suppressed tokens).

    Returns:
        The token, its logprob under the model's distribution after penalties (before temperature and
        filtering, as OpenAI reports; after them with ``processed_logprobs``), and the requested top
        alternatives.
    """
    params = work.params
    if params.needs_penalties:
        logits = apply_penalties(logits, work)
    if params.logit_bias:  # after the penalties, as vLLM's logits processors; the reported logprob includes it
        logits = apply_logit_bias(logits, params.logit_bias)
    if work.suppress_ids:
        logits = logits.clone()
        logits[work.suppress_ids] = float("-inf")
    num_top = params.logprobs or 0
    ops = _ops(logits)
    if params.greedy and num_top == 0 and ops is not None:  # greedy_tokens' pick: vectorized, the same bits
        tokens, logprobs = ops.greedy_pick(logits.reshape(1, -1).contiguous())
        return TokenLogprob(token_id=int(tokens[0]), logprob=_reportable(float(logprobs[0])))
    if params.greedy:
        token_id = int(torch.argmax(logits))
    else:
        u = uniform(params.seed, len(work.output_ids), logits.device)  # one generator per (seed, step)
        token_id, processed = draw(logits, params.temperature, params.top_k, params.top_p, params.min_p, u,
                                   params.processed_logprobs)
        if params.processed_logprobs:
            logits = processed  # float32 on the same device: the same ops apply
    if num_top == 0 and ops is not None:  # one token's logprob: log_softmax's bits, without the other V - 1
        logprob = ops.token_logprobs(logits.reshape(1, -1).contiguous(), torch.tensor([token_id]))
        return TokenLogprob(token_id=token_id, logprob=_reportable(float(logprob[0])))
    return token_logprob(log_softmax(logits), token_id, num_top)


def uniform(seed: int | None, step: int, device: torch.device) -> float:
    """One draw from U[0, 1) in float64: from a generator seeded by ``(seed, step)`` (``mix_seed``) for a seeded
    request, so a preempted and recomputed sequence draws the same; else from torch's default generator."""
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(mix_seed(seed, step))
    return float(torch.rand((), dtype=torch.float64, generator=generator, device=device))


def draw(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float, u: float,
         want_processed: bool = False) -> tuple[int, torch.Tensor | None]:
    """The token at ``u`` of the tempered, filtered distribution's CDF, in index order (inverse transform sampling).

    Args:
        logits: ``[vocab]`` float32 logits (after penalties, bias and suppressed ids).
        temperature: > 0; the logits are divided by it (float32, as ``logits / temperature``), then NaN masked
            and +inf clamped (``finite_logits``).
        top_k, top_p, min_p: the filters, in that order (``filter_logits``'s semantics).
        u: a draw from U[0, 1) (``uniform``).
        want_processed: also return the tempered logits with every token the filters removed at -inf.

    Returns:
        ``(token, processed or None)``: the first token ``i`` whose kept probabilities up to and including it
        sum past ``u``. On a CPU with the built ops, native/csrc/sample_row.cpp (a few passes over the row: no sort
        of the vocabulary, no torch.multinomial; docs/kernels.md, "Sampling a token"); else ``draw_torch``.

    Raises:
        RuntimeError: every token is masked; on the kernel's path also u outside [0, 1), a temperature <= 0, or a
            NaN top_p or min_p (the API refuses them first).
    """
    ops = _ops(logits)
    if ops is not None:
        top_k = _top_k(top_k, logits.shape[-1])
        return ops.sample_row(logits.contiguous(), temperature, top_k, top_p, min_p, u, want_processed)
    return draw_torch(finite_logits(logits / temperature), top_k, top_p, min_p, u, want_processed)


def draw_torch(scaled: torch.Tensor, top_k: int, top_p: float, min_p: float, u: float,
               want_processed: bool = False) -> tuple[int, torch.Tensor | None]:
    """``draw`` with torch's ops (any device) on ``scaled``, the tempered logits (``finite_logits(logits /
    temperature)``): ``filter_logits`` in float64, the weights' cumulative sum and a binary search for ``u`` times
    their total. Result and errors as ``draw``'s."""
    # in float64, as the kernel sums: over Llama 3's 128,256 tokens a float32 cumulative sum moves top_p 0.999's
    # cut by ~160 tokens (processed holds scaled's own values or -inf, so the cast back is exact)
    processed = filter_logits(scaled.double(), top_k, top_p, min_p).to(scaled.dtype)
    weights = (processed.double() - processed.max().double()).exp()  # [vocab]; masked tokens 0
    if not bool(weights.sum() > 0):
        raise RuntimeError("every token is masked (-inf)")
    cdf = weights.cumsum(-1)
    token = int(torch.searchsorted(cdf, u * cdf[-1], right=True))  # the first i with cdf[i] > u * total
    if token >= weights.numel():  # rounding left u * total at the total: the last kept token
        token = int(weights.nonzero()[-1])
    return token, processed if want_processed else None


def _ops(logits: torch.Tensor):
    """native/csrc/decode_ops.cpp's ops for float32 CPU logits where the install step built them, else None
    (build=False: never a compile inside a request)."""
    return native.load_ops(build=False) if logits.dtype is torch.float32 and logits.is_cpu else None


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Log-probabilities over the last dimension of ``logits`` ``[..., vocab]``.

    Every logprob kvserve reports comes from here or from ``greedy_pick``, which share one normalizer on a CPU,
    so a token's logprob is the same whether or not the request asked for alternatives.
    """
    ops = _ops(logits)
    if ops is None or logits.numel() == 0:
        return logits.log_softmax(-1)
    return ops.log_softmax(logits.reshape(-1, logits.shape[-1]).contiguous()).view(logits.shape)


def plain_greedy(work: SeqWork) -> bool:
    """Whether ``work`` samples a greedy token with no penalties and no top alternatives (``greedy_tokens``)."""
    params = work.params
    return (work.sample and params.greedy and not params.needs_penalties and not params.logprobs
            and not params.logit_bias)


def plain_sampled(work: SeqWork) -> bool:
    """Whether ``work`` samples at a temperature with no penalties, logit bias, top alternatives or processed
    logprobs (``sampled_tokens``)."""
    params = work.params
    return (work.sample and not params.greedy and not params.needs_penalties and not params.logprobs
            and not params.logit_bias and not params.processed_logprobs)


def sampled_tokens(logits: torch.Tensor, works: list[SeqWork], suppress: list[list[int]]) -> list[TokenLogprob] | None:
    """Sampled tokens for many rows at once: what ``sample_token`` gives each row, with the same bits, the rows'
    draws spread over the threads (native/csrc/sample_row.cpp's ``sample_rows``).

    Args:
        logits: ``[rows, vocab]`` float32 logits, one row per sequence.
        works: per row, a ``plain_sampled`` sequence's step work (its temperature, filters, seed and output length).
        suppress: per row, token ids that may not be picked (EOS below ``min_tokens``).

    Returns:
        Per row, the token and its logprob, as ``sample_token`` reports them; None where the built ops do not apply
        (a GPU, or none built) or a row has every token masked: the caller then samples each row alone.
    """
    ops = _ops(logits)
    if ops is None:
        return None
    logits = _suppressed(logits, suppress).contiguous()
    params = [w.params for w in works]
    u = [uniform(p.seed, len(w.output_ids), logits.device) for p, w in zip(params, works)]
    try:
        tokens = ops.sample_rows(logits, _column([p.temperature for p in params]),
                                 _column([_top_k(p.top_k, logits.shape[-1]) for p in params], torch.int64),
                                 _column([p.top_p for p in params]),
                                 _column([p.min_p for p in params]), _column(u))
    except RuntimeError:  # every token of some row masked: that row fails alone in sample_token
        return None
    logprobs = ops.token_logprobs(logits, tokens)
    return [TokenLogprob(token_id=token, logprob=_reportable(logprob))
            for token, logprob in zip(tokens.tolist(), logprobs.tolist())]


def _top_k(top_k: int, vocab: int) -> int:
    """``top_k`` as the kernel takes it: 0 (off) where it keeps every token (<= 0, or >= the vocabulary: the API
    bounds it from below only, and 2**63 does not fit the kernel's int64)."""
    return top_k if 0 < top_k < vocab else 0


def _suppressed(logits: torch.Tensor, suppress: list[list[int]]) -> torch.Tensor:
    """``logits`` ``[rows, vocab]`` with row r's ids ``suppress[r]`` at -inf (a copy where any are; else itself)."""
    pairs = [(row, token) for row, ids in enumerate(suppress) for token in ids]
    if not pairs:
        return logits
    logits = logits.clone()
    rows, tokens = zip(*pairs)
    logits[torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device)] = float("-inf")
    return logits


def _column(values: list, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """One value per row as a CPU tensor ``[rows]`` (sample_rows' arguments)."""
    return torch.tensor(values, dtype=dtype)


def greedy_tokens(logits: torch.Tensor, suppress: list[list[int]]) -> list[TokenLogprob]:
    """Greedy tokens for many rows at once: what ``sample_token`` gives each row, with one device sync.

    On a GPU, ``sample_token`` per row costs a few synchronisations each (argmax, then the logprob); a
    32-sequence decode step would wait on ~100 of them. On a CPU with the C++ ops, ``greedy_pick`` picks
    in one call (vectorized, where torch's CPU argmax is not), with ``log_softmax``'s normalizer.

    Args:
        logits: ``[rows, vocab]`` float32 logits, one row per sequence.
        suppress: per row, token ids that may not be picked (EOS below ``min_tokens``).

    Returns:
        Per row, the argmax token (first of equal maxima, as ``torch.argmax``) and its logprob under the
        distribution with the suppressed ids at minus infinity, as ``sample_token`` reports it.
    """
    logits = _suppressed(logits, suppress)
    ops = _ops(logits)
    if ops is not None:  # both in one C++ call
        picked, chosen = ops.greedy_pick(logits.contiguous())  # [rows] each
    else:
        picked = logits.argmax(-1)  # [rows]
        chosen = logits.log_softmax(-1).gather(1, picked[:, None])[:, 0]  # [rows]
    return [TokenLogprob(token_id=t, logprob=lp) for t, lp in zip(picked.tolist(), chosen.tolist())]


def token_logprob(logprobs: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
    """Package the logprob of ``token_id`` and the ``num_top`` best alternatives from ``logprobs`` ``[vocab]``."""
    top: list[tuple[int, float]] = []
    if num_top > 0:  # at most the vocabulary: torch.topk raises past it (a tiny model, 20 asked)
        values, ids = torch.topk(logprobs, min(num_top, logprobs.shape[-1]))
        # tokens a filter or a suppression removed (-inf) are no alternatives, and JSON has no infinity
        top = [(i, _reportable(v)) for i, v in zip(ids.tolist(), values.tolist()) if v != float("-inf")]
    return TokenLogprob(token_id=token_id, logprob=_reportable(float(logprobs[token_id])), top=top)


_LEAST_LOGPROB = -9999.0  # what vLLM reports for a probability that is 0 in float32: JSON has no -Infinity


def _reportable(logprob: float) -> float:
    """A logprob JSON can carry: finite, at least ``_LEAST_LOGPROB`` (NaN reads as that least)."""
    if math.isnan(logprob):
        return _LEAST_LOGPROB
    return max(logprob, _LEAST_LOGPROB)
