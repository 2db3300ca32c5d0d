"""The lean Llama-family forward (engine/fastpath.py) computes what transformers' modules compute."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from kvserve.engine.kernelbind import DENSE_MAX_ROWS, INVARIANT_ROWS, Projection, invariant_rows
from kvserve.engine.loader import cpu_has_bf16, wrap_model
from kvserve.engine.plan import SeqWork, StepPlan
from kvserve.engine.rope import ROPE_TABLE_POSITIONS
from kvserve.engine.runner import ModelRunner
from kvserve.kvcache.pool import KVPool
from kvserve import native
from kvserve.quant.layers import Int4Linear, Int8Linear
from kvserve.quant.linear import concat_outputs
from kvserve.quant.model import quantize_model
from tests.engineutil import BLOCK, GREEDY, engine_greedy, reference_greedy, reference_model, run_both, tiny


@pytest.mark.parametrize("arch,overrides", [("llama", {"attention_bias": True}), ("qwen2", {}),
                                            ("mistral", {"sliding_window": 6})])
def test_fast_path_equals_transformers_modules_on_a_mixed_step(arch, overrides):
    loaded = wrap_model(tiny(arch, **overrides), tokenizer=None, name=arch)
    (fast_logits, fast_kv), (ref_logits, ref_kv) = run_both(loaded)
    assert fast_logits.shape == ref_logits.shape == (3, 256)
    torch.testing.assert_close(fast_logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_kv, ref_kv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", ["int8", "int4", "nf4"])
def test_fast_path_with_quantized_fused_projections(scheme, monkeypatch):
    # The fused q/k/v projection and the lean forward against transformers' modules, both on the quantized
    # kernels. The fast path's C++ norms and attention round differently from torch's in the last bits, and
    # int4's int8 activations (a step of 1/127 of a block's max) can turn that into another activation code
    # downstream, so torch's ops are used here; test_decode_ops checks the C++ ops against torch's.
    monkeypatch.setattr(native, "load_ops", lambda build=True: None)
    model = tiny("llama")
    quantize_model(model, scheme)
    loaded = wrap_model(model, tokenizer=None, name=f"llama-{scheme}")
    (fast_logits, _), (ref_logits, _) = run_both(loaded)
    torch.testing.assert_close(fast_logits, ref_logits, rtol=1e-5, atol=1e-5)


def test_sliding_window_greedy_matches_generate():
    model = tiny("mistral", sliding_window=8)
    loaded = wrap_model(copy.deepcopy(model), tokenizer=None, name="mistral-w8")
    prompts = [[5 + (3 * i + j) % 200 for j in range(n)] for i, n in enumerate((3, 13))]
    ours, _ = engine_greedy(loaded, prompts, 20, block_size=4, num_blocks=64, budget=8, max_num_seqs=4)
    ref = reference_model(model)
    assert ours == [reference_greedy(ref, p, 20) for p in prompts]


def test_other_architectures_keep_the_transformers_forward(monkeypatch):
    gemma = wrap_model(tiny("gemma"), tokenizer=None, name="gemma")
    assert ModelRunner(gemma, KVPool(gemma.kv_shape(), 8, BLOCK, gemma.dtype)).fast is None
    llama = wrap_model(tiny("llama"), tokenizer=None, name="llama")
    monkeypatch.setenv("KVSERVE_FASTPATH", "0")
    assert ModelRunner(llama, KVPool(llama.kv_shape(), 8, BLOCK, llama.dtype)).fast is None


def test_smollm2_takes_the_fast_path(smollm2):
    runner = ModelRunner(smollm2, KVPool(smollm2.kv_shape(), 8, 16, smollm2.dtype))
    assert runner.fast is not None
    layer = runner.fast.projections[0]
    assert layer.qkv.module.out_features == 576 + 2 * 192
    # the original projections read the fused rows: no second copy of the weights
    k_proj = smollm2.model.model.layers[0].self_attn.k_proj
    assert k_proj.weight.data_ptr() == layer.qkv.module.weight.data_ptr() + 576 * 576 * 4
    assert layer.qkv.dense and runner.fast.lm_head.dense  # float32 decode rows take the f32_linear kernel


@pytest.mark.parametrize("layer_class", [Int8Linear, Int4Linear])
def test_concat_outputs_is_exact_and_shares_codes(layer_class):
    torch.manual_seed(1)
    linears = [torch.nn.Linear(256, out, bias=True) for out in (64, 32, 32)]
    layers = [layer_class(lin) for lin in linears]
    x = torch.randn(3, 256)
    separate = torch.cat([layer(x) for layer in layers], dim=-1)
    fused = concat_outputs(layers)
    assert fused.out_features == 128
    assert torch.equal(fused(x), separate)
    assert layers[1].weight.data_ptr() == fused.weight[64:].data_ptr()
    with pytest.raises(ValueError):
        concat_outputs([Int8Linear(linears[0]), Int4Linear(linears[1])])


@pytest.mark.parametrize("rows,k", [(1, 576), (5, 64), (32, 48), (3, 20)])
def test_f32_linear_kernel_matches_torch(rows, k):
    from kvserve import native
    kernel = native.load()
    if kernel is None:
        pytest.skip("kernels not built on this machine")
    torch.manual_seed(2)
    w, x = torch.randn(70, k), torch.randn(rows, k)  # k = 20: not a multiple of 8, the scalar loop
    # outputs are sums of k unit-normal products (|y| ~ sqrt(k)); summation order differs from torch's
    torch.testing.assert_close(kernel.f32_linear(x, w), torch.nn.functional.linear(x, w), rtol=1e-5, atol=5e-5)


def test_unfused_qkv_fallback_equals_transformers_modules(monkeypatch):
    # q in int8, k and v in int4: codes of two schemes cannot be stacked, so q/k/v stay three calls. torch's
    # norms and attention, as in the quantized test above.
    monkeypatch.setattr(native, "load_ops", lambda build=True: None)
    model = tiny("llama", attention_bias=True)
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.q_proj = Int8Linear(attn.q_proj)
        attn.k_proj, attn.v_proj = Int4Linear(attn.k_proj), Int4Linear(attn.v_proj)
    loaded = wrap_model(model, tokenizer=None, name="llama-unfused")
    fast = ModelRunner(loaded, KVPool(loaded.kv_shape(), 8, BLOCK, loaded.dtype)).fast
    assert fast.projections[0].qkv is None and len(fast.projections[0].separate_qkv) == 3
    (fast_logits, fast_kv), (ref_logits, ref_kv) = run_both(loaded)
    torch.testing.assert_close(fast_logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_kv, ref_kv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_decode_row_does_not_depend_on_the_rest_of_the_step(scheme):
    # The integer kernels serve every call, so a decode computed alone and computed next to a 40-token prefill
    # (a 41-row step, past any small-batch limit) gets bitwise the same logits: int8 activations would turn a
    # last-bit difference into a different greedy token now and then.
    model = tiny("llama")
    quantize_model(model, scheme, head=True)
    loaded = wrap_model(model, tokenizer=None, name=f"llama-{scheme}")
    logits = []
    for with_prefill in (False, True):
        pool = KVPool(loaded.kv_shape(), 32, BLOCK, loaded.dtype)
        runner = ModelRunner(loaded, pool)
        table = list(range(8))
        warm = SeqWork(0, list(range(3, 9)), 0, table, list(range(6)), False, GREEDY, list(range(3, 9)), [])
        runner.execute(StepPlan([warm]))
        step = [SeqWork(0, [9], 6, table, [6], True, GREEDY, list(range(3, 9)), [9])]
        if with_prefill:
            other = list(range(8, 32))
            step.append(SeqWork(1, list(range(20, 60)), 0, other, [other[p // BLOCK] * BLOCK + p % BLOCK
                                                                    for p in range(40)], False, GREEDY,
                                list(range(20, 60)), []))
        logits.append(runner.logits(StepPlan(step))[0])
    assert torch.equal(logits[0], logits[1])


def decode_step_both_loops(loaded) -> tuple[list[bool], list[tuple[torch.Tensor, torch.Tensor]]]:
    """An all-decode step of 3 sequences run with the bare kernels allowed and with ``direct`` cleared: whether
    the bare kernels ran, and the (logits, KV pool) of each."""
    ran, outputs = [], []
    for direct in (True, False):
        pool = KVPool(loaded.kv_shape(), 32, BLOCK, loaded.dtype)
        runner = ModelRunner(loaded, pool)
        calls: list[int] = []
        if runner.fast.direct is not None and direct:
            runner.fast.direct = [replace(k, qkv=lambda h, qkv=k.qkv: calls.append(1) or qkv(h))
                                  for k in runner.fast.direct]
        elif not direct:
            runner.fast.direct = None
        tables = [list(range(s * 8, s * 8 + 8)) for s in range(3)]
        runner.execute(StepPlan([SeqWork(s, list(range(3 + s, 12 + s)), 0, tables[s],
                                         [tables[s][p // BLOCK] * BLOCK + p % BLOCK for p in range(9)], False,
                                         GREEDY, list(range(3, 12)), []) for s in range(3)]))
        calls.clear()  # prefill rows attend as decode rows (engine/runner.py _rows_alone): the bare kernels may run
        logits = runner.logits(StepPlan([SeqWork(s, [20 + s], 9, tables[s], [tables[s][2] * BLOCK + 1], True, GREEDY,
                                                 list(range(3, 12)), [20 + s]) for s in range(3)]))
        ran.append(len(calls) == len(loaded.model.model.layers))
        outputs.append((logits, pool.data.clone()))
    return ran, outputs


@pytest.mark.parametrize("scheme", ["none", "int8", "int4", "nf4"])
def test_direct_kernels_give_the_bits_of_the_checked_projections(scheme):
    # All-decode float32 steps call the bare kernels (no checks); they must compute exactly what the checked
    # Projections compute, logits and written K/V alike.
    model = tiny("llama")
    if scheme != "none":
        quantize_model(model, scheme, head=True)
    ran, outputs = decode_step_both_loops(wrap_model(model, tokenizer=None, name=f"llama-{scheme}"))
    assert ran == [True, False]
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])


def test_direct_kernels_with_a_sliding_window():
    # a 4-token window over 10-token contexts: the window reaches the fused decode attention call
    loaded = wrap_model(tiny("mistral", sliding_window=4), tokenizer=None, name="mistral-w4")
    ran, outputs = decode_step_both_loops(loaded)
    assert ran == [True, False]
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])


@pytest.mark.parametrize("arch,overrides", [("qwen2", {}), ("llama", {"attention_bias": True}),
                                            ("llama", {"hidden_act": "gelu"})])
def test_models_the_bare_kernels_cannot_serve_take_the_checked_projections(arch, overrides):
    # projection biases (Qwen2's q/k/v) and non-SiLU activations are not served by the bare kernels: those
    # steps take the checked Projections, with the same results
    ran, outputs = decode_step_both_loops(wrap_model(tiny(arch, **overrides), tokenizer=None, name=arch))
    assert ran == [False, False]
    assert torch.equal(outputs[0][0], outputs[1][0])


def test_quantized_gate_and_up_are_one_kernel_call_sharing_the_codes():
    model = tiny("llama")
    quantize_model(model, "int4")
    loaded = wrap_model(model, tokenizer=None, name="llama-int4")
    layer = ModelRunner(loaded, KVPool(loaded.kv_shape(), 8, BLOCK, loaded.dtype)).fast.projections[0]
    mlp = model.model.layers[0].mlp
    assert layer.gate_up is not None and layer.gate is None
    assert mlp.up_proj.weight.data_ptr() == layer.gate_up.module.weight.data_ptr() + 128 * 64 // 2
    x = torch.randn(3, 64)
    # per output row, one call or two: same bits
    assert torch.equal(layer.gate_up(x), torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1))


def test_rope_table_rows_are_the_rotary_modules_values():
    loaded = wrap_model(tiny("llama"), tokenizer=None, name="llama")
    rope = ModelRunner(loaded, KVPool(loaded.kv_shape(), 8, BLOCK, loaded.dtype)).fast.rope
    assert rope.static
    positions = torch.tensor([0, 5, 4095, ROPE_TABLE_POSITIONS - 1, 17])
    x = torch.zeros(5, 64)
    cos, sin = rope.cos_sin(x, positions)
    ref_cos, ref_sin = rope.rotary(x[None], positions[None])
    assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])
    beyond = torch.tensor([3, ROPE_TABLE_POSITIONS + 2])  # past the table: the module itself
    cos, _ = rope.cos_sin(x[:2], beyond)
    assert torch.equal(cos, rope.rotary(x[None, :2], beyond[None])[0][0])


@pytest.mark.skipif(native.load() is None or native.load_ops() is None, reason="C++ kernels could not be built here")
def test_loading_a_model_on_cpu_loads_the_kernels_before_any_request(smollm2, tmp_path):
    # a fresh process: load_model itself must bring in both extensions (a compile inside the first request
    # cost it 50 s of TTFT)
    import subprocess
    import sys

    tiny("llama").save_pretrained(tmp_path)
    smollm2.tokenizer.save_pretrained(tmp_path)
    code = ("from kvserve import native; from kvserve.engine.loader import load_model, DType, Device; "
            f"load_model({str(tmp_path)!r}, DType.FLOAT32, Device.CPU); "
            "print(sorted(name for name, module in native._state.items() if module is not None))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split("\n")[-2] == "['kvserve_decode_ops', 'kvserve_qlinear']"


@pytest.mark.skipif(not cpu_has_bf16(), reason="this CPU has no native bfloat16 (AVX-512 BF16 or AMX)")
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 576), (1536, 576), (576, 1536),
                                                      (49152, 576)], ids=["qkv", "o", "gate", "down", "head"])
def test_a_bfloat16_projections_rows_are_those_of_the_row_alone(out_features, in_features, record_property):
    """SmolLM2's projection shapes in bfloat16: a Projection gives every row of a call of any size (up to 100 rows
    here) the bits of that row alone. How many rows torch's GEMM keeps invariant by itself depends on the CPU's
    oneDNN kernels (32 on one AVX-512 BF16 EPYC, 1 for the down projection on another), so it is probed per shape
    (invariant_rows) and reported, not assumed; the probe's answer is checked on other data."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16)
    x = torch.randn(100, in_features, dtype=torch.bfloat16)
    rows = invariant_rows(out_features, in_features, torch.bfloat16)
    record_property("invariant_rows", rows)
    assert 1 <= rows <= INVARIANT_ROWS
    with torch.inference_mode():
        alone = torch.cat([linear(row[None]) for row in x])  # [100, out]
        for size in range(2, rows + 1):
            assert torch.equal(linear(x[:size]), alone[:size]), size
        projection = Projection(linear)
        assert projection.row_blocks == rows
        for size in (2, rows + 1, 64, 100):
            assert torch.equal(projection(x[:size]), alone[:size]), size


def test_a_float32_projections_rows_do_not_depend_on_how_many_rows_share_the_call(smollm2):
    # past 64 rows too: torch's GEMM would change last bits there, and a quantized cache would round them into
    # other codes (speculation's verify rows batched with long prefills changed greedy tokens with float32 weights)
    projection = Projection(smollm2.model.model.layers[0].mlp.down_proj)
    assert projection.dense
    torch.manual_seed(0)
    x = torch.randn(2 * DENSE_MAX_ROWS + 9, projection.module.in_features)
    alone = torch.cat([projection(row[None]) for row in x])
    assert torch.equal(projection(x), alone)
    assert torch.equal(projection(x[:DENSE_MAX_ROWS + 1]), alone[:DENSE_MAX_ROWS + 1])
