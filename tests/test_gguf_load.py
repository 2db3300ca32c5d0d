"""GGUF files loaded directly (engine.gguf_model): each family computes what transformers computes on the same
weights, the file's own blocks are kept where a kernel reads them, the rest dequantized with one log line, the
served name, refusals before anything heavy runs, and the exactness properties on a K-quant file.

The files are the project's own (``python -m kvserve.loadtest randgguf``, tiny shapes: seconds).
"""

from __future__ import annotations

import copy
import logging
import shutil

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kvserve import native
from kvserve.engine import gguf_tokenizer
from kvserve.engine.gguf_file import GGUFError, read_gguf
from kvserve.engine.gguf_model import block_kind, load_gguf
from kvserve.engine.loader import SERVED_NAME, Device, DType, default_gguf_path, load_model, served_name
from kvserve.engine.runner import ModelRunner
from kvserve.kvcache.pool import KVPool
from kvserve.loadtest.fixtures.randgguf import SHAPES, tensor_type, use_more_bits
from kvserve.quant.ggml import GGMLEmbedding, GGMLLinear, dequantize_blocks
from tests.engineutil import NEAR_TIE_LOGITS, engine_greedy, reference_model, reference_shortfall

FAMILIES = {"tiny-llama": "llama", "tiny-mistral": "mistral", "tiny-qwen2": "qwen2", "tiny-qwen3": "qwen3"}
TEXT = "The capital of France is Paris, and the capital of Italy is"


def transformers_reference(path, shape: str):
    """transformers' own GGUF loader on the same file (dequantized), with sdpa attention; for Llama 3's RoPE,
    whose frequency factors transformers' GGUF loader does not read, the config that produced them."""
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    rope = SHAPES[shape].llama3_rope
    if rope is not None:
        factor, low, high, old = rope
        config.rope_parameters = {"rope_type": "llama3", "rope_theta": SHAPES[shape].rope_theta, "factor": factor,
                                  "low_freq_factor": low, "high_freq_factor": high,
                                  "original_max_position_embeddings": old}
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config, dtype=torch.float32)
    ref.set_attn_implementation("sdpa")
    return ref.eval()


@pytest.mark.parametrize("shape", sorted(FAMILIES))
def test_each_family_computes_what_transformers_computes_on_the_same_weights(tiny_gguf, shape):
    path = tiny_gguf(shape, "Q4_K_M")
    loaded = load_model(str(path), DType.FLOAT32, Device.CPU)  # dequantized: the weights transformers reads
    config = loaded.model.config
    assert config.model_type == FAMILIES[shape] and loaded.name == SHAPES[shape].name
    assert (config.num_hidden_layers, config.head_dim, config.num_key_value_heads) == (
        SHAPES[shape].layers, SHAPES[shape].head_dim, SHAPES[shape].kv_heads)
    ref = transformers_reference(path, shape)
    ids = loaded.tokenizer(TEXT)["input_ids"]
    ours = reference_model(loaded.model)
    with torch.inference_mode():
        ours_logits, ref_logits = ours(input_ids=torch.tensor([ids])).logits, ref(input_ids=torch.tensor([ids])).logits
    torch.testing.assert_close(ours_logits, ref_logits, rtol=1e-4, atol=1e-4)
    # the engine (the lean forward over the paged cache) picks what transformers scores best
    runner = ModelRunner(loaded, KVPool(loaded.kv_shape(), 8, 16, loaded.dtype))
    assert runner.fast is not None
    tokens, _ = engine_greedy(loaded, [ids], 16)
    assert reference_shortfall(ref, ids, tokens[0]) < 1e-3


def test_own_blocks_where_a_kernel_reads_them_and_the_rest_dequantized_in_one_log_line(tiny_gguf, caplog):
    path = tiny_gguf("tiny-llama", "Q4_K_M")
    file = read_gguf(path)
    with caplog.at_level(logging.INFO, logger="kvserve.engine"):
        loaded = load_model(str(path), DType.AUTO, Device.CPU, quantized=True, blocks=True)
    served_as = {}
    for i, layer in enumerate(loaded.model.model.layers):
        for name, module in (("attn_v", layer.self_attn.v_proj), ("ffn_down", layer.mlp.down_proj),
                             ("attn_q", layer.self_attn.q_proj)):
            kind = file.tensors[f"blk.{i}.{name}.weight"].ggml_type
            assert kind.name == tensor_type("Q4_K_M", name, i, 2, 256 if name != "ffn_down" else 512)
            assert isinstance(module, GGMLLinear) == (block_kind(kind) is not None), (i, name)
            served_as.setdefault(kind.name, type(module).__name__)
    assert set(served_as) == {"Q4_K", "Q6_K"} and use_more_bits(1, 2) and not use_more_bits(0, 2)
    summary = loaded.gguf
    if native.load() is not None:  # every tensor of the mixture on its type's kernel
        assert served_as == {"Q4_K": "GGMLLinear", "Q6_K": "GGMLLinear"} and summary.head == "q6_k"
        assert summary.kinds == {"q4_k": 12, "q6_k": 2} and summary.dequantized == {}  # layer 1: v, down
        path = native.load().isa()
        assert f"kernels q4_k: kv_q4_k_{path}, q6_k: kv_q6_k_{path} ({path}: " in summary.describe()
    dequantized = {t for t, kind in served_as.items() if kind == "Linear"}
    assert set(summary.dequantized) == dequantized
    lines = [r.getMessage() for r in caplog.records if "no native kernel" in r.getMessage()]
    assert len(lines) == (1 if dequantized else 0)
    if dequantized:
        assert all(t in lines[0] for t in dequantized) and "MiB of floats for the file's" in lines[0]


def test_blocks_are_served_from_the_file_without_a_float_copy(tiny_gguf, tmp_path, monkeypatch):
    path = tiny_gguf("tiny-qwen2", "Q8_0")  # every quantized tensor of a type with a kernel
    native.load(), native.load_ops()  # from their usual cache, before KVSERVE_CACHE moves (the kernels' too)
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    loaded = load_model(str(path), DType.AUTO, Device.CPU, quantized=True, blocks=True)
    model = loaded.model
    assert isinstance(model.lm_head, GGMLLinear) and isinstance(model.model.embed_tokens, GGMLEmbedding)
    assert not [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    floats = sum(p.numel() * p.element_size() for p in model.parameters())
    assert floats < path.stat().st_size / 20  # norms and biases only
    assert loaded.gguf.dequantized == {} and loaded.gguf.kinds == {"q8_0": 14}
    written = [f for f in tmp_path.rglob("*") if f.is_file()]
    assert written and all(f.suffix in (".json", ".jinja") for f in written)  # the tokenizer and config only
    assert sum(f.stat().st_size for f in written) < path.stat().st_size
    # greedy output on the kernels is the layers' reference path's, up to near-ties
    ids = loaded.tokenizer(TEXT)["input_ids"]
    ref = reference_model(model)
    for module in ref.modules():
        if isinstance(module, GGMLLinear):
            module.use_kernel = False
    tokens, _ = engine_greedy(loaded, [ids], 12)
    assert reference_shortfall(ref, ids, tokens[0]) <= NEAR_TIE_LOGITS


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q8_0"])
def test_a_tied_embedding_is_looked_up_in_its_heads_blocks_held_once(tiny_gguf, mix):
    # Llama 3.2, Qwen2.5 and Qwen3 tie the embedding to the LM head: the head's blocks (in the kernels' panels)
    # serve both, so neither a second copy nor the file's pages of the table (resident as tokens are looked up)
    # add to the resident set; each row still has the file's bits
    path = tiny_gguf("tiny-llama", mix)
    file = read_gguf(path)
    assert "output.weight" not in file.tensors  # tied
    loaded = load_model(str(path), DType.AUTO, Device.CPU, quantized=True, blocks=True)
    head, embedding = loaded.model.lm_head, loaded.model.model.embed_tokens
    table = file.tensors["token_embd.weight"]
    kind = block_kind(table.ggml_type)
    expected = dequantize_blocks(torch.from_numpy(np.array(table.data())), kind)  # [vocab, hidden]
    ids = torch.tensor([[0, 5, expected.shape[0] - 1], [17, 17, expected.shape[0] - 9]])
    assert torch.equal(embedding(ids).view(torch.int32), expected[ids].view(torch.int32))
    assert embedding.table().data_ptr() == head.weight.data_ptr()
    if native.load() is not None:  # the head in panels: the embedding has no table of its own
        assert embedding.head is head and list(embedding.buffers()) == [] and embedding.panel_rows > 0
        held = {t.data_ptr(): t.numel() * t.element_size()
                for t in (*loaded.model.parameters(), *loaded.model.buffers())}
        assert sum(held.values()) < path.stat().st_size + table.nbytes // 2  # the table once
        assert loaded.gguf.bytes_after < path.stat().st_size + table.nbytes // 2
        with pytest.raises(RuntimeError, match="out of range"):
            embedding(torch.tensor([expected.shape[0]]))


def test_served_name_is_the_files_general_name_or_its_stem_and_the_default_keeps_its_own(tmp_path):
    default = default_gguf_path()
    identity = read_gguf(default).identity
    assert served_name(None, None, identity) == served_name("smollm2", None, identity) == SERVED_NAME
    assert served_name(str(default), "Smollm2 135M 8k Lc100K Mix1 Ep2", identity) == SERVED_NAME
    copy_of_default = tmp_path / "renamed.gguf"
    shutil.copyfile(default, copy_of_default)
    assert served_name(str(copy_of_default), "Smollm2 135M", read_gguf(copy_of_default).identity) == SERVED_NAME
    assert served_name("/m/llama-q4_k_m.gguf", "Llama 3.2 1B Instruct", "other") == "Llama 3.2 1B Instruct"
    assert served_name("/m/llama-q4_k_m.gguf", None, "other") == "llama-q4_k_m"
    assert served_name("/m/llama-q4_k_m.gguf", "two\nlines", "other") == "llama-q4_k_m"
    assert served_name("/models/my-dir", None, "") == "my-dir"


def _rewritten(source, out, architecture: str | None = None, drop: str | None = None,
               retype: tuple[str, gguf.GGMLQuantizationType] | None = None, extra: dict[str, int] | None = None):
    """``source`` written again with another architecture, without tensor ``drop``, one tensor stored as
    another type (its bytes reinterpreted, valid or not), or ``extra`` uint32 keys added."""
    reader = gguf.GGUFReader(source)
    arch = architecture or reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        value_type = field.types[0]
        if value_type == gguf.GGUFValueType.ARRAY:
            writer.add_array(key.replace(reader.fields["general.architecture"].contents() + ".", arch + "."), value)
        else:
            writer.add_key_value(key.replace(reader.fields["general.architecture"].contents() + ".", arch + "."),
                                 value, value_type)
    for key, value in (extra or {}).items():
        writer.add_uint32(key, value)
    for tensor in reader.tensors:
        if tensor.name == drop:
            continue
        kind, data = tensor.tensor_type, np.asarray(tensor.data)
        if retype is not None and tensor.name == retype[0]:
            kind = retype[1]
            block, size = gguf.GGML_QUANT_SIZES[kind]
            rows = int(np.prod(tensor.shape[1:]))
            data = np.zeros((rows, int(tensor.shape[0]) // block * size), dtype=np.uint8)
            if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                data = data.view(np.float32 if kind == gguf.GGMLQuantizationType.F32 else np.float16)
        if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(tensor.name, data)
        else:
            writer.add_tensor(tensor.name, data.view(np.uint8), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_the_files_end_of_turn_and_end_of_message_tokens_end_a_reply(tiny_gguf, tmp_path):
    """A Llama 3 file names <|eot_id|> and <|eom_id|> besides its EOS: each ends generation, as in llama.cpp."""
    from kvserve.engine.gguf_model import load_gguf

    source = tiny_gguf("tiny-llama", "Q8_0")
    eos = gguf.GGUFReader(source).fields["tokenizer.ggml.eos_token_id"].contents()
    path = _rewritten(source, tmp_path / "eot.gguf", extra={"tokenizer.ggml.eot_token_id": 7,
                                                            "tokenizer.ggml.eom_token_id": 9})
    assert load_gguf(path, blocks=True).model.generation_config.eos_token_id == [eos, 7, 9]
    outside = _rewritten(source, tmp_path / "outside.gguf", extra={"tokenizer.ggml.eot_token_id": 10 ** 9})
    assert load_gguf(outside, blocks=True).model.generation_config.eos_token_id == [eos]


def test_unknown_architectures_and_types_are_refused_before_anything_heavy(tiny_gguf, tmp_path, monkeypatch):
    source = tiny_gguf("tiny-llama", "Q8_0")
    monkeypatch.setattr(gguf_tokenizer, "cached_tokenizer", lambda *a: pytest.fail("went on past the checks"))
    with pytest.raises(GGUFError, match=r"architecture 'gemma' is not served by kvserve \(it serves llama"):
        load_gguf(_rewritten(source, tmp_path / "gemma.gguf", architecture="gemma"), blocks=True)
    with pytest.raises(GGUFError, match=r"1 missing \(blk.1.ffn_up.weight\)"):
        load_gguf(_rewritten(source, tmp_path / "short.gguf", drop="blk.1.ffn_up.weight"), blocks=True)
    unreadable = gguf.GGMLQuantizationType.TQ1_0 if _lacks_dequantizer("TQ1_0") else gguf.GGMLQuantizationType.Q8_1
    retyped = _rewritten(source, tmp_path / "odd.gguf", retype=("blk.0.attn_q.weight", unreadable))
    with pytest.raises(GGUFError, match=f"of a tensor type kvserve cannot read \\({unreadable.name}\\).*Q8_0"):
        load_gguf(retyped, blocks=True)


def test_a_file_kvserve_cannot_serve_is_refused_before_the_kernels_build(tiny_gguf, tmp_path, monkeypatch):
    """load_model checks a GGUF's architecture and tensors (its metadata, read memory-mapped) before it builds or
    loads the native kernels: on a first start that build takes minutes, and a wrong --model must not wait for it.
    A directory without a config is refused before it too."""
    from kvserve import native
    from kvserve.engine.loader import load_model

    monkeypatch.setattr(native, "load", lambda *a, **k: pytest.fail("built the kernels before checking the file"))
    source = tiny_gguf("tiny-llama", "Q8_0")
    with pytest.raises(GGUFError, match=r"architecture 'gemma' is not served by kvserve"):
        load_model(str(_rewritten(source, tmp_path / "gemma.gguf", architecture="gemma")), blocks=True)
    with pytest.raises(GGUFError, match=r"1 missing \(blk.1.ffn_up.weight\)"):
        load_model(str(_rewritten(source, tmp_path / "short.gguf", drop="blk.1.ffn_up.weight")), blocks=True)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path), blocks=True)


def _lacks_dequantizer(name: str) -> bool:
    try:
        gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][1]), np.uint8),
                               gguf.GGMLQuantizationType[name])
    except NotImplementedError:
        return True
    return False


def test_a_type_without_a_kernel_that_gguf_reads_is_served_dequantized_in_one_log_line(tiny_gguf, tmp_path, caplog):
    source = tiny_gguf("tiny-llama", "Q8_0")
    iq = _rewritten(source, tmp_path / "iq.gguf", retype=("blk.0.ffn_up.weight", gguf.GGMLQuantizationType.IQ4_NL))
    with caplog.at_level(logging.INFO, logger="kvserve.engine"):
        built = load_gguf(iq, blocks=True)
    assert type(built.model.model.layers[0].mlp.up_proj) is torch.nn.Linear
    assert built.summary.dequantized["IQ4_NL"][0] == 1
    lines = [r.getMessage() for r in caplog.records if "no native kernel" in r.getMessage()]
    assert len(lines) == 1 and "1 IQ4_NL: 0.5 MiB of floats for the file's 0.1 MiB" in lines[0], lines


def test_a_float_tensor_runs_on_the_float_kernels_and_the_start_line_says_so(tiny_gguf, tmp_path, caplog):
    source = tiny_gguf("tiny-llama", "Q4_K_M")
    f16 = _rewritten(source, tmp_path / "f16.gguf", retype=("blk.0.ffn_up.weight", gguf.GGMLQuantizationType.F16))
    with caplog.at_level(logging.INFO, logger="kvserve.engine"):
        built = load_gguf(f16, blocks=True)
    layer = built.model.model.layers[0].mlp.up_proj
    assert type(layer) is torch.nn.Linear and layer.weight.dtype == torch.float32 and not layer.weight.any()
    assert built.summary.floats == {"F16": 1} and built.summary.dequantized == {}
    assert "; float tensors on the float kernels: 1 F16" in built.summary.describe()
    assert not [r for r in caplog.records if "no native kernel" in r.getMessage()]


@pytest.fixture(scope="module", params=["Q4_K_M", "Q5_K_M"])
def kquant(tiny_gguf, request):
    """The tiny Llama in a K-quant mixture (Q4_K or Q5_K projections, Q6_K for some and the LM head) as ``kvserve
    serve`` serves it: the file's own blocks, on their kernels where they build."""
    loaded = load_model(str(tiny_gguf("tiny-llama", request.param)), DType.AUTO, Device.CPU, quantized=True,
                        blocks=True)
    if native.load() is not None:
        assert set(loaded.gguf.kinds) == {request.param[:4].lower(), "q6_k"} and loaded.gguf.head == "q6_k"
    return loaded


def test_a_k_quant_file_is_exact_alone_batched_chunked_and_on_a_prefix_hit(kquant):
    tok = kquant.tokenizer
    prompts = [tok(TEXT)["input_ids"], tok("Once upon a time " * 6)["input_ids"]]
    alone = [engine_greedy(kquant, [p], 24)[0][0] for p in prompts]
    hit, scheduler = engine_greedy(kquant, [prompts[1], prompts[1]], 24, arrivals_at=[0, 40])
    assert scheduler.prefix_hits >= 16 and hit == [alone[1], alone[1]]
    others = [tok(f"Story number {i}: " + "the wind and the rain " * (i % 4 + 1))["input_ids"] for i in range(6)]
    batched, scheduler = engine_greedy(kquant, prompts + others, 24, num_blocks=14, budget=24, max_num_seqs=8,
                                       arrivals_at=[2, 0, 0, 1, 1, 3, 5, 8], prefix_caching=False)
    assert scheduler.num_preemptions > 0 and batched[:2] == alone


def test_a_k_quant_file_is_exact_with_speculation_on_and_off(kquant):
    from kvserve.engine.drafters import NgramDrafter
    from kvserve.speculation.policy import DraftPolicy

    ids = kquant.tokenizer("alpha beta gamma delta " * 8)["input_ids"]
    plain, _ = engine_greedy(kquant, [ids], 32)
    drafted, scheduler = engine_greedy(kquant, [ids], 32, draft=DraftPolicy(max_draft=4, adaptive=False),
                                       drafter=NgramDrafter())
    assert drafted == plain and scheduler.spec.policy.drafted > 0


SERVE_WITHOUT_MODELING_CODE = """
import sys
import kvserve.server.app  # what `kvserve serve` imports
from kvserve.engine.plan import SamplingParams, SeqWork, StepPlan
from kvserve.server.config import ServeConfig
from kvserve.server.serve import build_state
state = build_state(ServeConfig(kv_cache_memory="64MiB"))
ids = state.tokenizer("The capital of France is")["input_ids"]
work = SeqWork(seq_id=0, token_ids=ids, start_pos=0, block_table=[0, 1], slot_mapping=list(range(len(ids))),
               sample=True, params=SamplingParams(temperature=0.0), prompt_ids=ids, output_ids=[])
token = state.runner.execute(StepPlan([work]))[0].token.token_id
heavy = sorted(m for m in sys.modules if m in ("transformers.modeling_utils", "accelerate", "sympy"))
print(type(state.runner.loaded.model).__name__, state.runner.fast is not None, token, heavy)
"""


def test_serving_the_default_gguf_never_imports_transformers_modeling_code():
    """The server's own loading (build_state) and one prefill on the embedded GGUF: the lean modules and the lean
    forward only; transformers' modeling code (~120 MiB resident) stays out of the process."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SERVE_WITHOUT_MODELING_CODE], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    kind, fast, token, heavy = done.stdout.strip().splitlines()[-1].split(" ", 3)
    assert (kind, fast, heavy) == ("LeanCausalLM", "True", "[]")
    assert 0 <= int(token) < 49152


@pytest.mark.parametrize("shape", sorted(FAMILIES))
def test_each_familys_lean_modules_serve_what_transformers_modules_compute_on_the_same_blocks(tiny_gguf, shape):
    """The file's own blocks in the lean modules (engine.lean_model) and the same tensors in transformers' model of
    the family: the same RoPE bits, and the engine's greedy tokens are the ones transformers' forward scores best
    (up to near-ties: activations are quantized per block)."""
    from kvserve.engine.lean_model import LeanCausalLM, transformers_model

    path = tiny_gguf(shape, "Q4_K_M")
    loaded = load_model(str(path), DType.AUTO, Device.CPU, quantized=True, blocks=True)
    model = loaded.model
    assert isinstance(model, LeanCausalLM) and model.config.model_type == FAMILIES[shape]
    with pytest.raises(TypeError, match="FastDecoder only"):
        model(input_ids=torch.tensor([[1, 2]]))
    twin = copy.deepcopy(model)
    ref = transformers_model(twin)
    ref.set_attn_implementation("sdpa")
    assert type(ref).__name__.lower().startswith(FAMILIES[shape])
    assert ref.model.layers[1].mlp.down_proj is twin.model.layers[1].mlp.down_proj  # the same modules, shared
    positions = torch.arange(300)[None]
    x = torch.empty(1, 0, 0)
    for ours, theirs in zip(model.model.rotary_emb(x, positions), ref.model.rotary_emb(x, positions)):
        assert torch.equal(ours, theirs)
    for module in ref.modules():
        if isinstance(module, GGMLLinear):
            module.use_kernel = False
    ids = loaded.tokenizer(TEXT)["input_ids"]
    tokens, _ = engine_greedy(loaded, [ids], 12)
    assert reference_shortfall(ref, ids, tokens[0]) <= NEAR_TIE_LOGITS


def test_without_the_lean_forward_a_gguf_files_blocks_run_in_transformers_modules(tiny_gguf, monkeypatch):
    """``KVSERVE_FASTPATH=0`` on a GGUF file: its own blocks, in transformers' model (the lean modules have no
    forward of their own), and the engine serves it on that forward."""
    from kvserve.engine.lean_model import LeanCausalLM

    path = tiny_gguf("tiny-qwen2", "Q8_0")
    monkeypatch.setenv("KVSERVE_FASTPATH", "0")
    loaded = load_model(str(path), DType.AUTO, Device.CPU, quantized=True, blocks=True)
    assert not isinstance(loaded.model, LeanCausalLM) and type(loaded.model).__name__ == "Qwen2ForCausalLM"
    assert isinstance(loaded.model.model.layers[0].mlp.up_proj, GGMLLinear) and loaded.gguf.kinds == {"q8_0": 14}
    assert ModelRunner(loaded, KVPool(loaded.kv_shape(), 8, 16, loaded.dtype)).fast is None
    ids = loaded.tokenizer(TEXT)["input_ids"]
    tokens, _ = engine_greedy(loaded, [ids], 6)
    assert reference_shortfall(reference_model(loaded.model), ids, tokens[0]) <= NEAR_TIE_LOGITS


@pytest.mark.parametrize("stream", [False, True])
def test_a_qwen_files_tags_are_one_text_token_each_and_a_forced_tool_call_is_served(tiny_gguf, stream):
    """A Qwen3 file's <tool_call>, </tool_call>, <think> and </think> are USER_DEFINED tokens (as llama.cpp's
    converter writes them): one token each, text (not special), and tool_choice required comes back as a call,
    whole and streamed. Before, these tags failed every forced tool call at its first token (a 400 whole, an
    error event streamed)."""
    import json

    import httpx

    from kvserve.loadtest.fixtures.randgguf import TAGS
    from tests.serverutil import running_server

    loaded = load_model(str(tiny_gguf("tiny-qwen3", "Q8_0")), DType.AUTO, Device.CPU, quantized=True, blocks=True)
    tokenizer = loaded.tokenizer
    for tag in TAGS["qwen3"]:
        ids = tokenizer(tag, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) == tag, (tag, ids)
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "temperature": 0, "max_tokens": 40,
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}],
            "tool_choice": "required", "stream": stream}
    with running_server(loaded) as url:
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    if stream:
        events = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")]
        assert not any("error" in e for e in events), events
        names = [c["function"].get("name") for e in events for choice in e["choices"]
                 for c in choice["delta"].get("tool_calls") or []]
        reasons = [choice["finish_reason"] for e in events for choice in e["choices"] if choice["finish_reason"]]
        assert "get_weather" in names and reasons == ["tool_calls"], events
    else:
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert set(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])) == {"city"}
