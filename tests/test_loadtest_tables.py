"""The engine tables: MAC counts exact against the model, byte counts, the elbow rule, tiny sweeps on SmolLM2."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve.engine.loader import wrap_model
from kvserve.loadtest.engine import macs, tables


@pytest.fixture(scope="module")
def tiny():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    return wrap_model(LlamaForCausalLM(config), tokenizer=None, name="tiny")


def _serve_tiny(monkeypatch, max_positions: int = 128, gguf: bool = False, name: str = "tiny"):
    """A 2-layer Llama (vocabulary 6144: the benches feed ids up to 6000) that the loadtest commands load in place of
    the served model; ``gguf``: its projections as GGUF blocks (tests/ggmlutil.py)."""
    from kvserve.loadtest.engine import enginebench
    from tests.ggmlutil import with_gguf_blocks

    config = LlamaConfig(vocab_size=6144, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if gguf:
        with_gguf_blocks(model)
    loaded = wrap_model(model, tokenizer=None, name=name)
    monkeypatch.setattr(enginebench, "load", lambda *args, **kwargs: loaded)
    return loaded


@pytest.mark.parametrize("tokens", [1, 3, 6])
def test_mac_closed_form_equals_the_count_on_the_model(tiny, tokens):
    counted = tables.count_macs(tiny, tokens)
    assert counted["counted_with_cache"] == counted["formula_with_cache"]
    assert counted["counted_without_cache"] == counted["formula_without_cache"]


def test_mac_closed_form_by_hand(tiny):
    g = macs.Geometry.of(tiny.model.config)
    # per token: 2 layers x (q 32*32 + k,v 2*32*16 + o 32*32 + mlp 3*32*48) = 2 * 7680
    assert g.per_token == 15360 and g.per_pair == 2 * 2 * 4 * 8
    head = 32 * 64
    assert macs.macs_with_cache(g, 2) == 2 * (15360 + head) + 128 * (1 + 2)
    assert macs.macs_without_cache(g, 2) == 15360 * (1 + 2) + 2 * head + 128 * (1 + 4)
    assert macs.macs_with_cache(g, 1) == macs.macs_without_cache(g, 1)


def test_head_table_score_bytes():
    rows = tables.head_table([8, 4096], reps=1)
    assert [(r["cached_score_bytes"], r["recompute_score_bytes"]) for r in rows] == [(32, 256), (16384, 67108864)]


def test_elbow_is_where_every_further_doubling_costs_sqrt2():
    # latency growth per doubling: 1.1, 1.18, 1.46, 2.1 -> stops paying from B = 4 on
    assert tables.find_elbow([(1, 10.0), (2, 11.0), (4, 13.0), (8, 19.0), (16, 40.0)]) == 4
    # 1.6 (an early bump), 1.06, 1.76 -> the early bump does not count: from B = 4 on
    assert tables.find_elbow([(1, 10.0), (2, 16.0), (4, 17.0), (8, 30.0)]) == 4
    assert tables.find_elbow([(1, 10.0), (2, 11.0), (4, 12.0)]) is None


def test_engine_sweeps_on_smollm2(smollm2):
    rows = tables.prefill_decode_table([4, 8], smollm2, reps=1)
    assert [r["tokens"] for r in rows] == [4, 8]
    assert rows[1]["prefill_ms_per_token"] == pytest.approx(rows[1]["prefill_ms"] / 8)
    batch, _elbow = tables.batch_table([1, 2], smollm2, reps=1, context=8)
    assert [r["B"] for r in batch] == [1, 2] and batch[0]["throughput_x"] == 1.0
    assert batch[1]["tokens_per_s"] == pytest.approx(2000 / batch[1]["step_ms"])
    text = tables.render({"prefill": rows, "batch": (batch, None)}, smollm2.kv_shape().bytes_per_token)
    assert "| 8 |" in text and "Elbow" in text


def test_profile_categories():
    from kvserve.loadtest.engine.profile_step import _category

    assert _category("aten::addmm") == "projections (linear/matmul)"
    assert _category("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention (SDPA)"
    assert _category("aten::index_put_") == "paged KV gather/scatter"
    assert _category("aten::rsqrt") == "other ops"


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_profile_quantization_flag_profiles_the_quantized_kernels(scheme, monkeypatch, capsys):
    """`python -m kvserve.loadtest profile --quantization X` quantizes as serve does, and the C++ kernels' time lands
    in the projections row (labelled, not lost in the Python/dispatch remainder)."""
    from kvserve.loadtest.__main__ import main as loadtest_main
    from kvserve import native
    from kvserve.quant.linear import QuantLinear

    if native.load() is None:
        pytest.skip("no C++ kernels here")
    loaded = _serve_tiny(monkeypatch, max_positions=64)
    assert loadtest_main(["profile", "--quantization", scheme, "--batch", "1", "--context", "8", "--steps", "2",
                          "--no-write"]) == 0
    out = capsys.readouterr().out
    assert f"quantization {scheme}" in out and "`kvserve::projection`" in out
    assert any(isinstance(m, QuantLinear) for m in loaded.model.modules())
    projections = next(line for line in out.splitlines() if line.startswith("| projections"))
    assert projections != "| projections (linear/matmul) | 0% |"


def test_profile_prefill_splits_a_chunked_prefill_into_parts(monkeypatch, capsys):
    """`python -m kvserve.loadtest profile --prefill` prefills in --chunk steps and puts the projections' and the
    attention's time in their own columns, each with a rate from the model's multiply-adds."""
    from kvserve.loadtest.__main__ import main as loadtest_main
    from kvserve.loadtest.engine import enginebench, profile_step

    _serve_tiny(monkeypatch)
    steps = []
    execute = enginebench.ModelRunner.execute
    monkeypatch.setattr(enginebench.ModelRunner, "execute",
                        lambda self, plan: steps.append([(len(w.token_ids), w.sample) for w in plan.work]) or execute(self, plan))
    assert loadtest_main(["profile", "--prefill", "40", "--chunk", "16", "--quantization", "int8", "--no-write"]) == 0
    assert steps[:3] == [[(16, False)], [(16, False)], [(8, True)]]  # the 40-token prompt in 16-token chunks, as the server cuts it
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 40 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[1]) > 0 and float(cells[6].split()[0]) > 0 and float(cells[7].split()[0]) > 0
    if profile_step.attention_peak("auto", 32) is not None:  # attention as a share of its path's measured peak
        assert cells[7].endswith("%)") and "attention GMAC/s (% of" in out and "at 100% of its peak" in out
    shares = [int(c.split("(")[1].rstrip("%)")) for c in cells[3:6]]
    assert 97 <= sum(shares) <= 103 and shares[0] > 0
    assert profile_step._category("kvserve::paged_attention") == "attention (SDPA)"
    # --kv-cache-dtype: the prefill over that cache (its pool's dtype), named in the output
    pools = []
    _serve_tiny(monkeypatch)  # a fresh one: the first run quantized its model
    monkeypatch.setattr(enginebench.ModelRunner, "execute",
                        lambda self, plan: pools.append(self.pool.data.dtype) or execute(self, plan))
    assert loadtest_main(["profile", "--prefill", "40", "--chunk", "16", "--quantization", "int8",
                          "--kv-cache-dtype", "bfloat16", "--no-write"]) == 0
    assert pools and set(pools) == {torch.bfloat16}
    assert "KV cache bfloat16" in capsys.readouterr().out


def test_profile_step_thread_runs_the_prefill_on_the_calling_thread_and_on_a_step_thread(monkeypatch, capsys):
    """`profile --step-thread --prefill`: each round runs the prompt's steps on this thread and then on a thread of
    its own, as the server runs steps, and the table gives each thread's median and their ratio."""
    import threading

    from kvserve.loadtest.__main__ import main as loadtest_main
    from kvserve.loadtest.engine import enginebench

    _serve_tiny(monkeypatch)
    threads = []
    execute = enginebench.ModelRunner.execute
    monkeypatch.setattr(enginebench.ModelRunner, "execute",
                        lambda self, plan: threads.append(threading.get_ident()) or execute(self, plan))
    assert loadtest_main(["profile", "--step-thread", "--prefill", "40", "--chunk", "16", "--rounds", "2",
                          "--quantization", "int8", "--no-write"]) == 0
    here = threading.get_ident()
    # 3 steps a prefill; a warm-up and 2 rounds on each thread, alternating after the warm-ups
    assert len(threads) == 3 * 6 and set(threads[:3]) == {here} and here not in threads[3:6]
    assert [t == here for t in threads[6::3]] == [True, False, True, False]
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| 40 |"))
    here_s, there_s, ratio = (float(c) for c in row.strip("|").split("|")[1:])
    assert here_s > 0 and there_s > 0 and ratio > 0


def test_peak_probes_give_a_rate_on_each_native_path():
    """The float32 FMA and int8 roofline probes (leaves.cpp) the prefill profile sets attention and the projections
    against: a positive rate on every vector path this CPU runs (the AVX2 path's int8 peak its own `vpmaddubsw`,
    not AVX-512's `vpdpbusd`), none for the scalar path (no probe)."""
    from kvserve import native
    from kvserve.loadtest.engine import roofline

    for path in set(native.native_isas()) & {"avx2", "avx512"}:
        assert roofline.fma_peak_gmacs(path, iterations=200_000) > 0
        assert roofline.int8_peak_gmacs(path, iterations=200_000) > 0
    assert roofline.fma_peak_gmacs("scalar") is None and roofline.int8_peak_gmacs("scalar") is None
    assert roofline.INT8_PROBES["avx2"][0] == "vpmaddubsw"


def test_profile_layers_both_shows_the_rest_of_the_layer_loop_and_of_the_layer_stack(monkeypatch, capsys):
    """`python -m kvserve.loadtest profile --layers both`: per batch size the per-layer loop and the layer stack side
    by side, each with its step, its projections and LM head replayed alone, and the rest (the step less them)."""
    from kvserve.loadtest.__main__ import main as loadtest_main

    _serve_tiny(monkeypatch, gguf=True, name="tiny-gguf")
    assert loadtest_main(["profile", "--batch", "1,2", "--layers", "both", "--rounds", "1", "--steps", "2",
                          "--context", "8", "--quantization", "none", "--no-write"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    table = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines)}
    assert table["share of a decode step"] == ["layer loop, B = 1", "layer stack, B = 1", "layer loop, B = 2",
                                               "layer stack, B = 2"]
    step, alone, rest = ([float(c) for c in table[row]] for row in ("step ms (median, no profiler)",
                                                                   "projections + LM head alone, ms",
                                                                   "rest ms (step - them)"))
    assert all(a > 0 for a in alone)
    assert all(abs(s - a - r) < 0.02 for s, a, r in zip(step, alone, rest))
    # every round's rest of both paths and their ratio, then the medians
    assert table["rest ms per round"] == [f"{head}, B = {b}" for b in (1, 2)
                                          for head in ("layer loop", "layer stack", "stack / loop")]
    assert list(table)[-3:] == ["rest ms per round", "round 1", "median (ratio: of the rounds' ratios)"]


def test_rest_per_round_and_the_median_of_the_rounds_ratios():
    """`profile --layers both`: one round where the machine was busy for the loop moves one ratio of three, not the
    median ratio (the main table's per-path median rounds could pair a quiet stack round with a busy loop one)."""
    from kvserve.loadtest.engine.profile_step import DecodeProfile, rest_rounds_table

    def run(rest_ms: float) -> DecodeProfile:
        return DecodeProfile(wall_ms=rest_ms + 5.0, profiled_ms=0.0, shares={}, top=[], alone_ms=5.0)
    runs = {(1, "loop"): [run(2.0), run(10.0), run(2.5)], (1, "stack"): [run(1.0), run(1.0), run(1.5)]}
    lines = rest_rounds_table([1], runs).splitlines()
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines
                                              if line.startswith("| "))}
    assert rows["round 1"] == ["2.00", "1.00", "0.50"]
    assert rows["round 2"] == ["10.00", "1.00", "0.10"]
    assert rows["round 3"] == ["2.50", "1.50", "0.60"]
    assert rows["median (ratio: of the rounds' ratios)"] == ["2.50", "1.00", "0.50"]
    # noise larger than the loop's rest: that round has no ratio, and the median is of the others
    runs[1, "loop"][1] = run(-0.5)
    lines = rest_rounds_table([1], runs).splitlines()
    assert lines[3] == "| round 2 | -0.50 | 1.00 | nan |" and lines[-1].endswith("| 0.55 |")


def test_ready_table_takes_the_peak_over_starts_and_judges_it_against_the_budget():
    from kvserve.loadtest.served.readybench import table

    mib = 2**20
    rows = [{"name": "a.gguf", "size": 800 * mib, "pool": 1024 * mib,
             "starts": [{"ready_s": 9.06, "peak_rss": 2100 * mib, "rss": 2000 * mib},
                        {"ready_s": 4.0, "peak_rss": 2300 * mib, "rss": 1900 * mib}]},
            {"name": "b.gguf", "size": 800 * mib, "pool": 1024 * mib,
             "starts": [{"ready_s": 3.0, "peak_rss": 2225 * mib, "rss": 2200 * mib}]}]
    lines = table(rows).splitlines()
    assert lines[2] == "| a.gguf | 800 | 1,024 | 9.1 | 4.0 | 2,000 | 2,300 | +476 | no |"
    assert lines[3] == "| b.gguf | 800 | 1,024 | 3.0 | - | 2,200 | 2,225 | +401 | no |"
    rows[1]["starts"][0]["peak_rss"] = 2224 * mib
    assert table(rows).splitlines()[3].endswith("| +400 | yes |")
    # the peak after prompts across the vocabulary (the last start's) is judged too
    rows[1]["starts"][0]["vocab_peak_rss"] = 2230 * mib
    lines = table(rows, vocab_tokens=16384).splitlines()
    assert "| peak resident MiB after 16,384 prompt tokens across the vocabulary |" in lines[0]
    assert lines[2] == "| a.gguf | 800 | 1,024 | 9.1 | 4.0 | 2,000 | 2,300 | - | +476 | no |"
    assert lines[3] == "| b.gguf | 800 | 1,024 | 3.0 | - | 2,200 | 2,224 | 2,230 | +406 | no |"


def test_actblocks_kernel_takes_one_activation_scale_per_256_for_the_k_quants(tiny_gguf, monkeypatch, capsys):
    """`python -m kvserve.loadtest actblocks`: per file, the K-quant projections' inputs in float, per 32, per
    256 and through the kernel; the kernel's distributions are those of per 256 (up to float order), not per 32's,
    and its layers are left as found."""
    from kvserve.loadtest.__main__ import main as loadtest_main
    from kvserve.loadtest.engine import actblocks
    from kvserve.quant.ggml import GGMLKind, GGMLLinear

    path = tiny_gguf("tiny-llama", "Q4_K_M")
    seen = []  # (model, rows) of each file measured
    measure = actblocks.measure
    monkeypatch.setattr(actblocks, "measure", lambda *a, **k: seen.append((a[0], measure(*a, **k))) or seen[-1][1])
    assert loadtest_main(["actblocks", "--model", str(path), "--tokens", "64"]) == 0
    (model, rows), = seen
    assert [r.variant for r in rows] == [v[0] for v in actblocks.VARIANTS]
    by = {r.variant: r for r in rows}
    assert by["float inputs (the reference)"].kl == 0.0 and by["float inputs (the reference)"].top1 == 1.0
    assert by["per 32"].kl > 0 and by["per 256"].kl > 0
    # the kernel sits on per 256's distributions: far nearer to them than per 32 is
    assert abs(by["the kernel"].kl - by["per 256"].kl) < 0.1 * abs(by["per 256"].kl - by["per 32"].kl)
    layers = [m for m in model.modules() if isinstance(m, GGMLLinear) and m.kind in actblocks.K_QUANTS]
    assert {m.kind for m in layers} == {GGMLKind.Q4_K, GGMLKind.Q6_K}  # a Q4_K_M file's mixture
    assert all(m.use_kernel and m.act_block == 256 for m in layers)
    assert capsys.readouterr().out.count(f"| {path.name} |") == 4
