"""The baseline users start from: transformers' own ``generate`` (its DynamicCache, sdpa attention), in-process.

Static batching only: a batch of prompts (left-padded) runs until its longest request is done, so in seed64
a request pinned to 5 tokens keeps its row busy for as long as its batch's 231-token neighbour. Only the
tokens each request asked for count as output. Output lengths are pinned with
``min_new_tokens = max_new_tokens``; decoding is greedy.
"""

from __future__ import annotations

import copy
import time

import torch

from kvserve.loadtest.engine.enginebench import load
from kvserve.loadtest.loadgen import workloads


class HFGenerate:
    """A model (default: the embedded one) as ``kvserve serve --quantization none`` loads it (same weights and
    dtype), run by ``generate``."""

    def __init__(self, model: str | None = None) -> None:
        loaded = load(model=model)
        self.model = copy.deepcopy(loaded.model)
        self.model.set_attn_implementation("sdpa")
        self.tokenizer = loaded.tokenizer
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token

    @torch.inference_mode()
    def _generate_s(self, prompts: list[str], new_tokens: int) -> float:
        """Wall time (s) of one ``generate`` call producing exactly ``new_tokens`` tokens per prompt."""
        batch = self.tokenizer(prompts, return_tensors="pt", padding=True)
        start = time.perf_counter()
        self.model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                            pad_token_id=self.tokenizer.pad_token_id)
        return time.perf_counter() - start

    def ttft_s(self, prompt: str) -> float:
        """Time to the first token: ``generate`` with one new token (prefill + one sample), seconds."""
        return self._generate_s([prompt], 1)

    def single_decode_tps(self, new_tokens: int) -> float:
        """One stream's decode speed: (n - 1) tokens over (time for n tokens - time for 1), tokens/s."""
        prompt = [workloads.seed64_prompt(0)]
        self._generate_s(prompt, 2)  # warm-up
        first = self._generate_s(prompt, 1)
        full = self._generate_s(prompt, new_tokens)
        return (new_tokens - 1) / (full - first)

    def batch_tps(self, streams: int, new_tokens: int) -> float:
        """Output tokens/s of one static batch of ``streams`` prompts, ``new_tokens`` each."""
        prompts = [workloads.seed64_prompt(i) for i in range(streams)]
        return streams * new_tokens / self._generate_s(prompts, new_tokens)

    def seed64_tps(self, batch_size: int) -> float:
        """seed64 in static batches of ``batch_size`` in file order; useful output tokens/s."""
        specs = workloads.seed64()
        total_s = 0.0
        for first in range(0, len(specs), batch_size):
            group = specs[first:first + batch_size]
            total_s += self._generate_s([s.prompt for s in group], max(s.max_tokens for s in group))
        return sum(s.max_tokens for s in specs) / total_s
