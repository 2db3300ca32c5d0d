"""Token masks of a step's constrained rows: computed beside the forward pass, applied to its logits.

The per-step side of constrained decoding (engine.constraints compiles the grammars and owns each sequence's
matcher): ``fill_masks`` asks every constrained row's matcher for its allowed tokens in one call into llguidance,
on a thread of its own while the forward runs, and ``apply_masks`` sets the rest to minus infinity before
sampling. It changes with the step loop and the sampler; the grammar side changes with what clients may ask.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
import torch

from kvserve.engine.constraints import Constraint

# Masks of one step are computed here while the forward pass runs. This thread runs no torch ops: a second
# thread's torch ops would start a second OpenMP team next to the forward's, and on a busy CPU the two teams'
# barriers stall each other (100+ ms per mask, measured). It holds the GIL only to sync the matchers; the masks
# themselves are one call into llguidance's executor, which releases the GIL and runs on one thread of its own
# (more would take cores from the forward's OpenMP team).
_MASK_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-mask")
_EXECUTOR = llguidance.LLExecutor(num_threads=1)


def fill_masks(constraints: list[Constraint], output_ids: list[list[int]]) -> torch.Tensor:
    """Allowed next tokens of each constrained sequence, as a packed bitmask.

    Args:
        constraints: one per constrained row of the step.
        output_ids: each sequence's accepted output tokens (its matcher is synced to them first).

    Returns:
        ``[len(constraints), ceil(vocab / 32)]`` int32 (CPU): bit j of word w is set when token ``32 * w + j`` is
        allowed (llguidance's layout). A row whose matcher allows nothing (an error state) allows its EOS tokens,
        so the sequence ends instead of sampling from all minus infinity.
    """
    words = (constraints[0].vocab_size + 31) // 32
    bitmask = np.zeros((len(constraints), words), dtype=np.int32)
    for constraint, ids in zip(constraints, output_ids):
        constraint.sync(ids)
    # one call for the batch: the GIL is released while it runs (the forward's Python thread goes on)
    _EXECUTOR.unsafe_compute_mask_ptr([(c.matcher, row) for row, c in enumerate(constraints)],
                                      bitmask.ctypes.data, words * 4, len(constraints))
    bits = bitmask.view(np.uint32)  # [rows, words]; unsigned, so bit 31 can be set without overflow
    for constraint, row_bits in zip(constraints, bits):
        if constraint.thinking:  # its grammar starts after the thinking block (engine.constraints)
            constraint.allow_thinking(row_bits)
        elif not constraint.matcher.is_error():
            constraint.allowed_now(row_bits)
    for row in np.flatnonzero(~bits.any(axis=1)).tolist():
        for eos in constraints[row].eos_ids:
            bits[row, eos // 32] |= np.uint32(1 << (eos % 32))
    return torch.from_numpy(bitmask)  # [rows, words]


def fill_masks_async(constraints: list[Constraint], output_ids: list[list[int]]) -> Future:
    """``fill_masks`` on the mask thread; the caller runs the forward pass meanwhile."""
    return _MASK_THREAD.submit(fill_masks, constraints, [list(ids) for ids in output_ids])


def disallowed(masks: torch.Tensor) -> torch.Tensor:
    """``[rows, 32 * words]`` bool, True where ``fill_masks``'s bitmask ``[rows, words]`` does not allow a token."""
    # the inverted words as little-endian bytes, each byte's bits low first: token order; a bool view, no copy
    inverted = np.invert(masks.numpy()).astype("<i4", copy=False).view(np.uint8)  # [rows, 4 * words]
    return torch.from_numpy(np.unpackbits(inverted, axis=1, bitorder="little").view(np.bool_))


def apply_masks(logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> None:
    """Set disallowed tokens of ``logits[rows]`` to minus infinity, in place.

    Args:
        logits: ``[num_rows, model_vocab]`` float logits; columns past the tokenizer's vocabulary (padding rows
            of the embedding) are never allowed.
        rows: which rows of ``logits`` are constrained, in ``masks`` order.
        masks: ``[len(rows), words]`` int32 bitmask from ``fill_masks``.
    """
    banned = disallowed(masks)  # [len(rows), 32 * words]
    cols = min(banned.shape[1], logits.shape[1])
    if not logits.is_cpu or logits.dtype != torch.float32:  # numpy has no bfloat16
        _apply_torch(logits, rows, banned, cols)
        return
    # numpy, row by row in place: single-threaded, so it never waits on an OpenMP barrier (torch's ops on these
    # rows split them across the team; on a busy CPU one late thread stalls them, measured 2-8x slower), and each
    # row's logits stay in cache while masked
    values = logits.numpy()
    for row, banned_row in zip(rows, banned.numpy()):
        values[row, cols:] = -np.inf
        np.putmask(values[row, :cols], banned_row[:cols], -np.inf)


def _apply_torch(logits: torch.Tensor, rows: list[int], banned: torch.Tensor, cols: int) -> None:
    """``apply_masks`` on any device and dtype (the float32 CPU path's reference in the tests)."""
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    picked = logits[index]  # [len(rows), model_vocab]
    picked[:, cols:] = float("-inf")
    picked[:, :cols].masked_fill_(banned[:, :cols].to(logits.device), float("-inf"))
    logits[index] = picked
