"""The model runner: computes one StepPlan as a single ragged forward pass and samples. Decides nothing."""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from kvserve import native
from kvserve.engine.attention import AttentionMetadata, PrefillSpan
from kvserve.engine.constraints import Constraints
from kvserve.engine.masks import apply_masks, fill_masks_async
from kvserve.engine.fastpath import fast_decoder
from kvserve.engine.loader import LoadedModel
from kvserve.engine.plan import SamplingParams, SeqResult, SeqWork, StepPlan, TokenLogprob
from kvserve.engine.sampling import (greedy_tokens, log_softmax, plain_greedy, plain_sampled, sample_token,
                                     sampled_tokens, token_logprob)
from kvserve.kvcache.pool import KVPool


def padded_tables(tables: list[list[int]], lengths: list[int], block_size: int, device) -> torch.Tensor:
    """``[num_seqs, max_blocks]`` block tables cut to the blocks that hold each context, padded with block 0."""
    counts = [-(-length // block_size) for length in lengths]
    width = max(counts)
    rows = [table[:count] + [0] * (width - count) for table, count in zip(tables, counts)]
    return torch.tensor(rows, dtype=torch.long, device=device)


def _rows_alone(loaded: LoadedModel, pool: KVPool) -> bool:
    """Whether every token, prefill ones included, attends as a decode row does: through the C++ paged attention
    (``native/csrc/decode_ops.cpp``), one query row at a time against its own context in block order.

    Where that kernel runs (float32 activations on CPU over a float32 or bfloat16 pool or an int8 / int4 one,
    whose bfloat16 values or codes it reads in place; no logit soft-cap), it does: a token's attention then has the same bits however the scheduler
    cut its prompt into chunks, batched it, or found part of it in the prefix cache. SDPA, which prefill spans use
    otherwise, blocks its reduction by the number of queries and keys of the call (a prompt cut at another place
    gives rows that differ in last bits), and the GGUF default quantizes activations to int8 per block of 32,
    which turns such a last bit into another code and, at a near-tie, another token.
    """
    softcap = getattr(getattr(loaded.model, "config", None), "attn_logit_softcapping", None)
    kernel_reads_pool = pool.data.dtype in (torch.float32, torch.bfloat16) or pool.quantized
    return (loaded.dtype is torch.float32 and kernel_reads_pool and pool.data.is_cpu
            and softcap is None and native.load_ops() is not None)


class ModelRunner:
    """Runs steps of a model over a paged KV pool.

    Llama-family models run the lean forward of ``engine.fastpath`` (same weights, fewer ops; a GGUF file's own
    blocks, in engine.lean_model's modules, only that); any other architecture runs transformers' own modules with
    the ``kvserve`` attention function.

    Args:
        loaded: the model (already wired to the ``kvserve`` attention, quantized if it is to be).
        pool: the KV pool; its geometry must match the model.
        step_tokens: the most token rows a step is planned with (the scheduler's token budget), if known: the
            layer stack's workspace is made for them once, at start (``FastDecoder.reserve``).

    Draft tokens in a plan are verified by ``_sample``; proposing them is speculation's
    (``speculation.decoder.SpecDecoder.execute`` runs this runner's steps and then its drafter).

    Attributes:
        constraints: the grammar matchers of structured-output sequences, by id (the constraint plug-in: whoever
            admits a request with a grammar adds its matcher, and removes it once the request has ended).
    """

    def __init__(self, loaded: LoadedModel, pool: KVPool, step_tokens: int | None = None) -> None:
        self.loaded = loaded
        self.pool = pool
        self.device = loaded.device
        self.fast = fast_decoder(loaded.model)
        if self.fast is not None and step_tokens:
            self.fast.reserve(step_tokens)
        self.rows_alone = _rows_alone(loaded, pool)
        self.constraints = Constraints()

    def time_decode_steps(self, sizes: list[int], block_table: list[int], repeats: int = 3,
                          budget_s: float | None = None) -> dict[int, float]:
        """Seconds of an all-decode greedy step of each of ``sizes`` rows, every row attending to a context that
        fills ``block_table``: the step-cost curve speculation weighs drafts against
        (``speculation.policy.StepCost``).

        Method: a warm-up round, then up to ``repeats`` rounds, each running every size once in turn (so a busy
        moment of the machine falls on all sizes of a round alike, not on one size), and per size the median
        over the rounds (robust to a stray slow step). Rounds stop early once ``budget_s`` seconds have passed
        since the start, after at least one timed round: the time is bounded even on a loaded machine.

        The rows write their K/V into the table's last slot: pass blocks nobody uses (at start-up, any).

        Returns:
            ``{size: seconds}``.
        """
        context = len(block_table) * self.pool.block_size
        last_slot = block_table[-1] * self.pool.block_size + self.pool.block_size - 1
        greedy = SamplingParams(temperature=0.0)
        plans = {size: StepPlan([SeqWork(seq_id=i, token_ids=[0], start_pos=context - 1, block_table=block_table,
                                         slot_mapping=[last_slot], sample=True, params=greedy, prompt_ids=[0],
                                         output_ids=[]) for i in range(size)]) for size in sizes}
        started = time.perf_counter()
        times: dict[int, list[float]] = {size: [] for size in sizes}
        for round_index in range(repeats + 1):
            if round_index > 1 and budget_s is not None and time.perf_counter() - started > budget_s:
                break
            for size, plan in plans.items():
                begun = time.perf_counter()
                self.execute(plan)
                if round_index:  # round 0 warms up
                    times[size].append(time.perf_counter() - begun)
        return {size: statistics.median(samples) for size, samples in times.items()}

    def _step_tensors(self, plan: StepPlan, spans: list[tuple[int, int]]
                      ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The step's tensors: token ids ``[T]``, their positions ``[T]``, the attention metadata and the rows
        whose logits are kept ``[K]`` (per SeqWork its last ``spans`` rows).

        Every token of a decoding sequence is a decode row (each attends to the cache up to its own position
        through the block table, so a row computes the same bits as if it were decoded alone); a prefilling
        sequence is one span, except where ``rows_alone``: then its tokens are decode rows too (see
        ``_rows_alone``). The int64 vectors (ids, positions, slots, kept rows, decode rows, context lengths and
        block tables) are views of one tensor built from one list: a tensor per list cost a few microseconds each,
        a large part of what a batch-1 decode step spends outside its C++ call.
        """
        device, block_size = self.device, self.pool.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        keep: list[int] = []
        decode_rows: list[int] = []
        decode_lens: list[int] = []
        decode_tables: list[list[int]] = []
        prefills: list[PrefillSpan] = []
        row = 0
        for w, (_, kept) in zip(plan.work, spans):
            n = len(w.token_ids)
            ids += w.token_ids
            positions += range(w.start_pos, w.start_pos + n)
            slots += w.slot_mapping
            keep += range(row + n - kept, row + n)
            if w.is_decode or self.rows_alone:
                decode_rows += range(row, row + n)
                decode_lens += range(w.start_pos + 1, w.context_len + 1)
                decode_tables += [w.block_table] * n
            else:
                table = (padded_tables([w.block_table], [w.context_len], block_size, device)[0] if w.start_pos
                         else torch.empty(0, dtype=torch.long, device=device))
                prefills.append(PrefillSpan(start=row, end=row + n, block_table=table, start_pos=w.start_pos))
            row += n
        # the decode rows' block tables cut to the blocks that hold each context, padded with block 0
        counts = [-(-length // block_size) for length in decode_lens]
        width = max(counts, default=0)
        tables = [block for table, count in zip(decode_tables, counts) for block in table[:count]
                  + [0] * (width - count)] if decode_rows else []
        sizes = [row, row, row, len(keep), len(decode_rows), len(decode_rows), len(tables)]
        flat = torch.tensor(ids + positions + slots + keep + decode_rows + decode_lens + tables, dtype=torch.long,
                            device=device)
        ids_t, positions_t, slots_t, keep_t, rows_t, lens_t, tables_t = flat.split(sizes)
        meta = AttentionMetadata(pool=self.pool, slot_mapping=slots_t, decode_rows=rows_t,
                                 decode_tables=tables_t.view(len(decode_rows), width), decode_lens=lens_t,
                                 prefills=prefills, all_decodes=not prefills,
                                 max_position=max(positions) if positions else None)
        return ids_t, positions_t, meta, keep_t

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[SeqResult]:
        """Compute every token in ``plan``, sample where asked and verify drafts.

        Returns:
            One SeqResult per SeqWork, in plan order (no tokens for a non-final prefill chunk); none for a plan
            with no work (one that only hands a drafter ``plan.ended_ids``).
        """
        if not plan.work:
            return []
        logits = self.logits(plan)
        if logits is None:
            return [SeqResult(seq_id=w.seq_id) for w in plan.work]
        return self._sample(plan, _logit_spans(plan), logits)

    @torch.inference_mode()
    def logits(self, plan: StepPlan) -> torch.Tensor | None:
        """Run the step's forward (writing its K/V) and return the float32 logits of its kept rows, grammar
        masks applied: ``[rows, vocab]``, per SeqWork in plan order every prompt row of a prefill that returns
        prompt logprobs, else its sampled rows (``SeqWork.num_sampled_rows``); None when no row is kept.

        Raises:
            ValueError: an empty plan.
        """
        if not plan.work:
            raise ValueError("empty step plan")
        spans = _logit_spans(plan)
        matchers = self.constraints.of(plan)  # {seq_id: matcher} of the sampling sequences with a grammar
        # grammar masks are computed on their own thread while the forward runs; unconstrained steps skip this
        masks = fill_masks_async(list(matchers.values()), [w.output_ids for w in plan.work if w.seq_id in matchers]) \
            if matchers else None
        input_ids, positions, meta, keep_rows = self._step_tensors(plan, spans)  # [T], [T], ..., [K]
        if self.fast is not None:
            logits = self.fast.forward(input_ids, positions, meta, keep_rows)  # [K, vocab]
        elif not keep_rows.numel():
            self.loaded.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                              logits_to_keep=torch.tensor([0], device=self.device), kvserve=meta)
        else:
            logits = self.loaded.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                                       logits_to_keep=keep_rows, kvserve=meta).logits[0]  # [K, vocab]
        if not keep_rows.numel():
            return None
        logits = logits.float()
        if masks is not None:
            # constrained sequences carry no drafts: their one sampled row is their last kept row
            rows = [first + n - 1 for w, (first, n) in zip(plan.work, spans) if w.seq_id in matchers]
            apply_masks(logits, rows, masks.result())
        return logits

    def _sample(self, plan: StepPlan, spans: list[tuple[int, int]], logits: torch.Tensor) -> list[SeqResult]:
        """Each sampling sequence's new tokens: its sampled rows in order, kept while each sampled token equals
        the draft token it checks, up to and including the first that differs (or the one after the last draft).

        A row is sampled exactly as without drafts: the same logits (decode rows are batch-invariant), the same
        processing and, for a seeded request, the same generator (seeded by the output position). So greedy and
        seeded output are token for token those of plain decoding, and unseeded sampling keeps the served
        model's distribution: for a one-hot draft q (prompt lookup), accepting x when the sample from p is x
        has probability p(x) = min(1, p(x)/q(x)), and the sample on a mismatch is distributed as
        max(0, p - q) normalised, Leviathan et al. 2023's rule.
        """
        batched = self._greedy_rows(plan, spans, logits) | self._sampled_rows(plan, spans, logits)
        results: list[SeqResult] = []
        for w, (first, n) in zip(plan.work, spans):
            result = SeqResult(seq_id=w.seq_id)
            results.append(result)
            if w.params.prompt_logprobs and not w.is_decode:
                result.prompt_logprobs = self._prompt_logprobs(w, logits[first:first + n])  # [n, vocab]
            if not w.sample:
                continue
            drafts = w.draft_ids
            picked = batched.get(w.seq_id)
            # a plain greedy sequence's tokens are picked already: the row views (a tensor op each, a good part
            # of a 32-sequence step's Python) only for the others
            sampled = logits[first + n - w.num_sampled_rows:first + n] if picked is None else None  # [1 + draft, V]
            for i in range(w.num_sampled_rows):
                if picked is not None:
                    token = picked[i]
                else:
                    view = w if i == 0 else dataclasses.replace(w, output_ids=w.output_ids + drafts[:i])
                    try:
                        token = sample_token(sampled[i], view)
                    except (RuntimeError, ValueError, TypeError, IndexError, OverflowError) as exc:  # one bad request
                        result.tokens, result.error = [], f"sampling failed: {exc}"
                        break
                result.tokens.append(token)
                if i == len(drafts) or token.token_id != drafts[i]:
                    break
        return results

    @staticmethod
    def _rows_of(plan: StepPlan, spans: list[tuple[int, int]], vocab: int,
                 plain) -> tuple[list[int], list[list[int]], list[SeqWork]]:
        """The sequences ``plain(w)`` accepts, less any that returns prompt logprobs or suppresses an out-of-range
        id (that stays with sample_token, which fails the sequence alone): their sampled rows' indices in the
        logits, each row's suppressed ids, and the sequences."""
        rows: list[int] = []
        suppress: list[list[int]] = []
        works: list[SeqWork] = []
        for w, (first, n) in zip(plan.work, spans):
            if (not (w.params.prompt_logprobs and not w.is_decode) and plain(w)
                    and all(0 <= t < vocab for t in w.suppress_ids)):
                rows.extend(range(first + n - w.num_sampled_rows, first + n))
                suppress.extend([w.suppress_ids] * w.num_sampled_rows)
                works.append(w)
        return rows, suppress, works

    @classmethod
    def _greedy_rows(cls, plan: StepPlan, spans: list[tuple[int, int]],
                     logits: torch.Tensor) -> dict[int, list[TokenLogprob]]:
        """Tokens of every sampled row of the plain greedy sequences (most of a typical step), in one call."""
        rows, suppress, works = cls._rows_of(plan, spans, logits.shape[-1], plain_greedy)
        if not rows:
            return {}
        picked = logits if len(rows) == logits.shape[0] else logits[rows]  # [len(rows), vocab]
        tokens = iter(greedy_tokens(picked, suppress))
        return {w.seq_id: [next(tokens) for _ in range(w.num_sampled_rows)] for w in works}

    @classmethod
    def _sampled_rows(cls, plan: StepPlan, spans: list[tuple[int, int]],
                      logits: torch.Tensor) -> dict[int, list[TokenLogprob]]:
        """Tokens of the plain sampled sequences without drafts (a step of sampled chat streams), in one call whose
        rows run on the threads; {} where sampled_tokens does not apply (each row is then sampled alone)."""
        rows, suppress, works = cls._rows_of(plan, spans, logits.shape[-1],
                                             lambda w: plain_sampled(w) and w.num_sampled_rows == 1)
        if not rows:
            return {}
        picked = sampled_tokens(logits[rows], works, suppress)
        return {} if picked is None else {w.seq_id: [token] for w, token in zip(works, picked)}

    @staticmethod
    def _prompt_logprobs(w: SeqWork, rows: torch.Tensor) -> list[TokenLogprob]:
        """Logprob of each prompt token that the rows predict: row i (position p) predicts position p+1."""
        logprobs = log_softmax(rows)
        result = []
        for i in range(rows.shape[0]):
            target_pos = w.start_pos + i + 1
            if target_pos >= len(w.prompt_ids):
                break
            result.append(token_logprob(logprobs[i], w.prompt_ids[target_pos], w.params.logprobs or 0))
        return result


def _logit_spans(plan: StepPlan) -> list[tuple[int, int]]:
    """Per SeqWork, ``(first row, rows)`` of its kept logits, in plan order: every row of a prefill that returns
    prompt logprobs, else its sampled rows (the last ``1 + num_draft`` of a decode, the last row of a prompt's
    final chunk), else none."""
    spans: list[tuple[int, int]] = []
    k = 0
    for w in plan.work:
        n = len(w.token_ids) if w.params.prompt_logprobs and not w.is_decode else w.num_sampled_rows
        spans.append((k, n))
        k += n
    return spans
