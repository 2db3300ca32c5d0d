"""The model runner: computes one StepPlan as a single ragged forward pass and samples. Decides nothing."""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata, PrefillSpan
from engine.constraints import apply_masks, fill_masks_async
from engine.fastpath import fast_decoder
from engine.loader import LoadedModel
from engine.plan import SeqResult, SeqWork, StepPlan, TokenLogprob
from engine.sampling import greedy_tokens, log_softmax, plain_greedy, sample_token, token_logprob
from kvcache.pool import KVPool


def padded_tables(tables: list[list[int]], lengths: list[int], block_size: int, device) -> torch.Tensor:
    """``[num_seqs, max_blocks]`` block tables cut to the blocks that hold each context, padded with block 0."""
    counts = [-(-length // block_size) for length in lengths]
    width = max(counts)
    rows = [table[:count] + [0] * (width - count) for table, count in zip(tables, counts)]
    return torch.tensor(rows, dtype=torch.long, device=device)


class ModelRunner:
    """Runs steps of a transformers model over a paged KV pool.

    Llama-family models run the lean forward of ``engine.fastpath`` (same weights, fewer ops); any other
    architecture runs transformers' own modules with the ``kvserve`` attention function.

    Args:
        loaded: the model (already wired to the ``kvserve`` attention, quantized if it is to be).
        pool: the KV pool; its geometry must match the model.
    """

    def __init__(self, loaded: LoadedModel, pool: KVPool) -> None:
        self.loaded = loaded
        self.pool = pool
        self.device = loaded.device
        self.fast = fast_decoder(loaded.model)

    def _metadata(self, plan: StepPlan) -> AttentionMetadata:
        device, block_size = self.device, self.pool.block_size
        slot_mapping = [slot for w in plan.work for slot in w.slot_mapping]
        decode_rows: list[int] = []
        decodes: list[SeqWork] = []
        prefills: list[PrefillSpan] = []
        row = 0
        for w in plan.work:
            n = len(w.token_ids)
            if n == 1 and w.start_pos > 0:
                decode_rows.append(row)
                decodes.append(w)
            else:
                table = (padded_tables([w.block_table], [w.context_len], block_size, device)[0] if w.start_pos
                         else torch.empty(0, dtype=torch.long, device=device))
                prefills.append(PrefillSpan(start=row, end=row + n, block_table=table, start_pos=w.start_pos))
            row += n
        lens = [w.context_len for w in decodes]
        decode_tables = (padded_tables([w.block_table for w in decodes], lens, block_size, device) if decodes
                         else torch.empty(0, 0, dtype=torch.long, device=device))
        return AttentionMetadata(
            pool=self.pool,
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            decode_rows=torch.tensor(decode_rows, dtype=torch.long, device=device),
            decode_tables=decode_tables,
            decode_lens=torch.tensor(lens, dtype=torch.long, device=device),
            prefills=prefills,
            all_decodes=not prefills,
        )

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[SeqResult]:
        """Compute every token in ``plan`` and sample where asked.

        Returns:
            One SeqResult per SeqWork, in plan order (``token`` is None for a non-final prefill chunk).

        Raises:
            ValueError: an empty plan.
        """
        if not plan.work:
            raise ValueError("empty step plan")
        device = self.device
        input_ids = torch.tensor([[t for w in plan.work for t in w.token_ids]], device=device)  # [1, T]
        positions = torch.tensor([[w.start_pos + i for w in plan.work for i in range(len(w.token_ids))]],
                                 device=device)  # [1, T]
        keep: list[int] = []  # rows whose logits we need
        row = 0
        for w in plan.work:
            n = len(w.token_ids)
            if w.params.prompt_logprobs:
                keep.extend(range(row, row + n))
            elif w.sample:
                keep.append(row + n - 1)
            row += n
        constrained = [w for w in plan.work if w.sample and w.constraint is not None]
        # grammar masks are computed on their own thread while the forward runs; unconstrained steps skip this
        masks = fill_masks_async([w.constraint for w in constrained], [w.output_ids for w in constrained]) \
            if constrained else None
        meta = self._metadata(plan)
        keep_rows = torch.tensor(keep, dtype=torch.long, device=device)
        if self.fast is not None:
            logits = self.fast.forward(input_ids[0], positions[0], meta, keep_rows)  # [len(keep), vocab]
        elif not keep:
            self.loaded.model(input_ids=input_ids, position_ids=positions, use_cache=False,
                              logits_to_keep=torch.tensor([0], device=device), kvserve=meta)
        else:
            logits = self.loaded.model(input_ids=input_ids, position_ids=positions, use_cache=False,
                                       logits_to_keep=keep_rows, kvserve=meta).logits[0]  # [len(keep), vocab]
        if not keep:
            return [SeqResult(seq_id=w.seq_id, token=None) for w in plan.work]
        logits = logits.float()
        if masks is not None:
            self._constrain(plan, logits, masks.result())
        return self._sample(plan, logits)

    def _constrain(self, plan: StepPlan, logits: torch.Tensor, masks: torch.Tensor) -> None:
        """Mask the sampled row of each constrained sequence (in ``masks`` order), so that greedy picks, sampling
        and the reported logprobs all see only the tokens the grammar allows."""
        rows = [first + n - 1 for w, (first, n) in zip(plan.work, self._logit_spans(plan))
                if w.sample and w.constraint is not None]
        apply_masks(logits, rows, masks)

    @staticmethod
    def _logit_spans(plan: StepPlan) -> list[tuple[int, int]]:
        """Per SeqWork, ``(first row, rows)`` of its kept logits: every row with prompt logprobs, else its last
        row when it samples, else none (the order ``execute`` keeps them in)."""
        spans: list[tuple[int, int]] = []
        k = 0
        for w in plan.work:
            n = len(w.token_ids) if w.params.prompt_logprobs else int(w.sample)
            spans.append((k, n))
            k += n
        return spans

    def _sample(self, plan: StepPlan, logits: torch.Tensor) -> list[SeqResult]:
        spans = self._logit_spans(plan)
        batched = self._greedy_rows(plan, spans, logits)
        results: list[SeqResult] = []
        for w, (first, n) in zip(plan.work, spans):
            prompt_lps: list[TokenLogprob] = []
            if w.params.prompt_logprobs:
                rows = logits[first:first + n]  # [n, vocab]
                prompt_lps = self._prompt_logprobs(w, rows)
                last = rows[-1]
            elif w.sample:
                last = logits[first]
            if w.seq_id in batched:
                results.append(SeqResult(seq_id=w.seq_id, token=batched[w.seq_id], prompt_logprobs=prompt_lps))
                continue
            try:
                token = sample_token(last, w) if w.sample else None
            except (RuntimeError, ValueError, IndexError, OverflowError) as exc:  # one bad request, not the batch
                results.append(SeqResult(seq_id=w.seq_id, token=None, error=f"sampling failed: {exc}"))
                continue
            results.append(SeqResult(seq_id=w.seq_id, token=token, prompt_logprobs=prompt_lps))
        return results

    @staticmethod
    def _greedy_rows(plan: StepPlan, spans: list[tuple[int, int]], logits: torch.Tensor) -> dict[int, TokenLogprob]:
        """Tokens of the plain greedy sequences (most of a typical step), all picked in one call."""
        rows: list[int] = []
        works: list[SeqWork] = []
        vocab = logits.shape[-1]
        for w, (first, _) in zip(plan.work, spans):
            # an out-of-range id stays with sample_token, which fails that sequence alone
            if (not w.params.prompt_logprobs and plain_greedy(w)
                    and all(0 <= t < vocab for t in w.suppress_ids)):
                rows.append(first)
                works.append(w)
        if not rows:
            return {}
        picked = logits if len(rows) == logits.shape[0] else logits[rows]  # [len(rows), vocab]
        tokens = greedy_tokens(picked, [w.suppress_ids for w in works])
        return {w.seq_id: token for w, token in zip(works, tokens)}

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
