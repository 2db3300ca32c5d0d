"""planner/ (models.py, capacity.py): KV bytes per token, parameter counts, the memory split, ``kvserve plan``."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvserve.kvcache.sizing import KVShape
from kvserve.engine.options import Device, DType, activation_dtype
from kvserve.planner.capacity import PlanConfig, add_arguments, kv_dtype_for, plan, run
from kvserve.planner.models import ALIASES, PRESETS, KVDType, ModelSpec, spec_from_hf_dir

GiB = 2**30


def _plan_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return run(parser.parse_args(argv))


def test_issue_facts_bytes_per_token():
    qwen = PRESETS[ALIASES["0.5b"]]
    assert (qwen.num_layers, qwen.num_kv_heads, qwen.head_dim) == (24, 2, 64)
    assert qwen.kv_shape(KVDType.FP16).bytes_per_token == 12_288
    assert qwen.kv_shape(KVDType.FP16, num_kv_heads=qwen.num_heads).bytes_per_token == 86_016  # 14 full heads
    for name in ("mistral-7b", "llama-3-8b"):
        spec = PRESETS[name]
        assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (32, 8, 128)
        assert spec.kv_shape(KVDType.FP16).bytes_per_token == 131_072 == 128 * 1024
    assert KVShape(24, 2, 64, 2).bytes_per_token == 12_288
    assert KVShape(32, 8, 128, 2).bytes_per_token == 131_072
    assert qwen.kv_shape(KVDType.FP8).bytes_per_token == 6_144
    # int8 and int4 count their float16 scales: one per token and head, one per 32 channels for int4
    assert qwen.kv_shape(KVDType.INT8).bytes_per_token == 2 * 24 * 2 * (64 + 2) == 6_336
    assert qwen.kv_shape(KVDType.INT4).bytes_per_token == 2 * 24 * 2 * (32 + 2 * 2) == 3_456


def test_preset_geometry():
    geometry = {name: (s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim) for name, s in PRESETS.items()}
    assert geometry == {
        "smollm2-135m": (30, 9, 3, 64), "qwen2.5-0.5b": (24, 14, 2, 64), "llama-2-7b": (32, 32, 32, 128),
        "mistral-7b": (32, 32, 8, 128), "llama-3-8b": (32, 32, 8, 128), "llama-2-13b": (40, 40, 40, 128),
        "llama-2-70b": (80, 64, 8, 128)}
    assert ALIASES == {"0.5b": "qwen2.5-0.5b", "7b": "llama-2-7b", "13b": "llama-2-13b", "70b": "llama-2-70b"}


def test_parameter_estimates_match_published_counts():
    # Totals of the safetensors checkpoints on the Hugging Face Hub.
    assert {name: spec.params for name, spec in PRESETS.items()} == {
        "smollm2-135m": 134_515_008, "qwen2.5-0.5b": 494_032_768, "llama-2-7b": 6_738_415_616,
        "mistral-7b": 7_241_732_096, "llama-3-8b": 8_030_261_248, "llama-2-13b": 13_015_864_320,
        "llama-2-70b": 68_976_648_192}


def test_plan_by_hand_qwen_8gib():
    rows = plan(PRESETS["qwen2.5-0.5b"], PlanConfig(memories=[8 * GiB], contexts=[2048, 8192]))
    fp16, int8, int4 = rows
    # memory 8 GiB = 8,589,934,592 B; reserve 10% = int(858,993,459.2) = 858,993,459
    # fp16 weights = 494,032,768 params x 2 B = 988,065,536
    # KV pool = 8,589,934,592 - 858,993,459 - 988,065,536 = 6,742,875,597
    # block = 16 tokens x 12,288 B = 196,608 B; blocks = 6,742,875,597 // 196,608 = 34,296 (34,296 x 196,608
    #   = 6,742,867,968, remainder 7,629); tokens = 34,296 x 16 = 548,736
    # users at 2,048 = 34,296 // 128 blocks = 267; at 8,192 = 34,296 // 512 = 66
    assert (fp16.weight_dtype, fp16.weights_bytes, fp16.reserve_bytes) == ("fp16", 988_065_536, 858_993_459)
    assert (fp16.kv_pool_bytes, fp16.num_blocks, fp16.tokens) == (6_742_875_597, 34_296, 548_736)
    assert fp16.users == {2048: 267, 8192: 66}
    # int8: 1 B/param; int4: 4.25 bits/param = ceil(494,032,768 x 4.25 / 8) = 262,454,908 B
    assert (int8.weight_dtype, int8.weights_bytes) == ("int8", 494_032_768)
    assert (int4.weight_dtype, int4.weights_bytes) == ("int4", 262_454_908)
    assert int4.kv_pool_bytes == 8_589_934_592 - 858_993_459 - 262_454_908
    assert int4.tokens > int8.tokens > fp16.tokens


def test_plan_weights_that_do_not_fit():
    fp16, int8, _ = plan(PRESETS["llama-2-70b"], PlanConfig(memories=[80 * GiB], contexts=[4096]))
    assert fp16.weights_bytes == 2 * 68_976_648_192 > 80 * GiB
    assert (fp16.kv_pool_bytes, fp16.tokens, fp16.users) == (0, 0, {4096: 0})
    assert int8.tokens > 0


def test_partial_block_context_rounds_up():
    # a 20-token context with block 16 holds 2 blocks, so 10 blocks serve 5 users, not 8
    tiny = ModelSpec("tiny", 1, 1, 1, 1, 1, 1, 1, tied_embeddings=True, num_params=5)  # 4 KV bytes/token at fp16
    config = PlanConfig(memories=[10 + 10 * 16 * 4], contexts=[20], reserve_fraction=0.0)
    (row, _, _) = plan(tiny, config)
    assert row.weights_bytes == 10
    assert tiny.estimate_params() == 11  # per layer 2 + 2 (attention) + 3 (MLP) + 2 (norms); + embedding + norm
    assert (row.num_blocks, row.tokens, row.users) == (10, 160, {20: 5})


def test_model_spec_rejects_bad_heads():
    with pytest.raises(ValueError, match="not a multiple"):
        ModelSpec("bad", 2, 6, 4, 8, 48, 96, 100, tied_embeddings=False)


def _write_config(directory, **overrides) -> None:
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 32, "intermediate_size": 64,
              "vocab_size": 100, "tie_word_embeddings": True, "model_type": "llama", **overrides}
    (directory / "config.json").write_text(json.dumps(config))


def test_spec_from_hf_dir_reads_config_and_safetensors(tmp_path):
    _write_config(tmp_path, num_key_value_heads=2)
    spec = spec_from_hf_dir(tmp_path)
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (2, 4, 2, 8)  # 32 / 4 heads
    # no checkpoint: estimated. per layer 2*32*32 + 2*32*16 + 3*32*64 + 2*32 = 9,280; x2 + 100*32 + 32
    assert spec.num_params is None and spec.params == 21_792
    save_file({"a": np.zeros((100, 32), np.float32), "b": np.zeros(7, np.float16)}, str(tmp_path / "model.safetensors"))
    assert spec_from_hf_dir(tmp_path).params == 3_207  # from the headers
    save_file({"q": np.zeros((4, 4), np.int8)}, str(tmp_path / "quant.safetensors"))
    assert spec_from_hf_dir(tmp_path).params == 21_792  # packed integers do not count parameters


def test_spec_from_hf_dir_defaults_and_errors(tmp_path):
    _write_config(tmp_path, head_dim=16)
    spec = spec_from_hf_dir(tmp_path)
    assert (spec.num_kv_heads, spec.head_dim) == (4, 16)  # no num_key_value_heads: full attention
    _write_config(tmp_path, intermediate_size=None)
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4}))
    with pytest.raises(ValueError, match="has no field 'num_hidden_layers'"):
        spec_from_hf_dir(tmp_path)


def test_plan_json_output(capsys):
    assert _plan_cli(["--preset", "0.5b", "--memory", "8GiB", "--context", "2048,8192", "--kv-dtype", "fp16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv"]["bytes_per_token"] == 12_288
    assert data["kv"]["bytes_per_token_without_gqa"] == 86_016
    assert data["kv"]["formula"] == "2 x 24 layers x 2 kv_heads x 64 head_dim x 2 B = 12,288 bytes/token"
    assert data["model"]["params"] == 494_032_768
    assert [row["weight_dtype"] for row in data["rows"]] == ["fp16", "int8", "int4"]
    assert (data["rows"][0]["tokens"], data["rows"][0]["users"]) == (548_736, {"2048": 267, "8192": 66})


def test_plan_tables_and_bad_input(tmp_path, capsys):
    assert _plan_cli(["--preset", "mistral-7b", "--memory", "24GiB", "--kv-dtype", "fp16"]) == 0
    out = capsys.readouterr().out
    assert "= 131,072 bytes/token (128.0 KiB)" in out
    assert "without GQA (32 KV heads): 524,288 bytes/token, 4x more" in out
    assert "24.00 GiB: how much context" in out
    assert _plan_cli(["--model", str(tmp_path)]) == 2  # no config.json
    assert "config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _plan_cli(["--memory", "8XB"])


def test_contexts_beyond_the_models_own_are_not_counted(tmp_path, capsys):
    # llama-2-7b holds 4,096 tokens: "users at 8,192" would be a figure no server could serve
    assert _plan_cli(["--preset", "7b", "--memory", "24GiB", "--context", "2048,8192"]) == 0
    out = capsys.readouterr().out
    assert "-: 8,192 tokens is more than the model's context of 4,096" in out
    assert [line.split("│")[-2].strip() for line in out.splitlines() if line.startswith("│")] == ["-", "-", "-"]
    _write_config(tmp_path, max_position_embeddings=1024)
    assert spec_from_hf_dir(tmp_path).max_context == 1024
    for malformed in ("1024", 0, -5, True, None):  # treated as unknown, never a traceback
        _write_config(tmp_path, max_position_embeddings=malformed)
        assert spec_from_hf_dir(tmp_path).max_context is None
    assert _plan_cli(["--model", str(tmp_path), "--memory", "1GiB"]) == 0


def test_kvserve_plan_through_the_cli_dispatcher(capsys):
    from kvserve.server.cli import main

    assert main(["plan", "--preset", "70b", "--memory", "80GiB", "--kv-dtype", "fp8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv"]["bytes_per_token"] == 2 * 80 * 8 * 128 * 1  # 163,840
    assert data["rows"][0]["kv_pool_bytes"] == 0  # 138 GB of fp16 weights do not fit in 80 GiB
    assert main(["plan", "--memory", "16GiB"]) == 0  # the default preset: the served SmolLM2
    assert "smollm2-135m: 30 layers, 9 heads, 3 KV heads" in capsys.readouterr().out


def test_serve_refuses_bad_options_with_a_message_not_a_traceback(tmp_path, caplog):
    from kvserve.server.cli import main as kvserve_main
    assert kvserve_main(["serve", "--model", str(tmp_path / "missing")]) == 2
    assert "no such file or directory" in caplog.text
    assert kvserve_main(["serve", "--block-size", "0"]) == 2
    assert "--block-size must be >= 1" in caplog.text


def test_plan_defaults_are_serves_and_its_auto_kv_cache_is_what_serve_allocates(capsys):
    """`kvserve plan` with no flags counts the bytes per token `kvserve serve` with no flags allocates on this machine
    (float32 on a CPU: 46,080 for SmolLM2, not a float16 cache's 23,040), and its block size is serve's."""
    import torch
    from transformers import AutoConfig

    from kvserve.engine.loader import kv_shape_of, resolve_device, resolve_dtype, resolve_model_dir
    from kvserve.server.config import ServeConfig

    serve = ServeConfig()
    device = resolve_device(serve.device)
    served = kv_shape_of(AutoConfig.from_pretrained(resolve_model_dir(serve.model)),
                         resolve_dtype(serve.dtype, device, quantized=True), serve.kv_cache_dtype)
    assert _plan_cli(["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv"]["bytes_per_token"] == served.bytes_per_token
    assert (data["kv"]["asked"], data["block_size"]) == ("auto", serve.block_size)
    if device.type == "cpu":
        assert served.bytes_per_token == 46_080
    # the rule the planner applies without torch is the loader's, for every choice
    for choice in DType:
        for kind in ("cpu", "cuda"):
            want = resolve_dtype(choice, torch.device(kind))
            got = activation_dtype(choice, Device(kind))
            assert {torch.float32: DType.FLOAT32, torch.bfloat16: DType.BFLOAT16}[want] is got, (choice, kind)
    assert kv_dtype_for("auto", "auto", "cuda") is KVDType.BF16 and kv_dtype_for("bfloat16", "auto", "cpu") is KVDType.BF16
    assert _plan_cli(["--kv-cache-dtype", "int8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv"]["bytes_per_token"] == 11_880  # docs/api.md's int8 row
