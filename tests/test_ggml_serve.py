"""The GGUF's own blocks served as they are: bit-exact weights, the layer against its reference, the tensor table,
the default --quantization choice, and the start-up log."""

from __future__ import annotations

import copy
import logging

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from kvserve.engine import weights
from kvserve.engine.gguf_file import GGUFArray, read_gguf
from kvserve.engine.gguf_model import LAYER_TENSORS, block_kind
from kvserve.engine.loader import default_gguf_path
from kvserve.quant.ggml import (GGMLEmbedding, GGMLKind, GGMLLinear, dequantize_blocks, native_ops, panel_width)
from kvserve.quant.linear import Layout, concat_outputs
from kvserve.quant.options import Scheme
from kvserve.quant.schemes import quantize_activations
from kvserve.server.config import ServeConfig
from tests.engineutil import NEAR_TIE_LOGITS, engine_greedy, reference_model, reference_shortfall
from tests.ggmlutil import random_blocks

Q = gguf.GGMLQuantizationType
needs_ggml_kernels = pytest.mark.skipif(native_ops() is None, reason="ggml kernels not built")


def blocks_of(w: torch.Tensor, kind: Q) -> torch.Tensor:
    """``w [out, in]`` quantized by gguf's own quantizer: the bytes a file would hold, uint8 ``[out, bytes]``."""
    return torch.from_numpy(gguf.quants.quantize(w.numpy(), kind))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_every_tensor_of_the_embedded_file_dequantizes_bit_for_bit_as_gguf(smollm2_gguf):
    index = read_gguf(default_gguf_path())
    config = smollm2_gguf.model.config
    names = {f"model.layers.{i}.{module}": f"blk.{i}.{short}" for i in range(config.num_hidden_layers)
             for short, module in LAYER_TENSORS.items()}
    # transformers' own undoing of llama.cpp's Q/K row permutation, applied to gguf's dequantized weights
    processor = LlamaTensorProcessor({"num_attention_heads": config.num_attention_heads,
                                      "num_key_value_heads": config.num_key_value_heads})
    modules = dict(smollm2_gguf.model.named_modules())
    checked = 0
    for name, module in modules.items():
        if not isinstance(module, GGMLLinear):
            continue
        tensor = index.tensors.get(f"{names.get(name)}.weight") or index.tensors["token_embd.weight"]
        expected = processor.process(gguf.quants.dequantize(tensor.data(), tensor.ggml_type), tensor.name).weights
        assert torch.equal(bits(module.dequantize()), bits(torch.from_numpy(np.ascontiguousarray(expected)))), name
        checked += 1
    assert checked == 30 * 7 + 1  # every projection and the LM head
    embedding = smollm2_gguf.model.model.embed_tokens
    assert isinstance(embedding, GGMLEmbedding)
    table = gguf.quants.dequantize(index.tensors["token_embd.weight"].data(), Q.Q8_0)  # [vocab, 576]
    ids = torch.tensor([[0, 1, 2], [49151, 4321, 17]])
    assert torch.equal(bits(embedding(ids)), bits(torch.from_numpy(table[ids.numpy()])))


def test_the_default_model_computes_with_the_files_weights_run_in_float32(smollm2, smollm2_gguf):
    # the float32 model is transformers' conversion of the same file: every weight equal, bit for bit
    floats = dict(smollm2.model.named_modules())
    for name, module in smollm2_gguf.model.named_modules():
        if isinstance(module, GGMLLinear):
            assert torch.equal(bits(module.dequantize()), bits(floats[name].weight.detach())), name
    assert smollm2_gguf.dtype == torch.float32 and smollm2_gguf.model.lm_head.kind is GGMLKind.Q8_0


def test_every_type_with_a_kernel_is_served_as_its_own_blocks():
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"):
        assert block_kind(Q[name]) is GGMLKind[name]
    assert block_kind(Q.IQ4_XS) is None and block_kind(Q.Q3_K) is None and block_kind(Q.F32) is None


@pytest.mark.parametrize("kind,qtype", [(GGMLKind.Q4_1, Q.Q4_1), (GGMLKind.Q8_0, Q.Q8_0)])
def test_layer_computes_q8_activations_times_the_files_weights(kind, qtype):
    torch.manual_seed(1)
    raw = blocks_of(torch.randn(40, 128), qtype)
    bias = torch.randn(40)
    layer = GGMLLinear(raw, kind, bias)
    assert torch.equal(layer.dequantize(), torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype)))
    assert torch.equal(layer.blocks(), raw)
    # the kernel's panels are padded to whole panels (16 features on AVX-512), the file's rows are not
    assert layer.weight_bytes == layer.weight.numel() >= raw.numel()
    x = torch.randn(5, 128)
    layer.use_kernel = False
    reference = F.linear(quantize_activations(x, 32, 127), layer.dequantize(), bias)
    assert torch.equal(layer(x), reference)
    layer.use_kernel = True
    assert torch.allclose(layer(x), reference, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="whole blocks"):
        GGMLLinear(raw[:, :-1], kind)


@pytest.mark.parametrize("sizes", [(32, 16, 16), (20, 12, 32), (16, 48, 4)])
def test_stacked_layers_are_the_layers_side_by_side_and_formats_do_not_mix(sizes, monkeypatch):
    # (32, 16, 16) and (16, 48, 4) fill whole panels (8 or 16 features) but the last: the layers' panels move
    # into the stack as they are, never unpacked (which held every part three times at once: a start's peak);
    # (20, 12, 32) does not: unpacked, stacked and packed again
    torch.manual_seed(2)
    parts = [GGMLLinear(blocks_of(torch.randn(n, 64), Q.Q4_1), GGMLKind.Q4_1) for n in sizes]
    raw = torch.cat([m.blocks() for m in parts])
    width = panel_width() if parts[0].layout is Layout.PANELS else 1
    with monkeypatch.context() as patch:
        if all(n % width == 0 for n in sizes[:-1]):
            patch.setattr(GGMLLinear, "blocks", lambda self: pytest.fail("a part was unpacked"))
        fused = concat_outputs(parts)
    assert fused.out_features == sum(sizes) and fused.layout is parts[0].layout
    assert torch.equal(fused.blocks(), raw)
    assert torch.equal(fused.dequantize(), torch.cat([m.dequantize() for m in parts]))
    assert [torch.equal(m.blocks(), rows) for m, rows in zip(parts, raw.split(list(sizes)))] == [True] * len(sizes)
    # each layer whose panels are whole panels of the stack reads the stack's bytes (memory is not doubled)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    shared = [m.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr() for m in parts]
    assert shared == [start % width == 0 and (n % width == 0 or i == len(sizes) - 1)
                      for i, (start, n) in enumerate(zip(starts, sizes))]
    x = torch.randn(3, 64)
    torch.testing.assert_close(fused(x), torch.cat([m(x) for m in parts], dim=-1), rtol=1e-5, atol=1e-5)
    head = GGMLLinear(blocks_of(torch.randn(32, 64), Q.Q8_0), GGMLKind.Q8_0)
    with pytest.raises(ValueError, match="one scheme"):
        concat_outputs([parts[0], head])


def test_saved_state_names_the_block_format():
    torch.manual_seed(3)
    layer = GGMLLinear(blocks_of(torch.randn(32, 64), Q.Q4_1), GGMLKind.Q4_1)
    state = layer.state_dict()
    assert state["_extra_state"] == {"scheme": "gguf", "kind": "q4_1", "group_size": 32,
                                     "layout": layer.layout.value}
    fresh = GGMLLinear(torch.zeros_like(layer.blocks()), GGMLKind.Q4_1)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.blocks(), layer.blocks())
    x = torch.randn(2, 64)
    fresh.use_kernel = layer.use_kernel = False
    assert torch.equal(fresh(x), layer(x))  # the reference computes with the loaded blocks, not the zeros
    other = GGMLLinear(blocks_of(torch.randn(32, 64), Q.Q8_0), GGMLKind.Q8_0)
    with pytest.raises(ValueError, match="q4_1 blocks"):
        other.set_extra_state(state["_extra_state"])


def test_tensor_table_is_what_gguf_reader_reads(tmp_path):
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])  # strings in arrays are skipped by length
    writer.add_array("tokenizer.ggml.scores", [1.0, 2.0, 3.0])
    writer.add_string("general.name", "tiny")
    torch.manual_seed(4)
    writer.add_tensor("blk.0.attn_q.weight", blocks_of(torch.randn(8, 64), Q.Q4_1).numpy(), raw_dtype=Q.Q4_1)
    writer.add_tensor("token_embd.weight", blocks_of(torch.randn(16, 32), Q.Q8_0).numpy(), raw_dtype=Q.Q8_0)
    writer.add_tensor("output_norm.weight", np.arange(7, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    index = read_gguf(path)
    reader = gguf.GGUFReader(path)
    assert index.architecture == "llama" and len(index.tensors) == len(reader.tensors) == 3
    for tensor in reader.tensors:
        ours = index.tensors[tensor.name]
        assert ours.ggml_type == tensor.tensor_type and ours.shape == tuple(int(n) for n in tensor.shape)
        assert bytes(ours.data()) == np.asarray(tensor.data).tobytes(), tensor.name
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):  # the header's own counts, which gguf lists as fields
            value = index.metadata[key]
            assert (value.values() if isinstance(value, GGUFArray) else value) == field.contents(), key
    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(tmp_path / "not.gguf")


def test_auto_serves_a_ggufs_own_blocks_and_int8_for_a_float_checkpoint():
    assert ServeConfig().quantization is Scheme.AUTO
    assert weights.choose(Scheme.AUTO, None).scheme is Scheme.GGUF
    assert weights.choose(Scheme.AUTO, "smollm2").scheme is Scheme.GGUF
    assert weights.choose("auto", "/models/other.gguf").scheme is Scheme.GGUF
    float_choice = weights.choose(Scheme.AUTO, "/models/hf-dir")
    assert float_choice.scheme is Scheme.INT8 and "int8/row+gptq" in float_choice.reason
    assert weights.choose(Scheme.NONE, None).scheme is Scheme.NONE  # full precision stays one flag away
    assert weights.choose(Scheme.INT4, None) == weights.Choice(Scheme.INT4, "--quantization int4")
    with pytest.raises(ValueError, match="not a .gguf file"):
        weights.choose(Scheme.GGUF, "/models/hf-dir")
    with pytest.raises(ValueError, match="rounding recipe"):
        from kvserve.quant.model import quantize_model

        quantize_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), Scheme.GGUF)


def test_serve_help_and_parser_default_to_auto():
    import argparse

    from kvserve.server.serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).quantization == "auto"
    assert parser.parse_args(["--quantization", "gguf"]).quantization == "gguf"
    help_text = " ".join(parser.format_help().split())
    assert "auto: a GGUF model's own blocks" in help_text and "none: full precision" in help_text
    assert "full precision; int8, int4, nf4: kvserve's own rounding of the float weights (int8 and int4 calibrate at " \
           "start) (default: auto)" in help_text


def test_start_log_says_what_was_picked_why_and_how_to_get_full_precision(smollm2, monkeypatch, caplog):
    from kvserve.engine import loader
    from kvserve.server.serve import build_state

    asked = []
    monkeypatch.setattr(loader, "load_model", lambda *args, **kw: asked.append(kw) or copy.deepcopy(smollm2))
    with caplog.at_level(logging.INFO, logger="kvserve"):
        state = build_state(ServeConfig(num_kv_blocks=8, device="cpu"))
    # float32 activations for quantized weights, the file's own blocks kept as they load
    assert asked == [{"quantized": True, "allow_pickle": False, "blocks": True}]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights: ")]
    assert len(lines) == 1
    assert lines[0].startswith("weights: the GGUF's own blocks (SmolLM2-135M-Instruct.Q4_1.gguf): projections 210 "
                               "q4_1, LM head q8_0")
    assert "(auto: SmolLM2-135M-Instruct.Q4_1.gguf is quantized already" in lines[0]
    assert lines[0].endswith("; full precision: --quantization none)")
    assert isinstance(state.loaded.model.lm_head, GGMLLinear)


def test_served_greedy_output_is_the_layers_reference_path_up_to_near_ties(smollm2_gguf):
    prompts = [smollm2_gguf.tokenizer(p)["input_ids"] for p in ("The capital of France is", "def add(a, b):")]
    ref = reference_model(smollm2_gguf.model)
    for module in ref.modules():
        if isinstance(module, GGMLLinear):
            module.use_kernel = False
    ours, _ = engine_greedy(smollm2_gguf, prompts, 24)
    assert smollm2_gguf.tokenizer.decode(ours[0]).strip().startswith("Paris")
    for ids, tokens in zip(prompts, ours):
        assert reference_shortfall(ref, ids, tokens) <= NEAR_TIE_LOGITS
    # and a token the model would not pick is far outside it
    assert reference_shortfall(ref, prompts[0], [ours[0][0] + 1] + ours[0][1:]) > NEAR_TIE_LOGITS


@needs_ggml_kernels
@pytest.mark.parametrize("kind,qtype", [(GGMLKind.Q4_1, Q.Q4_1), (GGMLKind.Q8_0, Q.Q8_0)])
def test_kernel_layout_holds_the_files_bytes_and_a_row_gets_the_same_bits_in_any_batch(kind, qtype):
    torch.manual_seed(5)
    raw = blocks_of(torch.randn(72, 160), qtype)
    layer = GGMLLinear(raw, kind)
    assert layer.layout is Layout.PANELS
    assert torch.equal(native_ops().ggml_unpack(native_ops().ggml_pack(raw, kind.value), kind.value, 72, 160), raw)
    assert torch.equal(layer.blocks(), raw)
    assert torch.equal(layer.dequantize(), torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype)))
    x = torch.randn(9, 160)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(9)])
    for rows in range(2, 10):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows
    assert torch.equal(layer.decode_kernel()(x), layer(x))
    layer.use_kernel = False
    torch.testing.assert_close(alone, layer(x), rtol=1e-4, atol=1e-4)


@needs_ggml_kernels
@pytest.mark.parametrize("kind,K", [(GGMLKind.Q4_1, 64), (GGMLKind.Q4_K, 256)])
def test_kernel_layers_stack_exactly_and_share_the_panels_they_fill(kind, K):
    rng = np.random.default_rng(6)
    width = panel_width()
    # whole panels (q, k, v of a 64-wide model); a last layer's partial panel (zeros past its rows in both); a
    # partial panel shared with the next layer's rows, which then start inside a panel
    for outs, shared in (((64, 32, 32), (True, True, True)), ((32, width + 4), (True, True)),
                         ((width + 4, 32), (False, False))):
        parts = [GGMLLinear(torch.from_numpy(random_blocks(kind.value, n, K, rng)), kind) for n in outs]
        fused = concat_outputs(parts)
        assert torch.equal(fused.blocks(), torch.cat([m.blocks() for m in parts]))
        x = torch.randn(4, K)
        assert torch.equal(fused(x), torch.cat([m(x) for m in parts], dim=-1))
        storage = fused.weight.untyped_storage().data_ptr()
        assert tuple(m.weight.untyped_storage().data_ptr() == storage for m in parts) == shared, outs


def test_quant_report_row_of_the_files_own_blocks_has_zero_weight_error(smollm2):
    from kvserve.engine.gguf_model import use_gguf_blocks
    from kvserve.quant.report import _own_block_rows

    measured = []

    def measure(model):  # the quality measures themselves are quant.quality's (tested in test_quant.py)
        measured.append({type(m).__name__ for m in model.modules()})
        return {}

    rows = _own_block_rows(smollm2.model, lambda m: use_gguf_blocks(m, default_gguf_path()), measure, lambda _: None)
    assert [r["label"] for r in rows] == ["GGUF's own blocks (q4_1, LM head q8_0)",
                                          "GGUF's own blocks as served (q4_1, LM head q8_0)"]
    for row in rows:
        assert row["rel_error_mean"] == 0.0 and row["rel_error_worst"] == 0.0
        assert row["bits_per_weight"] == 5.0  # Q4_1: 20 bytes per 32 weights
    assert all("GGMLLinear" in names and "GGMLEmbedding" in names for names in measured)
    assert not any(isinstance(m, GGMLLinear) for m in smollm2.model.modules())  # measured on copies


def test_a_float_checkpoints_calibrated_codes_are_cached_so_only_the_first_start_calibrates(smollm2, tmp_path,
                                                                                          monkeypatch, caplog):
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvserve.engine.loader import Device, DType, load_model
    from kvserve.quant import gptq

    config = LlamaConfig(vocab_size=len(smollm2.tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    checkpoint = tmp_path / "tiny"
    LlamaForCausalLM(config).save_pretrained(checkpoint)
    smollm2.tokenizer.save_pretrained(checkpoint)
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gptq, "CALIBRATION_NEW_TOKENS", 8)
    choice = weights.choose(Scheme.AUTO, str(checkpoint))
    first = load_model(str(checkpoint), DType.FLOAT32, Device.CPU, quantized=True)
    with caplog.at_level(logging.INFO, logger="kvserve.engine"):
        assert "int8/row+gptq" in weights.apply(first, choice.scheme, str(checkpoint), first.tokenizer)
    assert any("calibrated in" in r.getMessage() and "later starts skip" in r.getMessage() for r in caplog.records)
    assert len(list((tmp_path / "cache" / "codes").glob("tiny-*-int8-gptq-*.safetensors"))) == 1
    monkeypatch.setattr(gptq, "calibration_batch", lambda *a: pytest.fail("calibrated again"))
    again = load_model(str(checkpoint), DType.FLOAT32, Device.CPU, quantized=True)
    assert "int8/row+gptq" in weights.apply(again, choice.scheme, str(checkpoint), again.tokenizer)
    layer, cached = first.model.model.layers[1].mlp.down_proj, again.model.model.layers[1].mlp.down_proj
    assert torch.equal(layer.weight, cached.weight) and torch.equal(layer.scales, cached.scales)
    rounded = load_model(str(checkpoint), DType.FLOAT32, Device.CPU, quantized=True)
    weights.apply(rounded, Scheme.INT8, str(checkpoint))  # no tokenizer: rounded to nearest, other codes
    assert not torch.equal(rounded.model.model.layers[1].mlp.down_proj.weight, layer.weight)
