"""Peak memory of generating with and without a KV cache, beyond the resident weights (run as a subprocess).

    python -m loadtest.memprobe cache 256     # prints one JSON line

Method (Linux): load the model and warm it up, read VmRSS as the baseline (weights, libraries, allocator
state), reset the peak with ``echo 5 > /proc/self/clear_refs`` (proc(5)), generate, read VmHWM; the figure is
VmHWM - baseline. A fresh process per mode keeps one mode's allocations out of the other's baseline.

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
from pathlib import Path

import torch

from engine.plan import StepPlan
from loadtest.enginebench import EngineBench, dummy_ids, load


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def probe(mode: str, tokens: int) -> dict:
    """Measure one mode; returns baseline and peak RSS and their difference (bytes).

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
    if mode == "cache":
        bench = EngineBench(loaded, 1, tokens + 1)
        token = bench.runner.execute(StepPlan([bench.prefill(0, dummy_ids(1))]))[0].token.token_id
        for position in range(1, tokens):
            token = bench.runner.execute(StepPlan([bench.decode(0, position, token)]))[0].token.token_id
        extra_note = {"pool_bytes": bench.pool.nbytes}
    else:
        with torch.inference_mode():
            plain(input_ids=torch.tensor([dummy_ids(tokens)]), use_cache=False, logits_to_keep=1)
        extra_note = {}
    peak = _status_kib("VmHWM") * 1024
    return {"mode": mode, "tokens": tokens, "baseline_bytes": baseline, "peak_bytes": peak,
            "extra_bytes": peak - baseline, **extra_note}


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1], int(sys.argv[2]))))
