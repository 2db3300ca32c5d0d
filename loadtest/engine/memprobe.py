"""Peak memory of generating with and without a KV cache, beyond the resident weights (run as a subprocess).

    python -m kvserve.loadtest.engine.memprobe cache 256     # prints one JSON line

Method: ``LiveTensorBytes`` follows every tensor that an ATen op creates while generating (the weights
exist before it starts, so they are excluded) and records the peak of their total bytes: an exact,
allocator-independent figure (buffers private to a kernel are not tensors and are not seen). The process's
RSS high-water mark over the same span (VmHWM after ``echo 5 > /proc/self/clear_refs``, minus VmRSS before)
is reported alongside; it is noisy because the allocator reuses memory freed while loading.
A fresh process per mode keeps one mode's allocations out of the other's.

- cache: our runner over a KVPool sized for the sequence (allocated after the reset, so it is counted),
  1-token prompt, then one decode step per token.
- nocache: the model recomputes the whole context every step (transformers sdpa, ``use_cache=False``,
  only the last position's logits). Each step frees its activations before the next, so the loop's peak
  is the peak of its longest step; we run that step (the full context) only.
"""

from __future__ import annotations

import copy
import json
import sys
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kvserve.engine.plan import StepPlan
from kvserve.loadtest.engine.enginebench import EngineBench, dummy_ids, load


class LiveTensorBytes(TorchDispatchMode):
    """Peak total bytes of live tensors created by ops under this mode (views share their storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage data_ptr -> [tensor objects alive, bytes]

    def _release(self, key: int) -> None:
        entry = self._refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in self._refs:
                self._refs[key] = [0, storage.nbytes()]
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
            self._refs[key][0] += 1
            weakref.finalize(tensor, self._release, key)
        return out


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def probe(mode: str, tokens: int) -> dict:
    """Measure one mode; returns the peak of live tensor bytes, and RSS figures (bytes).

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in ("cache", "nocache"):
        raise ValueError(f"mode must be cache or nocache, not {mode!r}")
    loaded = load()
    plain = None
    if mode == "nocache":
        plain = copy.deepcopy(loaded.model)
        plain.set_attn_implementation("sdpa")
        with torch.inference_mode():
            plain(input_ids=torch.tensor([dummy_ids(8)]), use_cache=False, logits_to_keep=1)
    else:
        EngineBench(loaded, 1, 16).fill(0, 8)
    baseline = _status_kib("VmRSS") * 1024
    _reset_peak()
    with LiveTensorBytes() as tracker:
        extra_note = _generate(mode, tokens, loaded, plain)
    peak = _status_kib("VmHWM") * 1024
    return {"mode": mode, "tokens": tokens, "peak_tensor_bytes": tracker.peak, "rss_baseline_bytes": baseline,
            "rss_peak_bytes": peak, "rss_extra_bytes": peak - baseline, **extra_note}


def _generate(mode: str, tokens: int, loaded, plain) -> dict:
    if mode == "cache":
        bench = EngineBench(loaded, 1, tokens + 1)
        token = bench.runner.execute(StepPlan([bench.prefill(0, dummy_ids(1))]))[0].token.token_id
        for position in range(1, tokens):
            token = bench.runner.execute(StepPlan([bench.decode(0, position, token)]))[0].token.token_id
        return {"pool_bytes": bench.pool.nbytes}
    with torch.inference_mode():
        plain(input_ids=torch.tensor([dummy_ids(tokens)]), use_cache=False, logits_to_keep=1)
    return {}


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1], int(sys.argv[2]))))
