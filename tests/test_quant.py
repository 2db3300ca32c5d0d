"""Quantization: round trips, error ordering on SmolLM2's weights, the C++ kernel against the reference,
saved state, and a quantized model that still answers."""

from __future__ import annotations

import copy
import os
import shutil
import time

import pytest
import torch
from torch import nn

from kvserve import environment, native
from kvserve.quant.layers import Int4Linear, Int8Linear, NF4Linear
from kvserve.quant.linear import Layout, QuantLinear, concat_outputs
from kvserve.quant.model import projection_names, quantize_model, serving_quantizes_head
from kvserve.quant.panels import (pack_int8_panels, pack_nibble_panels, pack_nibbles, unpack_int8_panels,
                                  unpack_nibble_panels, unpack_nibbles)
from kvserve.quant.schemes import (ACT16_BLOCK, ACT_BLOCK, NF4_LEVELS, Granularity, QuantSpec, Scheme, dequantize_int,
                                   dequantize_nf4, fake_quantize, quantize_activations, quantize_int, quantize_nf4,
                                   relative_error)

INT4_TENSOR = QuantSpec(Scheme.INT4, Granularity.TENSOR)
INT4_ROW = QuantSpec(Scheme.INT4, Granularity.ROW)
INT4_GROUP = QuantSpec(Scheme.INT4, Granularity.GROUP, 128)
NF4_BLOCK = QuantSpec(Scheme.NF4, Granularity.GROUP, 64)


def test_group_size_is_the_largest_divisor_not_above_the_wish():
    assert INT4_GROUP.group_for(576) == 96
    assert INT4_GROUP.group_for(1536) == 128
    assert INT4_GROUP.bits_per_weight(576) == pytest.approx(4 + 16 / 96)
    assert NF4_BLOCK.bits_per_weight(1536) == pytest.approx(4.25)
    with pytest.raises(ValueError):
        QuantSpec(Scheme.NF4, Granularity.ROW)
    with pytest.raises(ValueError):
        QuantSpec(Scheme.INT4, Granularity.GROUP)
    with pytest.raises(ValueError, match="int8 is per tensor or per row"):
        QuantSpec(Scheme.INT8, Granularity.GROUP, 64)


def test_nibbles_round_trip():
    codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (5, 32)
    assert packed[0, 0] == codes[0, 0] | (codes[0, 1] << 4)
    assert torch.equal(unpack_nibbles(packed), codes)


def test_panels_round_trip_and_place_each_code_where_the_kernel_reads_it():
    codes = torch.randint(0, 16, (16, 64), dtype=torch.uint8)
    packed = pack_nibble_panels(codes)
    assert packed.shape == (16, 32) and torch.equal(unpack_nibble_panels(packed), codes)
    flat = packed.view(-1)
    # panel 1 (rows 8-15) starts at byte 64 * 4; chunk t = 2 (inputs 16-23); row r = 3, input i = 1:
    # low nibble = codes[11, 17], high nibble = codes[11, 21]
    byte = flat[1 * 64 * 4 + 2 * 32 + 4 * 3 + 1]
    assert byte == codes[11, 17] | (codes[11, 21] << 4)
    assert torch.equal(unpack_nibble_panels(packed[8:]), codes[8:])  # whole panels slice as rows
    with pytest.raises(ValueError, match="multiples of 8"):
        pack_nibble_panels(codes[:12])


def test_int8_panels_round_trip_and_place_each_code_where_the_kernel_reads_it():
    codes = torch.randint(-127, 128, (32, 8), dtype=torch.int8)
    packed = pack_int8_panels(codes)
    assert packed.shape == (32, 8) and torch.equal(unpack_int8_panels(packed), codes)
    # panel 1 (rows 16-31) starts at byte 16 * 8; pair i = 3 (inputs 6, 7); row r = 5, j = 1: codes[21, 7]
    assert packed.view(-1)[16 * 8 + 3 * 32 + 2 * 5 + 1] == codes[21, 7]
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_int8_panels(codes[:24])
    panels, rows = Int8Linear(nn.Linear(576, 48)), Int8Linear(nn.Linear(576, 40))
    assert (panels.layout, rows.layout) == (Layout.PANELS, Layout.ROWS)  # both served by the kernel (rows: row tiles)
    x = torch.randn(3, 576)
    for layer in (panels, rows):
        layer.use_kernel = False
        reference = layer(x)
        layer.use_kernel = True
        assert torch.allclose(layer(x), reference, atol=1e-4, rtol=1e-4), layer.layout


def test_int4_layers_use_panels_only_where_the_integer_kernel_serves_them():
    linears = nn.Linear(576, 24), nn.Linear(576, 20)  # 20 output rows: not whole panels (float table kernel)
    panels, rows = (Int4Linear(linear) for linear in linears)
    assert (panels.layout, panels.kernel_act_block) == (Layout.PANELS, ACT_BLOCK)
    assert (rows.layout, rows.kernel_act_block) == (Layout.ROWS, None)
    for layer, linear in zip((panels, rows), linears):
        assert layer.weight.shape == (layer.out_features, 288)
        assert torch.equal(layer.dequantize(), fake_quantize(linear.weight.detach(), INT4_GROUP))
    with pytest.raises(ValueError, match="layout"):  # q/k/v fusion falls back to separate calls
        concat_outputs([Int4Linear(nn.Linear(576, 8)), Int4Linear(nn.Linear(576, 4))])


@pytest.mark.parametrize("layer_class,out_features", [(Int8Linear, 200), (Int8Linear, 24), (Int4Linear, 12),
                                                      (Int4Linear, 36)])
def test_stacking_row_major_layers_keeps_their_layout_even_when_the_sum_fills_panels(layer_class, out_features):
    # a trial's report: 200 + 200 int8 rows (a gate/up fusion) made 400, a multiple of 16, and the fused layer
    # read its row-major codes as panels
    torch.manual_seed(out_features)
    parts = [layer_class(nn.Linear(96, out_features)) for _ in range(2)]
    fused = concat_outputs(parts)
    assert fused.layout is Layout.ROWS and fused.out_features == 2 * out_features
    assert torch.equal(fused.dequantize(), torch.cat([m.dequantize() for m in parts]))
    # the layers' codes moved into the stack: each reads its rows there, memory is not doubled
    assert all(m.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr() for m in parts)
    x = torch.randn(5, 96)
    assert torch.allclose(fused(x), torch.cat([m(x) for m in parts], dim=-1), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(shutil.which("c++") is None or not environment.native_kernels_on(),
                    reason="no C++ compiler here (or kernels disabled): the reference path serves")
def test_kernels_build_where_a_compiler_exists():
    # the kernel tests below skip when the build fails, so a broken build must fail here instead of hiding
    assert native.load() is not None
    assert native.load_ops() is not None


def test_row_major_int4_layers_give_a_row_the_same_bits_in_any_batch():
    # int4 layers outside panels run the float table kernel on every call (not only up to 32 rows), so a
    # prefill of 40 tokens in the step does not move a decode row onto other arithmetic
    if native.load() is None:
        pytest.skip("C++ kernels could not be built here")
    torch.manual_seed(12)
    layer = Int4Linear(nn.Linear(576, 12))
    assert layer.layout is Layout.ROWS and layer.kernel_max_rows is None
    x = torch.randn(64, 576)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(64)])
    for rows in (33, 64):
        assert torch.equal(layer(x[:rows]), alone[:rows])


@pytest.mark.parametrize("spec", [QuantSpec(Scheme.INT8, Granularity.ROW), INT4_ROW, INT4_GROUP, INT4_TENSOR])
def test_int_round_trip_error_is_at_most_half_a_step(spec):
    torch.manual_seed(0)
    w = torch.randn(24, 576)
    q, scales = quantize_int(w, spec)
    qmax = 2 ** (spec.bits - 1) - 1
    assert int(q.abs().max()) == qmax  # absmax maps to the top level
    group = spec.group_for(576)
    w_hat = dequantize_int(q, scales, group)
    step = dequantize_int(torch.ones_like(q), scales, group)  # [24, 576]: the scale of each weight
    assert bool(((w - w_hat).abs() <= step / 2 + 1e-7).all())
    # Re-quantizing the dequantized weight is exact: the codes are a fixed point.
    assert torch.equal(quantize_int(w_hat, spec)[0], q)


def test_nf4_levels_are_fixed_points():
    levels = torch.tensor(NF4_LEVELS)
    w = (levels * 0.5).repeat(3, 4)  # [3, 64]: one block per row, absmax 0.5
    codes, absmax = quantize_nf4(w, 64)
    assert absmax.shape == (1, 3) and absmax.dtype == torch.float16
    assert codes[0, :16].tolist() == list(range(16))
    assert torch.equal(dequantize_nf4(codes, absmax, 64), w)


def test_error_ordering_on_smollm2_weights(smollm2):
    names = [n for n in projection_names(smollm2.model) if n.startswith(("model.layers.0.", "model.layers.15.",
                                                                          "model.layers.29."))]
    modules = dict(smollm2.model.named_modules())
    errors = {spec: [] for spec in (INT4_TENSOR, INT4_ROW, INT4_GROUP, NF4_BLOCK)}
    for name in names:
        w = modules[name].weight.detach()
        for spec, found in errors.items():
            found.append(relative_error(w, fake_quantize(w, spec)))
    assert len(names) == 21
    for tensor, row, group in zip(errors[INT4_TENSOR], errors[INT4_ROW], errors[INT4_GROUP]):
        assert tensor > row > group
    mean = {spec: sum(v) / len(v) for spec, v in errors.items()}
    assert mean[NF4_BLOCK] < mean[INT4_GROUP]
    assert 0.05 < mean[INT4_GROUP] < 0.2  # int4 has 15 levels: roughly 10% error, not 1% or 100%


def _layers(in_features: int, out_features: int) -> list[QuantLinear]:
    torch.manual_seed(in_features + out_features)
    linear = nn.Linear(in_features, out_features, bias=True)
    return [Int8Linear(linear), Int4Linear(linear), NF4Linear(linear)]


@pytest.mark.parametrize("shape", [(256, 8), (576, 192), (1536, 40), (96, 16)])  # int4: 2, 3 (group 192), 12
def test_kernels_give_a_row_the_same_bits_in_any_batch(shape):  # groups a row; int8 at K = 3 blocks of 32
    # batch invariance: a request's greedy text must not depend on what shares its step, so a row's product
    # may not change with the number of rows in the call (tile shapes are chosen by that number)
    if native.load() is None:
        pytest.skip("C++ kernels could not be built here")
    torch.manual_seed(shape[0])
    x = torch.randn(9, shape[0])
    for layer in _layers(*shape):
        alone = torch.cat([layer(x[i:i + 1]) for i in range(9)])
        for rows in range(2, 10):
            assert torch.equal(layer(x[:rows]), alone[:rows]), (type(layer).__name__, rows)
    dense = native.load().f32_linear
    w = torch.randn(shape[1], shape[0])
    alone = torch.cat([dense(x[i:i + 1], w) for i in range(9)])
    for rows in range(2, 10):
        assert torch.equal(dense(x[:rows], w), alone[:rows]), ("f32_linear", rows)


def test_bound_kernels_give_the_bits_of_the_layer_call():
    # decode_kernel() binds a layer's codes and scales in C++ once (what the fast path calls); it must be the
    # layer's own product, bias aside
    if native.load() is None:
        pytest.skip("C++ kernels could not be built here")
    x = torch.randn(3, 576)
    for layer in _layers(576, 40):
        assert torch.equal(layer.decode_kernel()(x) + layer.bias, layer(x)), type(layer).__name__
    w = torch.randn(40, 576)
    assert torch.equal(native.load().bind_f32(w)(x), native.load().f32_linear(x, w))
    with pytest.raises(RuntimeError, match="576"):  # the bound kernel still checks its input
        _layers(576, 40)[0].decode_kernel()(torch.randn(3, 64))


@pytest.mark.parametrize("out_features", [13, 67])
def test_kernels_give_the_same_bits_on_one_thread_and_two(out_features):
    # a thread's rows that do not fill a tile of 4 are summed one at a time: same order as the 4-row tiles
    if native.load() is None:
        pytest.skip("C++ kernels could not be built here")
    torch.manual_seed(out_features)
    x, w = torch.randn(3, 576), torch.randn(out_features, 576)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append([layer(x) for layer in _layers(576, out_features)] + [native.load().f32_linear(x, w)])
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        assert torch.equal(one, two)


@pytest.mark.parametrize("shape", [(576, 192), (1536, 64), (40, 24)])  # (40, 24) runs the scalar loops
@pytest.mark.parametrize("rows", [1, 3, 5])
def test_kernel_matches_reference(shape, rows):
    if native.load() is None:
        pytest.skip("C++ kernels could not be built here")
    for layer in _layers(*shape):
        x = torch.randn(rows, shape[0])
        x[0, :min(64, shape[0])] = 0  # an all-zero activation block (scale 0)
        layer.use_kernel = False
        reference = layer(x)
        # the served product: W_hat @ Q16(x) for int8 (per block of 64), W_hat @ Q8(x) for int4 (per block of
        # 32), W_hat @ x for NF4
        x_seen = x if layer.act_block is None else quantize_activations(x, layer.act_block, layer.act_qmax)
        assert torch.allclose(reference, x_seen @ layer.dequantize().t() + layer.bias, atol=1e-4, rtol=1e-4)
        layer.use_kernel = True
        fast = layer(x)
        assert torch.allclose(fast, reference, atol=1e-4, rtol=1e-4), type(layer).__name__
        # bfloat16 activations come back in bfloat16
        assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_activation_quantization_reference():
    x = torch.tensor([[0.0] * 32 + [1.27, -0.635, 0.3, 0.0049] + [0.0] * 28])  # [1, 64]: a zero block, then max 1.27
    q = quantize_activations(x)
    assert torch.equal(q[0, :32], torch.zeros(32))
    # d = 1.27 / 127 = 0.01: 1.27 -> 127 d, -0.635 -> -63.5 -> -64 d (half to even), 0.0049 -> 0
    torch.testing.assert_close(q[0, 32:36], torch.tensor([1.27, -0.64, 0.3, 0.0]), rtol=1e-6, atol=1e-7)
    y = torch.randn(4, 96) * torch.rand(4, 96) * 10
    error = (quantize_activations(y) - y).abs().view(4, 3, 32)
    half_step = y.abs().view(4, 3, 32).amax(-1, keepdim=True) / 254  # rounding error <= d / 2 per block
    assert (error <= half_step * (1 + 1e-5)).all() and error.amax() > 0
    with pytest.raises(ValueError, match="multiple"):
        quantize_activations(torch.randn(2, 40))
    # Q16 (the int8 kernel's; blocks of 32 where a row is not a multiple of 64): d = 3.2767 / 32767 = 1e-4;
    # half a step is 5e-5
    x16 = torch.tensor([[3.2767, -1.00005, 0.00004] + [0.0] * 29])
    torch.testing.assert_close(quantize_activations(x16, 32, 32767)[0, :3], torch.tensor([3.2767, -1.0, 0.0]),
                               rtol=1e-6, atol=1e-8)
    # a block whose max is so small that d is subnormal: x / d can round past qmax, and the codes are clamped
    tiny = torch.tensor([[40000 * 2.0 ** -149] + [0.0] * 31])
    d = tiny.abs().amax() / 32767
    assert float(tiny[0, 0] / d) > 32767
    assert quantize_activations(tiny, 32, 32767)[0, 0] == 32767 * d


def test_kernels_clamp_codes_like_the_reference_where_the_block_scale_is_subnormal():
    if native.load() is None:
        pytest.skip("C++ kernels could not be built here")
    torch.manual_seed(5)
    x = torch.randn(3, 64) * 1e-38  # subnormal block scales; a wrapped int16 code would flip a sign
    x[1] = torch.randn(64)  # and an ordinary row
    for layer in _layers(64, 16)[:2]:  # int8 (Q16) and int4 (Q8) kernels
        layer.use_kernel = False
        reference = layer(x.double().float())
        layer.use_kernel = True
        fast = layer(x)
        assert torch.allclose(fast, reference, rtol=1e-4, atol=0), type(layer).__name__


def test_int8_layer_as_served_is_as_accurate_as_weight_only():
    # Activations with outlier channels, as in the residual stream: the int16 activation step must stay far below
    # the int8 weights' own error, where int8 activations (Q8, what the int4 kernel uses) would not.
    torch.manual_seed(3)
    linear = nn.Linear(576, 192, bias=False)
    x = torch.randn(16, 576)
    x[:, ::97] *= 40
    exact = linear(x).double()
    layer = Int8Linear(linear)
    weight_only = (x @ layer.dequantize().t()).double()
    served = layer(x).double()
    q8 = (quantize_activations(x, 32) @ layer.dequantize().t()).double()
    weight_error = (weight_only - exact).norm()
    assert (served - weight_only).norm() < 0.05 * weight_error  # measured 0.017
    assert (q8 - weight_only).norm() > weight_error  # measured 3.1x


def test_act_block_of_each_layer_and_weight_only_mode():
    int8, int4, nf4 = _layers(576, 64)
    assert (int8.act_block, int4.act_block, nf4.act_block) == (ACT16_BLOCK, ACT_BLOCK, None)
    assert _layers(96, 8)[0].act_block == ACT_BLOCK  # int8 rows of 3 blocks of 32 keep the kernel
    assert (int8.act_qmax, int4.act_qmax) == (32767, 127)
    assert _layers(40, 8)[0].act_block is None and _layers(40, 8)[0].decode_kernel() is None  # no int8 kernel
    x = torch.randn(2, 576)
    for layer in (int8, int4):
        layer.act_block = None  # weight-only: the kernel (which quantizes activations) must not run
        assert layer.decode_kernel() is None
        torch.testing.assert_close(layer(x), x @ layer.dequantize().t() + layer.bias, rtol=1e-4, atol=1e-4)
        layer.act_block = layer.kernel_act_block
        assert not torch.allclose(layer(x), x @ layer.dequantize().t() + layer.bias, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec", [QuantSpec(Scheme.INT8, Granularity.TENSOR), QuantSpec(Scheme.INT8, Granularity.ROW),
                                  INT4_TENSOR, INT4_ROW, INT4_GROUP, NF4_BLOCK], ids=lambda spec: spec.label)
@pytest.mark.parametrize("out_features", [32, 12])  # int4: panel and row-major codes
def test_layers_compute_with_the_reported_w_hat(spec, out_features):
    # the report's relative errors come from fake_quantize; every layer must compute with exactly that W_hat
    # (int4 stores 16-bit scales at every granularity, so fake_quantize rounds them too)
    torch.manual_seed(out_features)
    linear = nn.Linear(576, out_features, bias=False)
    layer = {Scheme.INT8: Int8Linear, Scheme.INT4: Int4Linear, Scheme.NF4: NF4Linear}[spec.scheme](linear, spec)
    assert torch.equal(layer.dequantize(), fake_quantize(linear.weight.detach(), spec))


def test_state_records_scheme_and_group_size():
    layer = Int4Linear(nn.Linear(576, 8, bias=False))
    state = layer.state_dict()
    assert state["_extra_state"] == {"scheme": "int4", "granularity": "group", "group_size": 96, "layout": "panels"}
    assert state["weight"].dtype == torch.uint8 and state["weight"].shape == (8, 288)
    assert state["scales"].dtype == torch.float16 and state["scales"].shape == (6, 8)  # [in // group, out]
    other = Int4Linear(nn.Linear(576, 8, bias=False), QuantSpec(Scheme.INT4, Granularity.GROUP, 64))
    with pytest.raises(ValueError, match="group"):
        other.load_state_dict(state)
    fresh = Int4Linear(nn.Linear(576, 8, bias=False))
    fresh.load_state_dict(state)
    assert torch.equal(fresh.dequantize(), layer.dequantize())
    rows_state = {**state, "_extra_state": {**state["_extra_state"], "layout": "rows"}}
    rows_state["weight"] = torch.zeros_like(state["weight"])
    with pytest.raises(ValueError, match="rows"):  # codes in another order must not load silently
        fresh.load_state_dict(rows_state)
    assert torch.equal(fresh.weight, state["weight"])  # refused before any tensor was copied
    without_state = {k: v for k, v in rows_state.items() if k != "_extra_state"}
    with pytest.raises(ValueError, match="_extra_state"):  # strict=False would otherwise let the codes in
        fresh.load_state_dict(without_state, strict=False)
    assert torch.equal(fresh.weight, state["weight"])


def test_quantize_model_keeps_head_and_works_in_bfloat16():
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)).bfloat16()
    summary = quantize_model(model, "int8")
    assert summary.num_layers == 2 and summary.group_sizes == (64, 128)
    assert summary.bytes_before == 2 * 64 * 128 * 2
    assert model(torch.randn(2, 64).bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError):
        quantize_model(model, "int3")
    assert [serving_quantizes_head(s) for s in ("int8", "int4", "nf4")] == [False, True, True]
    weight_only = nn.Sequential(nn.Linear(64, 32))
    quantize_model(weight_only, "int4", activations=False)
    assert weight_only[0].act_block is None and weight_only[0].decode_kernel() is None


@pytest.mark.parametrize("scheme,head", [("int8", False), ("int4", True), ("nf4", True)])
def test_quantized_smollm2_answers(smollm2, scheme, head):
    model = copy.deepcopy(smollm2.model)
    model.set_attn_implementation("sdpa")
    embedding = model.model.embed_tokens.weight.clone()
    summary = quantize_model(model, scheme, head=head)
    assert summary.num_layers == 30 * 7
    if head:  # as served: an int8 copy of the head; the embedding keeps its float32 rows
        assert isinstance(model.lm_head, Int8Linear) and model.lm_head.out_features == 49152
        assert summary.head.startswith("int8/row") and "LM head int8/row" in summary.describe()
        assert torch.equal(model.model.embed_tokens.weight, embedding)
    else:
        assert not isinstance(model.lm_head, QuantLinear)
        assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied, still float32
    expected_bits = {"int8": (8.0, 8.06), "int4": (4.125, 4.17), "nf4": (4.25, 4.25)}[scheme]
    assert expected_bits[0] - 1e-6 <= summary.bits_per_weight <= expected_bits[1] + 1e-6
    tokenizer = smollm2.tokenizer
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(ids["input_ids"], max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def test_non_finite_activations_stay_non_finite():
    # a NaN (or an infinity) must not be quantized into a plausible number: as in the reference, every output
    # of a row whose activations hold one is NaN
    if native.load() is None:
        pytest.skip("C++ kernels could not be built here")
    for layer in _layers(256, 8)[:2]:  # the integer kernels
        x = torch.randn(3, 256)
        x[0, 7], x[1, 200] = float("nan"), float("inf")
        fast = layer(x)
        layer.use_kernel = False
        reference = layer(x)
        assert fast[:2].isnan().all() and reference[:2].isnan().all(), type(layer).__name__
        torch.testing.assert_close(fast[2], reference[2], rtol=1e-4, atol=1e-4)


def test_agreement_and_reference_margins_on_a_tiny_model():
    from kvserve.quant import quality
    from kvserve.quant.report import _margin_cell
    from tests.engineutil import tiny

    model = tiny("llama").eval()
    prompt = [5, 17, 33, 8]
    runs = [(prompt, quality.greedy(model, prompt, 12, eos_id=None))]
    margins = quality.reference_margins(model, runs)
    assert margins.shape == (12,) and bool((margins >= 0).all())
    assert bool(quality.agreement_by_position(model, runs).all())  # the model agrees with its own greedy run
    # the same model with the two best logits swapped where the margin is smallest: exactly that one misses
    smallest = int(margins.argmin())
    flipped = copy.deepcopy(model)
    head = flipped.lm_head.weight.data
    ids = torch.tensor([runs[0][0] + runs[0][1][:-1]])
    top2 = model(input_ids=ids).logits[0, len(prompt) - 1 + smallest].topk(2).indices
    head[top2] = head[top2.flip(0)].clone()
    agrees = quality.agreement_by_position(flipped, runs)
    assert not agrees[smallest]
    row = {"miss_margins": sorted(margins[~agrees].tolist())}
    assert _margin_cell(row, {"margins": sorted(margins.tolist())}).endswith("%)")
    assert _margin_cell({"miss_margins": []}, {"margins": [1.0]}) == "-"


def test_heldout_top1_agreement_is_taken_from_the_perplexity_forward():
    from kvserve.quant import quality
    from tests.engineutil import tiny

    model = tiny("llama").eval()
    ids = torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(5))
    ppl, top1, logprobs = quality.heldout_scores(model, ids)
    logits = model(input_ids=ids).logits[0, :-1].detach()
    assert top1.shape == (23,) and torch.equal(top1, logits.argmax(-1))
    assert ppl == pytest.approx(float(torch.nn.functional.cross_entropy(logits, ids[0, 1:]).exp()), rel=1e-5)
    assert quality.mean_kl(logprobs, logprobs) == 0.0
    # swap the LM-head rows of the first position's top two tokens: there, and only where either wins, top-1 moves
    flipped = copy.deepcopy(model)
    pair = logits[0].topk(2).indices  # [2]
    head = flipped.lm_head.weight.data
    head[pair] = head[pair.flip(0)].clone()
    _, flipped_top1, flipped_logprobs = quality.heldout_scores(flipped, ids)
    moved = flipped_top1 != top1
    assert moved[0] and bool((moved <= torch.isin(top1, pair)).all())
    # KL(P || Q) by its definition, sum_v p_v (log p_v - log q_v), averaged over the 23 positions
    expected = float((logprobs.exp() * (logprobs - flipped_logprobs)).sum(-1).mean())
    assert expected > 0 and quality.mean_kl(logprobs, flipped_logprobs) == pytest.approx(expected, rel=1e-5)


def test_a_dead_builds_lock_is_removed_and_a_live_one_waited_for(tmp_path, monkeypatch):
    # torch waits forever on the lock file a killed build leaves; kvserve would hang at startup
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - native.LOCK_GRACE_S - 1
    os.utime(lock, (old, old))
    if native._builders(tmp_path) is not None:  # Linux: no process works in tmp_path, so the build is dead
        native._clear_stale_lock(tmp_path)
        assert not lock.exists()
        lock.touch()
        os.utime(lock, (old, old))
    # a live build (a process working in the directory) keeps its lock however old, until it removes it
    monkeypatch.setattr(native, "_builders", lambda build_dir: 1)
    sleeps = []
    monkeypatch.setattr(native.time, "sleep", lambda s: (sleeps.append(s), lock.unlink()))
    native._clear_stale_lock(tmp_path)
    assert sleeps and not lock.exists()
    native._clear_stale_lock(tmp_path)  # no lock: returns at once
    # where /proc cannot tell, only a lock older than STALE_LOCK_S is removed
    monkeypatch.setattr(native, "_builders", lambda build_dir: None)
    lock.touch()
    ancient = time.time() - native.STALE_LOCK_S - 1
    os.utime(lock, (ancient, ancient))
    native._clear_stale_lock(tmp_path)
    assert not lock.exists()


def test_a_process_working_in_a_directory_counts_as_a_builder(tmp_path):
    import subprocess

    if native._builders(tmp_path) is None:
        pytest.skip("no /proc here")
    assert native._builders(tmp_path) == 0
    sleeper = subprocess.Popen(["sleep", "30"], cwd=tmp_path)
    try:
        deadline = time.time() + 10
        while native._builders(tmp_path) != 1 and time.time() < deadline:
            time.sleep(0.05)
        assert native._builders(tmp_path) == 1
    finally:
        sleeper.kill()
        sleeper.wait()


def _correlated_inputs(n: int, features: int, seed: int = 0) -> torch.Tensor:
    """``[n, features]`` activations with correlated features and a few large ones, as a layer's inputs are."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(features, features, generator=g) / features ** 0.5
    x = torch.randn(n, features, generator=g) @ (torch.eye(features) + 2 * mix)
    x[:, :3] *= 8
    return x


def test_gptq_with_uncorrelated_inputs_rounds_to_nearest():
    # H = I (inputs white and uncorrelated): no column's error has anywhere useful to go, so GPTQ is rounding
    # to nearest, code for code
    w = torch.randn(48, 96)
    for spec in (QuantSpec(Scheme.INT8, Granularity.ROW), INT4_GROUP):
        nearest, scales = quantize_int(w, spec)
        gptq, gptq_scales = quantize_int(w, spec, hessian=torch.eye(96, dtype=torch.float64))
        assert torch.equal(gptq, nearest) and torch.equal(gptq_scales, scales)


@pytest.mark.parametrize("spec", [QuantSpec(Scheme.INT8, Granularity.ROW), INT4_GROUP], ids=lambda s: s.label)
def test_gptq_keeps_the_absmax_grid_and_lowers_the_output_error(spec):
    torch.manual_seed(0)
    w = torch.randn(64, 192)
    x = _correlated_inputs(1024, 192)  # [n, in]
    hessian = (x.double().t() @ x.double()) / x.shape[0]
    nearest, scales = quantize_int(w, spec)
    gptq, gptq_scales = quantize_int(w, spec, hessian=hessian)
    qmax = 2 ** (spec.bits - 1) - 1
    assert torch.equal(gptq_scales, scales) and int(gptq.abs().max()) <= qmax
    assert not torch.equal(gptq, nearest)
    group = spec.group_for(192)

    def output_error(codes: torch.Tensor) -> float:
        return float(torch.linalg.norm(x @ (w - dequantize_int(codes, scales, group)).t()))

    # the paper's objective, ||W X - W_hat X||: GPTQ must clearly beat rounding each weight on its own
    assert output_error(gptq) < 0.8 * output_error(nearest)
    # a weight moves at most to a neighbouring level of the same grid, never far from where it was
    assert float((w - dequantize_int(gptq, scales, group)).abs().div(scales.float().mean()).max()) < 4 * qmax


def test_input_hessians_skip_padding_and_share_one_input():
    from kvserve.quant.gptq import stream_hessians
    from tests.engineutil import tiny

    model = tiny("llama")
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    names = projection_names(model)
    seen = {}
    hooks = [model.get_submodule(n).register_forward_pre_hook(
        lambda _, args, n=n: seen.__setitem__(n, args[0].reshape(-1, args[0].shape[-1]).clone())) for n in names]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    for hook in hooks:
        hook.remove()
    hessians = {}
    stream_hessians(model, names, ids, mask, hessians.__setitem__)
    keep = mask.reshape(-1).bool()
    assert list(hessians) == names  # handed over in the order of the forward pass
    for name in names:
        x = seen[name][keep].double()  # [10, in]: the 2 padded tokens left out
        torch.testing.assert_close(hessians[name], x.t() @ x / 10, rtol=1e-5, atol=1e-6)
    layer = "model.layers.0.self_attn."
    assert hessians[layer + "q_proj"] is hessians[layer + "k_proj"] is hessians[layer + "v_proj"]


def test_quantize_model_with_a_calibration_rounds_each_layer_by_its_hessian():
    from kvserve.quant.gptq import stream_hessians
    from tests.engineutil import tiny

    model = tiny("llama")
    ids = torch.randint(3, 256, (4, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    with pytest.raises(ValueError, match="NF4"):
        quantize_model(copy.deepcopy(model), "nf4", calibration=(ids, mask))
    hessians = {}
    stream_hessians(model, projection_names(model), ids, mask, hessians.__setitem__)
    reference = copy.deepcopy(model)
    summary = quantize_model(model, "int8", calibration=(ids, mask))
    assert summary.spec_label == "int8/row+gptq" and summary.num_layers == len(hessians)
    for name in ("model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj"):
        expected = Int8Linear(reference.get_submodule(name), hessian=hessians[name])
        assert torch.equal(model.get_submodule(name).weight, expected.weight)
        assert not torch.equal(expected.weight, Int8Linear(reference.get_submodule(name)).weight)
    model(input_ids=ids)  # outside no_grad, with parameters that want gradients: ordinary tensors, no error


def test_serving_int8_is_calibrated_on_the_models_own_replies(smollm2, monkeypatch):
    # a tiny model with SmolLM2's vocabulary, so SmolLM2's tokenizer and chat template write its replies
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvserve.quant import gptq
    from kvserve.quant.model import quantize_for_serving

    config = LlamaConfig(vocab_size=len(smollm2.tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("eager")  # stands in for the paged hook, which must come back
    monkeypatch.setattr(gptq, "CALIBRATION_NEW_TOKENS", 16)  # replies of 16 tokens: enough to test the plumbing
    batches = []
    calibration_batch = gptq.calibration_batch
    monkeypatch.setattr(gptq, "calibration_batch", lambda m, t: batches.append(calibration_batch(m, t)) or batches[-1])
    reference = copy.deepcopy(model)
    summary = quantize_for_serving(model, "int8", smollm2.tokenizer)
    assert summary.spec_label == "int8/row+gptq" and "int8/row+gptq on 14 linear layers" in summary.describe()
    assert model.config._attn_implementation == "eager"
    (ids, mask), = batches
    assert ids.shape[0] == len(gptq.CALIBRATION_PROMPTS) and mask[:, -gptq.CALIBRATION_NEW_TOKENS:].all()
    text = smollm2.tokenizer.decode(ids[0][mask[0].bool()])
    assert text.count("<|im_start|>assistant") == 1 and gptq.CALIBRATION_PROMPTS[0] in text
    # the same grid as rounding to nearest, other codes
    layer, nearest = model.model.layers[0].mlp.down_proj, Int8Linear(reference.model.layers[0].mlp.down_proj)
    assert torch.equal(layer.scales, nearest.scales) and not torch.equal(layer.weight, nearest.weight)
    reference.config.max_position_embeddings = 24  # shorter than the prompts: cut to their last 12 tokens
    shortest, shortest_mask = calibration_batch(reference, smollm2.tokenizer)
    assert shortest.shape == (len(gptq.CALIBRATION_PROMPTS), 24) and shortest_mask.all()  # 12-token replies
    reference.config.max_position_embeddings = 32  # cut to their last 16 tokens, 16-token replies
    shortest, shortest_mask = calibration_batch(reference, smollm2.tokenizer)
    assert shortest.shape == (len(gptq.CALIBRATION_PROMPTS), 32) and shortest_mask.all()
    assert smollm2.tokenizer.decode(shortest[0, :16]).endswith("<|im_start|>assistant\n")
    reference.config.max_position_embeddings = 256
    assert quantize_for_serving(copy.deepcopy(reference), "int8").spec_label == "int8/row"  # no tokenizer
    assert quantize_for_serving(copy.deepcopy(reference), "int4", smollm2.tokenizer).spec_label == "int4/group128+gptq"
    assert quantize_for_serving(reference, "nf4", smollm2.tokenizer).spec_label == "nf4/group64"
    assert len(batches) == 2  # NF4 is served rounded to nearest: no calibration


def test_quality_table_rows_have_every_column():
    from kvserve.quant.report import quality_table

    base = {"model_weight_bytes": 2**20, "perplexity": 20.0, "facts_right": 16, "margins": [0.1, 1.0, 2.0]}
    row = {"label": "int8/row+gptq", "serving": True, "bits_per_weight": 8.0, "model_weight_bytes": 2**19,
           "rel_error_mean": 0.01, "rel_error_worst": 0.02, "worst_matrix": "m", "perplexity": 20.2,
           "facts_right": 15, "agreement": 0.975, "miss_margins": [0.1], "heldout_top1": 0.97, "heldout_kl": 0.00145}
    lines = quality_table({"baseline": base, "rows": [row]}).splitlines()
    assert len({line.count("|") for line in lines}) == 1
    assert lines[-1].startswith("| int8/row+gptq (serving default) |") and lines[-1].endswith("| 97.0% | 1.45 |")
    assert "| +1.00% |" in lines[-1]


def test_auto_dtype_keeps_float32_activations_on_a_cpu_and_bf16_weights_only_on_the_bf16_kernel(monkeypatch):
    from kvserve.engine.loader import DType, resolve_dtype, serves_bf16_kernel
    from kvserve.quant import bf16

    cpu = torch.device("cpu")
    for runs in (True, False):
        monkeypatch.setattr(bf16, "kernel_runs", lambda runs=runs: runs)
        assert resolve_dtype(DType.AUTO, cpu) == torch.float32
        assert resolve_dtype(DType.AUTO, cpu, quantized=True) == torch.float32
        assert serves_bf16_kernel(DType.AUTO, cpu) is runs  # bfloat16 weights only where the kernel runs
        assert not serves_bf16_kernel(DType.AUTO, cpu, quantized=True)
        assert not serves_bf16_kernel(DType.BFLOAT16, cpu) and not serves_bf16_kernel(DType.FLOAT32, cpu)
    assert resolve_dtype(DType.BFLOAT16, cpu, quantized=True) == torch.bfloat16  # asked for: given
    assert resolve_dtype(DType.AUTO, torch.device("cuda"), quantized=True) == torch.bfloat16
    assert not serves_bf16_kernel(DType.AUTO, torch.device("cuda"))


def test_gptq_dead_inputs_do_not_change_the_live_columns_codes():
    # an input that was always zero has H[j, j] = 0; its stand-in diagonal must not skew the damping, so the
    # live columns get exactly the codes they get when the dead input is not there at all
    from kvserve.quant.gptq import gptq_codes

    torch.manual_seed(1)
    w = torch.randn(16, 33)
    x = _correlated_inputs(256, 32) * 0.01  # small activations: H far below 1
    x = torch.cat([x, torch.zeros(256, 1)], dim=1)  # [256, 33]: the last input is dead
    h = (x.double().t() @ x.double()) / 256
    steps = (w.abs().amax(dim=1, keepdim=True) / 127).expand_as(w)
    with_dead = gptq_codes(w, steps, 127, h)
    without = gptq_codes(w[:, :32], steps[:, :32], 127, h[:32, :32])
    assert torch.equal(with_dead[:, :32], without)
