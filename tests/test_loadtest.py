"""Smoke tests of the load generator, the simulator, compare and peers' report, against a fake SSE server.

No timing asserts: every figure checked here is a count or follows from the step model.
"""

from __future__ import annotations

import argparse

import json
import statistics
import sys

import pytest

from kvserve.loadtest.__main__ import main as loadtest_main
from kvserve.loadtest.loadgen import report, workloads
from kvserve.loadtest.loadgen.fakeserver import FakeEngine, serve_in_thread
from kvserve.loadtest.loadgen.generator import LoadConfig, Mode, run_sync
from kvserve.loadtest.served import agree, compare, peers, prefillpeers
from kvserve.loadtest.sim import simulate


@pytest.fixture(scope="module")
def fake_url():
    with serve_in_thread(FakeEngine(max_num_seqs=4, step_s=0.001)) as url:
        yield url


def test_seed64_workload_is_pinned_to_its_lengths():
    specs = workloads.seed64()
    lengths = [s.max_tokens for s in specs]
    assert len(specs) == 64 and sum(lengths) == 1874 and max(lengths) == 231 and statistics.median(lengths) == 18
    body = specs[0].body("m")
    assert body["ignore_eos"] is True and body["min_tokens"] == body["max_tokens"] == lengths[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_chat_workload_shares_one_system_prompt():
    specs = workloads.chat(count=5)
    systems = {spec.body("m")["messages"][0]["content"] for spec in specs}
    assert systems == {workloads.SYSTEM_PROMPT}
    assert all(spec.endpoint is workloads.Endpoint.CHAT for spec in specs)


def test_closed_loop_records_every_token(fake_url):
    specs = workloads.seed64()[:10]
    run = run_sync(specs, LoadConfig(url=fake_url, concurrency=10, model="fake", progress=False))
    assert [r.index for r in run.records] == list(range(10))
    for spec, record in zip(specs, run.records):
        assert record.ok and record.output_tokens == spec.max_tokens
        assert record.ttft_s is not None and len(record.itl_s) == spec.max_tokens - 1
        assert record.server_ttft_ms is not None  # the kvserve-style timings field was read
    summary = report.summarize(run)
    assert summary.ok == 10 and summary.output_tokens == sum(s.max_tokens for s in specs)


def test_open_loop_chat_is_bounded_by_count(fake_url):
    specs = workloads.chat(count=3, max_tokens=20)
    run = run_sync(specs, LoadConfig(url=fake_url, mode=Mode.OPEN, rate=50.0, count=7, model="fake",
                                     progress=False))
    assert len(run.records) == 7 and all(r.ok for r in run.records)
    starts = [r.start_s for r in run.records]
    assert starts == sorted(starts)
    assert [r.output_tokens for r in run.records] == [specs[i % 3].max_tokens for i in range(7)]


def test_429s_are_counted_apart_from_errors():
    with serve_in_thread(FakeEngine(max_num_seqs=1, max_queue=0)) as url:
        run = run_sync(workloads.fixed(3, 4), LoadConfig(url=url, concurrency=3, model="fake", progress=False))
    summary = report.summarize(run)
    assert (summary.ok, summary.rejected_429, summary.errors) == (0, 3, 0)


def test_run_command_writes_json_and_plots(fake_url, tmp_path):
    code = loadtest_main(["run", "--url", fake_url, "--workload", "fixed", "--count", "4", "--max-tokens", "3",
                          "--concurrency", "1,2", "--label", "smoke", "--out", str(tmp_path), "--no-progress"])
    assert code == 0
    doc = json.loads((tmp_path / "smoke.json").read_text())
    assert [run["summary"]["output_tokens"] for run in doc["runs"]] == [12, 12]
    assert (tmp_path / "smoke-latency.png").stat().st_size > 0
    assert (tmp_path / "smoke-throughput.png").stat().st_size > 0


def test_run_against_a_dead_server_says_why(tmp_path, capsys):
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    code = loadtest_main(["run", "--url", url, "--workload", "fixed", "--count", "2", "--max-tokens", "2",
                          "--concurrency", "1", "--out", str(tmp_path), "--no-progress", "--model", "m"])
    assert code == 1
    assert "failed: 2 x ConnectError" in capsys.readouterr().out


def test_simulator_by_hand_on_four_requests():
    # lengths 1,3,2,2 and 2 slots. static: [1,3] for 3 steps, then [2,2] for 2; a group's responses end
    # together. continuous: request 2 takes request 0's slot at step 2, both end at step 3, request 3
    # runs steps 4-5.
    static = simulate.simulate([1, 3, 2, 2], 2, True, simulate.flat_cost)
    continuous = simulate.simulate([1, 3, 2, 2], 2, False, simulate.flat_cost)
    assert static.e2e_s == (3, 3, 5, 5) and static.steps == 5 and static.ttft_mean_s == statistics.fmean([1, 1, 4, 4])
    assert continuous.e2e_s == (1, 3, 3, 5) and continuous.steps == 5


def test_simulator_flat_cost_matches_the_ideal_for_seed64():
    lengths = workloads.seed64_lengths()
    static, continuous = simulate.run_both(lengths, 8, simulate.flat_cost)
    group_ends = []
    clock = 0
    for first in range(0, 64, 8):
        clock += max(lengths[first:first + 8])
        group_ends += [clock] * 8
    assert static.steps == clock == 685
    assert static.e2e_mean_s == statistics.fmean(group_ends) == 405.5
    ratios = simulate.ratios(static, continuous)
    assert ratios["throughput"] == pytest.approx(685 / continuous.steps)
    assert ratios["throughput"] == pytest.approx(2.4, abs=0.05)
    assert ratios["mean_e2e"] == pytest.approx(3.5, abs=0.1)


def test_fit_cost_recovers_a_linear_step_cost():
    costs = {(p, d): 0.01 + 0.002 * p + 0.0005 * d for p in range(4) for d in range(4 - p) if p + d}
    assert simulate.fit_cost(costs) == pytest.approx((0.01, 0.002, 0.0005))


def test_compare_prices_steps_at_the_mean_of_costs_measured_before_and_after():
    from kvserve.loadtest.served.compare import step_cost
    before = {(0, 1): 0.020, (1, 0): 0.050, (1, 1): 0.060}
    after = {(0, 1): 0.030, (1, 0): 0.060, (1, 1): 0.066}  # the machine slowed down during the runs
    cost, how, costs_ms = step_cost(before, after, 18, 3)
    assert cost(0, 1) == pytest.approx(0.025) and cost(1, 1) == pytest.approx(0.063)
    assert costs_ms == pytest.approx({"0,1": 25.0, "1,0": 55.0, "1,1": 63.0})
    assert "after / before: 1.20" in how  # median of 1.5, 1.2 and 1.1
    assert step_cost(None, None, 0, 3)[0] is simulate.flat_cost


def test_compare_against_fake_servers(tmp_path):
    bench = tmp_path / "BENCHMARKS.md"
    args = [sys.executable, "-m", "kvserve.loadtest.loadgen.fakeserver", "--port", "{port}", "--step-ms", "2"]
    code = loadtest_main(["compare", "--flat-sim", "--server-cmd", " ".join(args), "--benchmarks", str(bench),
                          "--out", str(tmp_path), "--no-progress"])
    assert code in (0, 2)  # 2: the fake's per-step overhead may put it outside 15% of the flat ideal
    doc = json.loads((tmp_path / "compare.json").read_text())
    assert [run["summary"]["output_tokens"] for run in doc["runs"]] == [1874, 1874]
    assert [run["summary"]["ok"] for run in doc["runs"]] == [64, 64]
    text = bench.read_text()
    from kvserve.loadtest.publish.benchmarks_md import kernel_class
    assert f"<!-- BEGIN compare{kernel_class()[0]} -->" in text and "| static |" in text and "| continuous |" in text


def test_a_generic_cpu_name_gets_its_family_and_model():
    """A VM's "AMD EPYC" covers Zen 4 (AVX-512 on 256-bit units) and Zen 5 (512-bit units): the machine line
    names the family and model there, and leaves a name with a model number as it is."""
    from kvserve.loadtest.publish.benchmarks_md import _cpu

    info = "processor\t: 0\ncpu family\t: {family}\nmodel\t\t: {model}\nmodel name\t: {name}\nflags\t\t: fpu avx2 avx512f\n"
    assert _cpu(info.format(family=26, model=2, name="AMD EPYC")) == ("AMD EPYC family 26 model 2",
                                                                      {"fpu", "avx2", "avx512f"})
    assert _cpu(info.format(family=25, model=17, name="AMD EPYC"))[0] == "AMD EPYC family 25 model 17"
    assert _cpu(info.format(family=6, model=143, name="Intel(R) Xeon(R) Platinum 8480+"))[0] == \
        "Intel(R) Xeon(R) Platinum 8480+"


def test_a_cpu_section_is_one_per_kernel_path(tmp_path, monkeypatch):
    """An AVX2-only machine, or one with AMX tiles, writes its own section beside the AVX-512 machine's (the
    reference) instead of replacing it; a forced lesser path is that path's section, its command naming the
    variable; a GPU's section is one whatever its host CPU."""
    from kvserve.loadtest.publish import benchmarks_md
    from kvserve.loadtest.publish.benchmarks_md import kernel_class, update_section

    monkeypatch.delenv("KVSERVE_ISA", raising=False)
    monkeypatch.delenv("KVSERVE_AMX", raising=False)
    avx2, avx512 = {"avx2", "fma", "f16c"}, {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    assert kernel_class(avx512) == ("", "", "")
    assert kernel_class(avx2)[0] == "-avx2" and kernel_class(set())[0] == "-scalar"
    assert kernel_class(avx512 | {"amx_int8"})[0] == "-amx"
    monkeypatch.setenv("KVSERVE_AMX", "0")
    assert kernel_class(avx512 | {"amx_int8"})[2] == "KVSERVE_AMX=0 "
    monkeypatch.setenv("KVSERVE_ISA", "avx2")
    assert kernel_class(avx512)[::2] == ("-avx2", "KVSERVE_ISA=avx2 ")
    bench = tmp_path / "BENCHMARKS.md"
    for flags in (avx512, avx2):
        monkeypatch.setattr(benchmarks_md, "_cpu", lambda flags=flags: ("a CPU", flags))
        monkeypatch.delenv("KVSERVE_ISA")
        update_section("bench", "A bench", "python -m kvserve.loadtest bench", f"figures on {len(flags)} flags", bench)
        monkeypatch.setenv("KVSERVE_ISA", "scalar")
        update_section("bench", "A bench", "python -m kvserve.loadtest bench", "scalar figures", bench)
        update_section("gpu", "On a GPU", "python -m kvserve.loadtest gpu", "gpu figures", bench, per_kernel_path=False)
    text = bench.read_text()
    assert [line for line in text.splitlines() if line.startswith("<!-- BEGIN")] == [
        "<!-- BEGIN bench -->", "<!-- BEGIN bench-scalar -->", "<!-- BEGIN gpu -->", "<!-- BEGIN bench-avx2 -->"]
    assert "figures on 7 flags" in text and "figures on 3 flags" in text and text.count("scalar figures") == 1
    assert "## A bench — AVX2 path (no AVX-512)" in text and "`KVSERVE_ISA=scalar python -m kvserve.loadtest bench`" in text


def test_compare_gives_each_weight_scheme_its_flags_and_section():
    args = argparse.Namespace(model=None, device="auto", dtype="auto", quantization="int4")
    assert compare.engine_flags(args) == ["--quantization", "int4"]
    args.quantization = "auto"  # the default: the servers pick their weights as `kvserve serve` does
    assert compare.engine_flags(args) == ["--quantization", "auto"]
    assert compare.section_and_title("cpu", "int4") == ("compare-int4",
                                                        "Static vs continuous batching (seed64, 8 slots, int4 weights)")
    assert compare.section_and_title("cpu", "auto") == ("compare", "Static vs continuous batching (seed64, 8 slots)")
    assert compare.section_and_title("cpu", "none")[0] == "compare-none"
    assert compare.section_and_title("cuda", "auto")[0] == "compare-cuda"
    assert compare.section_and_title("cuda", "auto")[1].endswith("on cuda")


def test_the_engine_benchmarks_load_the_weights_the_server_serves():
    """profile and the simulator default to auto: for the embedded model the GGUF's own blocks, as served."""
    from kvserve.loadtest.engine.enginebench import load_served
    from kvserve.quant.ggml import GGMLLinear

    loaded, served = load_served("auto")
    assert served == "gguf"
    assert isinstance(loaded.model.model.layers[0].self_attn.o_proj, GGMLLinear)
    assert isinstance(loaded.model.get_output_embeddings(), GGMLLinear)


def test_agreement_is_relative_error():
    errors = compare.agreement({"throughput": 2.2, "mean_e2e": 3.3}, {"throughput": 2.0, "mean_e2e": 3.0})
    assert errors == pytest.approx({"throughput": 0.1, "mean_e2e": 0.1})


def test_peers_report_shows_ratios_to_llamacpp_and_failures():
    results = {
        "llama.cpp": {"system": "llama.cpp", "single_decode_tps": 100.0, "ttft_512_s": 0.5,
                      "aggregate_tps": {"1": 100.0, "8": 200.0, "32": 250.0}, "seed64_tps": 120.0, "error": None},
        "kvserve-none": {"system": "kvserve-none", "single_decode_tps": 50.0, "ttft_512_s": 1.0,
                         "aggregate_tps": {"1": 50.0, "8": 300.0, "32": 500.0}, "seed64_tps": 180.0, "error": None},
        "kvserve-nf4": {"system": "kvserve-nf4", "error": "ServerStartError: exited with 1"},
    }
    text = peers.render(results)
    row = next(line for line in text.splitlines() if line.startswith("| kvserve-none"))
    assert "50.0 (0.50x)" in row and "1.00 s (0.50x)" in row and "500.0 (2.00x)" in row and "180.0 (1.50x)" in row
    assert "| kvserve-nf4 | failed: ServerStartError" in text


def test_peers_median_skips_failed_repeats():
    good = peers.PeerFigures("kvserve-int8", 10.0, 1.0, {"1": 10.0}, 20.0)
    better = peers.PeerFigures("kvserve-int8", 30.0, 3.0, {"1": 30.0}, 40.0)
    failed = peers.PeerFigures("kvserve-int8", error="RuntimeError: boom")
    merged = peers._median([good, failed, better])
    assert merged["single_decode_tps"] == 20.0 and merged["aggregate_tps"] == {"1": 20.0}
    assert merged["error"] is None



def test_prefill_peers_median_skips_failed_repeats_and_keeps_the_fewest_shorts():
    one = prefillpeers.PrefillFigures("vllm", {"512": 1.0}, short_during_p99_s=2.0, short_during_count=4)
    two = prefillpeers.PrefillFigures("vllm", {"512": 3.0}, short_during_p99_s=None, short_during_count=2)
    failed = prefillpeers.PrefillFigures("vllm", error="RuntimeError: boom")
    merged = prefillpeers.median([one, failed, two])
    assert merged["ttft_s"] == {"512": 2.0} and merged["short_during_p99_s"] == 2.0
    assert merged["short_during_count"] == 2 and merged["error"] is None
    assert prefillpeers.median([failed])["error"] == "RuntimeError: boom"


def test_agree_reads_both_logprob_formats_and_measures_the_parting():
    ours = agree.parse_reply({"text": " Paris is", "logprobs": {
        "tokens": [" Paris", " is"], "top_logprobs": [{" Paris": -0.2, " the": -2.0}, {" is": -0.5, ",": -0.7}]}})
    theirs = agree.parse_reply({"text": " Paris,", "logprobs": {"content": [
        {"token": " Paris", "top_logprobs": [{"token": " Paris", "logprob": -0.1}]},
        {"token": ",", "top_logprobs": [{"token": ",", "logprob": -0.4}, {"token": " is", "logprob": -0.6}]}]}})
    assert theirs.tokens == [" Paris", ","] and theirs.top[1] == {",": -0.4, " is": -0.6}
    index, gap_ours, gap_theirs = agree.parting(ours, theirs)
    assert index == 1 and gap_ours == pytest.approx(0.2) and gap_theirs == pytest.approx(0.2)
    assert agree.near_tie((index, gap_ours, gap_theirs))
    assert not agree.near_tie((1, 0.2, None))  # the other's token outside one server's top logprobs
    assert not agree.near_tie((1, 0.2, 0.9)) and agree.parting(ours, ours) is None


def test_agree_table_names_each_file_and_its_widest_gap():
    text = agree.render([agree.Agreement("a.gguf", 6, 5, 1, 0.071), agree.Agreement("b.gguf", 6, 3, 2, None)], 32)
    assert "| a.gguf | 5 of 6 | 1 of 1 | 0.071 |" in text and "| b.gguf | 3 of 6 | 2 of 3 | outside a top 5 |" in text


def test_requant_refuses_an_unknown_mixture_before_building_anything(tmp_path):
    from kvserve.loadtest.errors import UsageError
    from kvserve.loadtest.fixtures import requant

    with pytest.raises(UsageError, match="Q4_K_X"):
        requant.requantize(tmp_path / "in.gguf", tmp_path / "out.gguf", "Q4_K_X")

def test_simulated_queue_order_decides_the_tail():
    lengths = [10, 1, 1, 1]
    first = simulate.simulate(lengths, 2, False, simulate.flat_cost)
    last = simulate.simulate(lengths, 2, False, simulate.flat_cost, order=[1, 2, 3, 0])
    assert (first.steps, last.steps) == (10, 11)  # the long request admitted last runs on alone
    with pytest.raises(ValueError):
        simulate.simulate(lengths, 2, False, simulate.flat_cost, order=[0, 0, 1, 2])


def test_admission_order_follows_server_queue_time():
    from kvserve.loadtest.loadgen.client import RequestRecord
    from kvserve.loadtest.loadgen.generator import RunResult
    records = [RequestRecord(index=0, start_s=0.00, ttft_s=5.0, server_queue_ms=3000.0),
               RequestRecord(index=1, start_s=0.01, ttft_s=1.0, server_queue_ms=10.0),
               RequestRecord(index=2, start_s=0.02, ttft_s=2.0)]  # no server timings: first token
    assert compare.admission_order(RunResult("x", {}, 1.0, records)) == [1, 2, 0]


def test_grid_cost_uses_the_measured_points():
    cost = simulate.grid_cost({(0, 1): 0.05, (1, 0): 0.2})
    assert (cost(0, 1), cost(1, 0)) == (0.05, 0.2)


@pytest.mark.parametrize("argv", [["profile", "--model", "{tmp}", "--no-write"],
                                  ["compare", "--model", "{tmp}", "--no-write"]])
def test_engine_commands_refuse_a_missing_model_in_one_line(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        loadtest_main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "not a Hugging Face model directory" in err and "Traceback" not in err


def test_engine_commands_refuse_cuda_without_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit) as exit_info:
        loadtest_main(["profile", "--device", "cuda", "--no-write"])
    assert exit_info.value.code == 2 and "no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["run", "--concurrency", "0"], ["run", "--concurrency", "abc"],
                                  ["run", "--mode", "open", "--rate", "0"], ["run", "--rate", "-1"],
                                  ["run", "--count", "0"], ["run", "--duration", "0"], ["run", "--timeout", "nan"],
                                  ["profile", "--batch", "abc"], ["profile", "--batch", "0"],
                                  ["profile", "--steps", "0"], ["compare", "--slots", "0"], ["simulate", "--reps", "0"]])
def test_bad_numbers_are_usage_errors(argv):
    with pytest.raises(SystemExit) as exit_info:
        loadtest_main(argv)
    assert exit_info.value.code == 2


def test_randmodel_refuses_bad_arguments_before_any_work(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for argv in (["--from", str(tmp_path / "missing"), str(tmp_path / "out")],
                 ["--from", str(tmp_path), "--shape-only", str(tmp_path / "out")],
                 ["--shape-of", "smollm2", "--shape-only", str(a_file)],
                 ["--shape-of", str(tmp_path / "missing"), "--shape-only", str(tmp_path / "out")]):
        with pytest.raises(SystemExit) as exit_info:
            loadtest_main(["randmodel", *argv])
        assert exit_info.value.code == 2, argv
    assert not (tmp_path / "out").exists()


def test_a_terminated_compare_stops_its_servers(tmp_path):
    import subprocess
    import time
    from pathlib import Path

    fake = f"{sys.executable} -m kvserve.loadtest.loadgen.fakeserver --port {{port}} --step-ms 50 --max-queue 25673"
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.loadtest", "compare", "--flat-sim", "--server-cmd", fake,
                             "--no-write", "--no-progress", "--out", str(tmp_path)], cwd=root,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def servers() -> str:
        # the servers' command lines, not compare's own (which holds "{port}", not a number)
        return subprocess.run(["pgrep", "-f", "fakeserver --port [0-9]+ .*25673"], capture_output=True,
                              text=True).stdout.strip()

    deadline = time.monotonic() + 60
    while not servers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert servers(), "the fake server never started"
    time.sleep(1.0)  # into the run
    proc.terminate()
    assert proc.wait(timeout=30) == 128 + 15
    deadline = time.monotonic() + 20
    while servers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not servers()


def test_thread_cpu_splits_the_main_thread_from_the_others():
    import os
    import threading
    import time

    from kvserve.loadtest.served.overhead import thread_cpu_s

    def spin(seconds=0.3):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    spun, done = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (spin(), spun.set(), done.wait()))
    before = thread_cpu_s(os.getpid())
    worker.start()
    spun.wait()  # the main thread sleeps while the worker spins
    mid = thread_cpu_s(os.getpid())  # the worker is alive, so /proc still lists it
    done.set()
    worker.join()
    spin()
    after = thread_cpu_s(os.getpid())
    assert mid["other"] - before["other"] >= 0.25 and mid["main"] - before["main"] < 0.15
    assert after["main"] - mid["main"] >= 0.25


def test_overhead_measures_a_served_run(server_url):
    import os

    from kvserve.loadtest.served.overhead import measure, render

    row = measure(server_url, os.getpid(), streams=2, tokens=8)  # the server runs in this process here
    assert row.streams == 2 and row.tokens_per_s > 0 and row.itl_ms > 0
    assert 1.0 < row.tokens_per_step <= 2.0  # 2 at a time: a step makes at most 2 tokens
    assert row.runner_ms_per_step > 0 and row.between_ms_per_step >= 0
    assert min(row.cpu_event_loop, row.cpu_engine, row.cpu_client) >= 0 and row.cpu_client > 0
    assert "| 2 |" in render([row], "none", 8)


def test_prefixbench_takes_server_flags_as_one_quoted_string():
    from kvserve.loadtest.served.prefixbench import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--extra", "--dtype float32 --quantization int8"]).extra == [
        "--dtype", "float32", "--quantization", "int8"]
    assert parser.parse_args(["--extra=--dtype float32"]).extra == ["--dtype", "float32"]
    assert parser.parse_args([]).extra == []


def test_llama_server_is_found_only_in_the_build_for_this_cpu(tmp_path, monkeypatch):
    """A native build from another CPU (a /tmp that outlived a move) is not this CPU's: it can die on an invalid
    opcode, so peers must build again rather than run it."""
    from kvserve.loadtest.peer_systems import llamacpp

    tree = tmp_path / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    other = tree / "build-0123456789ab-noamx" / "bin" / "llama-server"
    other.parent.mkdir(parents=True)
    other.touch()
    monkeypatch.setattr(llamacpp, "cpu_key", lambda: "fedcba987654")
    assert llamacpp.find_server(tmp_path) is None
    mine = tree / "build-fedcba987654-noamx" / "bin" / "llama-server"
    mine.parent.mkdir(parents=True)
    mine.touch()
    assert llamacpp.find_server(tmp_path) == mine


def test_the_cpu_key_is_stable_and_short():
    from kvserve.loadtest.peer_systems.llamacpp import cpu_key

    assert cpu_key() == cpu_key() and len(cpu_key()) == 12 and int(cpu_key(), 16) >= 0


def test_the_fairness_tables_give_each_groups_ttft_percentiles():
    import argparse

    from kvserve.loadtest.served.fairness import Ttfts, add_arguments, render

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--flood", "4", "--lone", "2"])
    assert Ttfts([0.3, 0.1, 0.2, 0.4]).percentile(0.5) == 0.2 and Ttfts().cell() == "nan / nan"
    tenants = {"fcfs": (Ttfts([1.0, 2.0]), Ttfts([3.0, 5.0])), "fair": (Ttfts([1.5, 2.5]), Ttfts([0.5, 0.5], 1))}
    priority = {"fcfs": (Ttfts([1.0]), Ttfts([4.0])), "priority": (Ttfts([2.0]), Ttfts([0.25]))}
    text = render(tenants, priority, args)
    assert "| fcfs | 1.00 / 2.00 | 3.00 / 5.00 |" in text and "| fair | 1.50 / 2.50 | 0.50 / 0.50 (1 failed) |" in text
    assert "| priority | 2.00 / 2.00 | 0.25 / 0.25 |" in text
    assert "fair share against FCFS: 8.0x shorter" in text and "priority against FCFS: 16.0x shorter" in text
    tenants["fair"] = (Ttfts([1.0]), Ttfts([8.0]))  # a run where fair share lost says so, not "0.5x shorter"
    assert "fair share against FCFS: 2.0x longer" in render(tenants, priority, args)


def test_prefill_peers_count_the_short_requests_sent_during_the_long_prefill():
    from kvserve.loadtest.loadgen.client import RequestRecord

    long = RequestRecord(0, start_s=1.0, status=200, ttft_s=10.0)  # prefilled from 1 s to 11 s
    shorts = [RequestRecord(1, start_s=0.5, status=200, ttft_s=0.2),   # before the long one was sent
              RequestRecord(2, start_s=2.0, status=200, ttft_s=0.3),   # inside
              RequestRecord(3, start_s=5.0, status=200, ttft_s=7.5),   # inside, answered after the long one
              RequestRecord(4, start_s=11.5, status=200, ttft_s=0.9)]  # sent after the long one's first token
    assert prefillpeers.delayed(shorts, long) == [0.3, 7.5]


def test_prefill_peers_read_the_steps_that_ended_during_the_long_prefill():
    log = "\n".join(f'{{"prefills": 1, "decodes": 0, "seconds": {s}, "end_s": {e}}}'
                     for s, e in [(0.5, 9.0), (0.25, 10.5), (2.0, 12.0), (0.75, 13.0)])
    assert prefillpeers.step_seconds(log + "\n", 10.0, 12.0) == [0.25, 2.0]
    figures = prefillpeers.as_dict(prefillpeers.PrefillFigures("kvserve-gguf", {"16": 1.0}, step_p50_s=0.25,
                                                               step_max_s=2.0, steps=2))
    assert "| 0.250 / 2.000 s (2) |" in prefillpeers.render({"kvserve-gguf": figures}, [16], "x")


def test_prefill_peers_measure_a_server_and_render_ratios_to_kvserve(fake_url):
    figures = prefillpeers.measure_server("kvserve-gguf", fake_url, [16, 64])
    assert set(figures.ttft_s) == {"16", "64"} and all(v > 0 for v in figures.ttft_s.values())
    assert figures.short_alone_p50_s > 0 and figures.short_alone_p99_s >= figures.short_alone_p50_s
    assert figures.long_ttft_s > 0 and figures.error is None
    base = prefillpeers.as_dict(figures) | {"ttft_s": {"16": 0.5, "64": 1.0}}
    slow = base | {"system": "llama.cpp", "ttft_s": {"16": 1.0, "64": 4.0}, "short_during_p50_s": None}
    text = prefillpeers.render({"kvserve-gguf": base, "llama.cpp": slow,
                                "vllm": {"system": "vllm", "error": "FileNotFoundError: not installed"}}, [16, 64], "x")
    row = next(line for line in text.splitlines() if line.startswith("| llama.cpp"))
    assert "1.00 s (2.00x)" in row and "4.00 s (4.00x)" in row and "none sent" in row
    assert "| vllm | failed: FileNotFoundError" in text


def test_model_paths_are_made_absolute_before_servers_start_elsewhere(tmp_path, monkeypatch):
    from kvserve.loadtest.argtypes import absolute_path

    monkeypatch.chdir(tmp_path)
    assert absolute_path("m.gguf") == tmp_path / "m.gguf"  # the launched servers run from the repository root


def test_engine_benches_accept_a_gguf_file_and_refuse_a_directory_without_weights(tiny_gguf, tmp_path):
    from kvserve.loadtest.engine.enginebench import check_engine_flags
    from kvserve.loadtest.errors import UsageError

    check_engine_flags(str(tiny_gguf("tiny-llama")), "cpu")  # its derived directory has no weights: the file has them
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UsageError, match="no weights"):
        check_engine_flags(str(tmp_path), "cpu")


def test_overhead_splits_a_single_streams_token_against_the_read_bound(monkeypatch):
    from dataclasses import replace

    import torch

    from kvserve.loadtest.engine import ggmlbench
    from kvserve.loadtest.served.overhead import Overhead, split_text

    monkeypatch.setattr(ggmlbench, "served_split", lambda model: (20.0, 16.0, 50.0, 800_000_000))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    one = Overhead(1, 40.0, 25.0, 24.0, 0.5, 0.1, 1.0, 0.8, 44.0, 0.5)
    lines = split_text([one, replace(one, streams=8)], "m.gguf").splitlines()
    assert lines[2] == "| ms | 25.00 | 24.00 | 22.00 | 20.00 | 16.00 |"
    assert lines[3] == "| % of the read bound | 64% | 67% | 73% | 80% | 100% |"
    assert "800 MB" in lines[5] and "50.0 GB/s" in lines[5]
    assert split_text([replace(one, streams=8)], "m.gguf") == ""


@pytest.mark.skipif(sys.platform != "linux", reason="reads Linux's /proc/self/smaps")
def test_the_small_pages_copy_holds_the_same_bytes_advised_against_huge_pages(tmp_path):
    """kernelbench --ggml-model's "4 KiB pages" rows: the copy is the weight's bytes in a mapping advised against
    huge pages ("nh" in its VmFlags); the count of huge-page bytes sums AnonHugePages of the mappings that hold the
    tensors, and only theirs."""
    import torch

    from kvserve.loadtest.engine.ggmlbench import huge_page_bytes, mappings, on_small_pages

    weights = torch.randint(0, 256, (6, 1 << 20), dtype=torch.uint8)
    copy = on_small_pages(weights)
    assert torch.equal(copy, weights) and copy.data_ptr() != weights.data_ptr()
    [flags] = [fields["VmFlags"].split() for start, end, fields in mappings() if start <= copy.data_ptr() < end]
    assert "nh" in flags
    a, b = copy.data_ptr(), copy.data_ptr() + copy.nbytes
    smaps = tmp_path / "smaps"
    smaps.write_text(f"{a - 8192:x}-{a:x} rw-p 00000000 00:00 0\nAnonHugePages:    2048 kB\n"  # not the copy's
                     f"{a:x}-{a + (4 << 20):x} rw-p 00000000 00:00 0\nRss: 4096 kB\nAnonHugePages:    4096 kB\n"
                     f"{a + (4 << 20):x}-{b:x} rw-p 00000000 00:00 0\nAnonHugePages:       0 kB\n")
    assert huge_page_bytes([copy], str(smaps)) == 4 << 20


def test_attention_bench_times_a_prompts_last_chunk_and_counts_its_pairs(monkeypatch, capsys):
    """kernelbench --attention: the call is a prompt's last 512-row chunk (row i of a T-token prompt attends to
    T - 512 + i + 1 keys through one block table), its multiply-adds are 2 H d per (query, key) pair, and a
    small run prints one row per shape and cache dtype with a time for every prompt length."""
    import torch

    from kvserve import native
    from kvserve.loadtest.engine import attnbench

    q, rows, tables, lens, k_blocks, v_blocks, scale, window, out = attnbench.chunk_call(4, 2, 16, 600, torch.float32)
    assert q.shape == out.shape == (512, 4, 16) and rows.tolist() == list(range(512))
    assert lens[0] == 89 and lens[-1] == 600 and tables.shape == (512, 38) and k_blocks.shape == (38, 16, 2, 16)
    assert attnbench.macs(4, 16, lens) == 2 * 4 * 16 * sum(range(89, 601))
    assert attnbench.chunk_call(4, 2, 16, 100, torch.bfloat16)[4].dtype == torch.bfloat16
    if native.load_ops() is None:
        pytest.skip("no kernel build: nothing to time")
    monkeypatch.setattr(attnbench, "SHAPES", (("tiny", 4, 2, 16),))
    monkeypatch.setattr(attnbench, "CONTEXTS", (40, 80))
    lines = attnbench.measure(write=False, decode=False)
    # float32, bfloat16 and int8 caches (int4 needs d a multiple of 32: no row)
    assert len(lines) == 5 and lines[2].startswith("| tiny (4 / 2 heads, d = 16) | float32 |")
    assert lines[4].startswith("| tiny (4 / 2 heads, d = 16) | int8 |")
    assert all(line.count(" ms, ") == 2 for line in lines[2:])
    printed = capsys.readouterr().out
    assert "attention tiny bfloat16 T=80:" in printed and "attention tiny int8 T=80:" in printed


def test_attention_bench_compares_the_served_pool_with_one_pool_per_kv_head(monkeypatch):
    """kernelbench --attention's decode part: the same decode rows from the pool as served and from one pool per KV
    head (a KV head's query heads, its own blocks); both give a time, and the per-head calls attend the same shape."""
    import torch

    from kvserve import native
    from kvserve.loadtest.engine import attnbench

    monkeypatch.setattr(attnbench, "DECODE_SEQUENCES", 3)
    monkeypatch.setattr(attnbench, "DECODE_CONTEXT", 48)
    monkeypatch.setattr(attnbench, "DECODE_LAYERS", 2)
    q, rows, tables, lens, k_blocks, *_ = attnbench.decode_call(8, 2, 16, torch.Generator().manual_seed(0))
    assert q.shape == (3, 8, 16) and tables.shape == (3, 3) and lens.tolist() == [48, 48, 48]
    assert sorted(tables.flatten().tolist()) == list(range(9)) and k_blocks.shape == (9, 16, 2, 16)
    ops = native.load_ops()
    if ops is None:
        pytest.skip("no kernel build: nothing to time")
    lines = attnbench.decode_layout(ops, heads=8, kv_heads=2, dim=16)
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| as served", "| one pool per KV head"]
    assert all(float(line.split(" | ")[1]) >= 0 and float(line.split(" | ")[2].rstrip(" |")) > 0 for line in lines[2:])
