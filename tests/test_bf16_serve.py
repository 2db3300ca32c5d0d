"""`--quantization none` on a CPU: bfloat16 weights on the AVX512-BF16 kernel with float32 activations and the
fused float32 fast path where that kernel runs, float32 weights on the float32 kernels where it does not
(KVSERVE_ISA=avx2 forces that here), and a start log that says which and why.

Exactness (alone, batched, preempted, on a prefix hit, speculating) runs in tests/test_exactness.py and
tests/test_speculative.py over tests/engineutil.py's SERVED ("bf16-kernel").
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from kvserve import native
from kvserve.engine.fastpath import fast_decoder
from kvserve.engine.loader import DType, serves_bf16_kernel
from kvserve.quant.bf16 import BF16Linear
from kvserve.server.config import ServeConfig
from tests.engineutil import NEAR_TIE_LOGITS, engine_greedy, reference_model, reference_shortfall

ROOT = Path(__file__).resolve().parent.parent
RUNS = native.load() is not None and serves_bf16_kernel(DType.AUTO, torch.device("cpu"))
needs_kernel = pytest.mark.skipif(not RUNS, reason="the AVX512-BF16 kernel does not run on this CPU / ISA path")


@pytest.fixture(scope="module")
def started(caplog_module):
    """``build_state`` as ``kvserve serve --quantization none`` runs it, with its start log."""
    from kvserve.server.serve import build_state

    state = build_state(ServeConfig(quantization="none", num_kv_blocks=16, device="cpu"))
    return state, [r.getMessage() for r in caplog_module.records]


@pytest.fixture(scope="module")
def caplog_module():
    handler = _Records()
    logger = logging.getLogger("kvserve")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@needs_kernel
def test_none_serves_the_bf16_weights_on_the_kernel_with_float32_activations(started):
    state, messages = started
    loaded = state.loaded
    assert loaded.dtype is torch.float32 and loaded.bf16_weights
    layers = [m for m in loaded.model.modules() if isinstance(m, BF16Linear)]
    assert len(layers) == 30 * 7 + 1  # every projection and the LM head
    assert not any(type(m) is nn.Linear for m in loaded.model.modules())
    assert all(p.dtype is torch.float32 for p in loaded.model.parameters())  # embedding and norms, widened
    loaded_line = next(m for m in messages if m.startswith("model SmolLM2-135M-Instruct loaded"))
    assert "bfloat16 weights on the AVX512-BF16 kernel with float32 activations" in loaded_line
    assert "--dtype bfloat16 torch's bfloat16 ops" in loaded_line
    weights_line = next(m for m in messages if m.startswith("weights: "))
    assert weights_line.startswith("weights: full precision (bfloat16 weights on the AVX512-BF16 kernel, float32 "
                                   "activations) (--quantization none")


@needs_kernel
def test_the_fast_path_calls_the_bare_kernels_and_fused_ops(started):
    decoder = fast_decoder(started[0].loaded.model)
    assert decoder is not None and decoder.direct is not None  # every projection a bound C++ kernel
    assert decoder.direct_max_rows > 10**6  # every call: no row limit, so prefill chunks take it too
    assert all(p.kernel is not None and isinstance(p.module, BF16Linear) for p in decoder.all_projections())


@needs_kernel
def test_served_greedy_output_is_the_transformers_forward_on_the_same_layers_up_to_near_ties(started):
    loaded = started[0].loaded
    prompts = [loaded.tokenizer(p)["input_ids"] for p in ("The capital of France is", "def add(a, b):")]
    ours, _ = engine_greedy(loaded, prompts, 24)
    ref = reference_model(loaded.model)  # transformers' modules over the same BF16Linear layers
    for ids, tokens in zip(prompts, ours):
        assert reference_shortfall(ref, ids, tokens) <= NEAR_TIE_LOGITS


CHILD = """
import torch
from kvserve.engine.loader import Device, DType, load_model
from kvserve.engine.fastpath import fast_decoder
from kvserve.quant.bf16 import BF16Linear
from kvserve.quant.options import Scheme
from kvserve.server.config import ServeConfig
from kvserve.server.serve import dtype_reason
loaded = load_model(None, DType.AUTO, Device.CPU)
decoder = fast_decoder(loaded.model)
print(loaded.dtype, loaded.bf16_weights, any(isinstance(m, BF16Linear) for m in loaded.model.modules()),
      all(p.dense for p in decoder.all_projections()))
print(dtype_reason(ServeConfig(quantization="none"), loaded, Scheme.NONE))
"""


@pytest.mark.skipif(native.load() is None, reason="the kernels do not build on this machine")
@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_a_lesser_isa_path_serves_float32_weights_on_the_float32_kernels(isa):
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env={**os.environ, "KVSERVE_ISA": isa},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    facts, reason = done.stdout.strip().splitlines()[-2:]
    assert facts == "torch.float32 False False True"  # float32 weights, every projection on f32_linear
    assert reason == (f"--dtype auto: float32 weights with the float32 kernels, as no bfloat16 kernel runs on the "
                      f"kernel path {isa} (forced by KVSERVE_ISA) (it needs AVX512-BF16 on the avx512 path); "
                      "--dtype bfloat16 runs torch's bfloat16 ops")
