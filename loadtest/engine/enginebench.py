"""Timing steps of the real engine: ``engine.runner.ModelRunner`` over a ``kvcache.pool.KVPool``.

Used by ``simulate`` (per-step costs) and ``tables`` (prefill, decode and batch sweeps). Each sequence gets
its own contiguous run of blocks, so plans can be built without the scheduler:

    sequence s, block_size 16, blocks_per_seq 20:  blocks 20*s .. 20*s+19
    slot of position p = (20*s + p // 16) * 16 + p % 16
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from kvserve.engine.heap import loading_heap
from kvserve.engine.loader import Device, DType, LoadedModel, load_model
from kvserve.engine.plan import SamplingParams, SeqWork, StepPlan
from kvserve.engine.runner import ModelRunner
from kvserve.kvcache.pool import KVPool, storage_dtype
from kvserve.kvcache.sizing import KVCacheDType
from kvserve.loadtest.errors import UsageError

GREEDY = SamplingParams(temperature=0.0)


class EngineBench:
    """A runner over a pool with ``num_seqs`` sequences of up to ``max_len`` tokens each.

    Args:
        loaded: the model (from ``engine.loader.load_model``).
        num_seqs: sequences the pool must hold at once.
        max_len: longest context of any sequence (tokens).
        block_size: tokens per block.
    """

    def __init__(self, loaded: LoadedModel, num_seqs: int, max_len: int, block_size: int = 16,
                 cache_dtype: str = "auto") -> None:
        self.loaded = loaded
        self.block_size = block_size
        self.blocks_per_seq = -(-max_len // block_size)
        shape = loaded.kv_shape(KVCacheDType(cache_dtype))  # as --kv-cache-dtype
        self.pool = KVPool(shape, num_seqs * self.blocks_per_seq, block_size, storage_dtype(shape, loaded.dtype),
                           loaded.device)
        self.runner = ModelRunner(loaded, self.pool)

    def table(self, seq: int) -> list[int]:
        """Block table of sequence ``seq``."""
        return list(range(seq * self.blocks_per_seq, (seq + 1) * self.blocks_per_seq))

    def work(self, seq: int, token_ids: list[int], start_pos: int) -> SeqWork:
        """Compute ``token_ids`` at positions ``start_pos ..`` for sequence ``seq`` and sample a token."""
        table = self.table(seq)
        slots = [table[p // self.block_size] * self.block_size + p % self.block_size
                 for p in range(start_pos, start_pos + len(token_ids))]
        return SeqWork(seq, list(token_ids), start_pos, table, slots, True, GREEDY, list(token_ids), [])

    def prefill(self, seq: int, token_ids: list[int]) -> SeqWork:
        return self.work(seq, token_ids, 0)

    def decode(self, seq: int, context_len: int, token_id: int = 42) -> SeqWork:
        """One decode token for a sequence whose first ``context_len`` positions are cached."""
        return self.work(seq, [token_id], context_len)

    def fill(self, seq: int, context_len: int) -> None:
        """Write a real KV prefix of ``context_len`` tokens for ``seq`` (so decodes attend to real keys)."""
        self.runner.execute(StepPlan([self.prefill(seq, dummy_ids(context_len))]))

    def time_plan(self, work: list[SeqWork], reps: int = 5, warmup: int = 1) -> float:
        """Median wall time of ``runner.execute`` on the plan (s). Rerunning rewrites the same slots."""
        return self.time_plans([work], reps, warmup)[0]

    def time_plans(self, works: list[list[SeqWork]], reps: int = 5, warmup: int = 1) -> list[float]:
        """Median wall time (s) of each plan, timed round-robin (one run of each plan per round).

        On a shared machine a slow spell then lands on every plan alike instead of on a few points.
        """
        plans = [StepPlan(work) for work in works]
        for _ in range(warmup):
            for plan in plans:
                self.runner.execute(plan)
        times: list[list[float]] = [[] for _ in plans]
        for _ in range(reps):
            for plan, bucket in zip(plans, times):
                start = time.perf_counter()
                self.runner.execute(plan)
                bucket.append(time.perf_counter() - start)
        return [statistics.median(bucket) for bucket in times]


def dummy_ids(n: int, offset: int = 1000) -> list[int]:
    """``n`` ordinary token ids (a fixed pattern: the content does not change the cost)."""
    return [offset + (i * 37) % 5000 for i in range(n)]


def check_engine_flags(model: str | None, device: str) -> None:
    """Fail fast, before any work, when ``--device`` or ``--model`` cannot be served here.

    Raises:
        UsageError: no such device (``--device cuda`` without a GPU) or no such model directory.
    """
    from kvserve.engine.loader import gguf_file, resolve_device, resolve_model_dir

    try:
        resolve_device(Device(device))
        if model is not None:
            path = resolve_model_dir(model)
            # a GGUF file's derived directory holds its config and tokenizer only: the weights are the file's
            if gguf_file(model) is None and path.is_dir() and not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
                raise FileNotFoundError(f"--model {model!r} has a config.json but no weights (*.safetensors, "
                                        "pytorch_model*.bin)")
    except (ValueError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from exc


def check_out_dir(path: Path) -> None:
    """Create ``path`` (an output directory) now, so a bad ``--out`` fails before any work.

    Raises:
        UsageError: it cannot be created or is not a directory.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {str(path)!r}: {exc.strerror or exc}") from exc


def load(dtype: DType = DType.AUTO, model: str | None = None, device: Device = Device.AUTO,
         quantized: bool = False, blocks: bool = False) -> LoadedModel:
    """``model`` (default: the embedded one) as ``kvserve serve`` loads it with these ``--dtype``/``--device``
    (``quantized``: as it loads a model it is about to quantize; ``blocks``: a GGUF file's own blocks kept), with
    the heap as the server's after loading (``engine.heap.loading_heap``: steps then allocate as a server's do)."""
    torch.manual_seed(0)
    with loading_heap():
        return load_model(model, dtype, device, quantized, blocks=blocks)


def load_served(quantization: str = "auto", dtype: DType = DType.AUTO, model: str | None = None,
                device: Device = Device.AUTO) -> tuple[LoadedModel, str]:
    """``model`` with its weights as ``kvserve serve --quantization Q`` serves them (``engine.weights``: auto is
    the GGUF's own blocks for the embedded model). int8/int4 codes are rounded to nearest, not calibrated: the same
    kernels at the same cost.

    Returns:
        The model, and the scheme served (auto resolved).

    Raises:
        ValueError: as ``engine.weights.choose`` (gguf for a model that is not a GGUF file).
    """
    from kvserve.engine import weights
    from kvserve.quant.options import Scheme

    choice = weights.choose(Scheme(quantization), model)
    loaded = load(dtype, model, device, quantized=choice.scheme is not Scheme.NONE, blocks=choice.scheme is Scheme.GGUF)
    weights.apply(loaded, choice.scheme, model)
    return loaded, choice.scheme.value
