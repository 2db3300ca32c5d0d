"""Every instruction-set path of the native kernels is tested on one machine: KVSERVE_ISA forces the lesser one.

native/csrc/cpu.h picks the best path the CPU supports; ``KVSERVE_ISA=scalar`` forces the portable loops and
``KVSERVE_ISA=avx2`` the AVX2 ones on an AVX-512 CPU.
The kernel test files then run again on that path, in a child process (the choice is read once per process).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve import native
from kvserve.native.leaves import host_cpu_flags as _cpu_flags

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str, **env: str | None) -> subprocess.CompletedProcess:
    """Run ``code`` in a child Python with ``env`` over this process's environment (None: unset the variable)."""
    child = {key: value for key, value in {**os.environ, **env}.items() if value is not None}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child, capture_output=True, text=True,
                          timeout=300)


needs_kernels = pytest.mark.skipif(native.load() is None, reason="the kernels do not build on this machine")


@needs_kernels
def test_the_best_path_this_cpu_supports_runs_by_default():
    """In a child process without KVSERVE_ISA: this one's choice was made at its first call, and a suite run
    under KVSERVE_ISA=avx2 (how the lesser paths are tested) must still check the default."""
    done = _python("from kvserve import native; print(native.isa()); print(native.load().vectorized())",
                   KVSERVE_ISA=None)
    assert done.returncode == 0, done.stderr
    best = _best_isa()
    assert done.stdout.split("\n")[:2] == [f"{best} (the best this CPU supports)", str(best != "scalar")]


def _best_isa() -> str:
    return native.native_isas()[-1]


@needs_kernels
def test_kvserve_isa_forces_the_scalar_path():
    done = _python("from kvserve import native; print(native.isa()); print(native.load().vectorized())", KVSERVE_ISA="scalar")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["scalar (forced by KVSERVE_ISA)", "False"]


@needs_kernels
@pytest.mark.skipif(_best_isa() != "avx512", reason="this CPU has no AVX-512 VNNI path to step down from")
def test_kvserve_isa_forces_the_avx2_path_on_an_avx512_cpu():
    done = _python("from kvserve import native; print(native.isa()); print(native.load().vectorized())",
                   KVSERVE_ISA="avx2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["avx2 (forced by KVSERVE_ISA)", "True"]


@needs_kernels
@pytest.mark.skipif(_best_isa() == "avx512", reason="this CPU runs the AVX-512 path")
def test_kvserve_isa_asking_for_more_than_the_cpu_has_says_so():
    done = _python("from kvserve import native; print(native.isa())", KVSERVE_ISA="avx512")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == f"{_best_isa()} (KVSERVE_ISA=avx512 asks for more than this CPU has)"


def test_an_unknown_isa_is_refused_with_the_choices():
    done = _python("from kvserve import native; native.load()", KVSERVE_ISA="avx9000")
    assert done.returncode != 0
    assert "KVSERVE_ISA='avx9000': expected one of scalar, avx2, avx512" in done.stderr


@needs_kernels
@pytest.mark.parametrize("isa", ["scalar", "avx2"])
def test_quantized_cache_attention_has_the_same_bits_on_every_path(isa, tmp_path):
    """The int8 / int4 cache's write and attention (kv_quant.cpp: one body compiled for AVX-512, AVX2 and the
    baseline, with the same operations in the same order) give the same bits on the best path and on each forced
    lesser one (not merely close ones), on every shape of tests/test_decode_ops.QUANT_SHAPES. The scalar path is
    the reference: std::fma where the vector paths fuse."""
    from tests.test_decode_ops import QUANT_SHAPES, quantized_attention_case

    if isa not in native.native_isas() or os.environ.get("KVSERVE_ISA") == isa:
        pytest.skip(f"{isa} is not a lesser path here")
    code = ("import sys, torch; from tests.test_decode_ops import QUANT_SHAPES, quantized_attention_case; "
            "torch.save([quantized_attention_case(*shape) for shape in QUANT_SHAPES], sys.argv[1])")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / f"{isa}.pt")], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "KVSERVE_ISA": isa})
    assert done.returncode == 0, done.stderr[-2000:]
    forced = torch.load(tmp_path / f"{isa}.pt")
    for shape, theirs in zip(QUANT_SHAPES, forced, strict=True):
        ours = quantized_attention_case(*shape)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), shape


@needs_kernels
@pytest.mark.skipif(_best_isa() != "avx512" or os.environ.get("KVSERVE_ISA") in ("avx2", "scalar"),
                    reason="the AVX-512 path does not run here")
def test_float32_cache_attention_has_the_same_bits_on_the_avx2_and_avx512_paths(tmp_path):
    """The float32 cache's paged attention (csrc/attend_tile.h: the AVX-512 tile, with K transposed for prompt
    tiles, and the AVX2 tile, in one order of operations) gives the same bits on AVX-512 and on forced AVX2, for
    one prompt's rows attended together and for decode rows, on every shape of
    tests/test_decode_ops.PROMPT_TILE_SHAPES (the one with D = 72 runs AVX2 on both)."""
    from tests.test_decode_ops import PROMPT_TILE_SHAPES, prompt_tile_case

    code = ("import sys, torch; from tests.test_decode_ops import PROMPT_TILE_SHAPES, prompt_tile_case; "
            "torch.save([prompt_tile_case(*shape)[-1] for shape in PROMPT_TILE_SHAPES], sys.argv[1])")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "avx2.pt")], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "KVSERVE_ISA": "avx2"})
    assert done.returncode == 0, done.stderr[-2000:]
    forced = torch.load(tmp_path / "avx2.pt")
    for shape, theirs in zip(PROMPT_TILE_SHAPES, forced, strict=True):
        assert torch.equal(prompt_tile_case(*shape)[-1], theirs), shape


@needs_kernels
@pytest.mark.parametrize("isa", ["scalar", "avx2"])
def test_a_sampled_row_picks_the_same_token_on_every_path(isa, tmp_path):
    """sample_row (csrc/sample_row.cpp: exp8's weights on AVX2, exp1's same operations on the portable path, sums
    in float64 in one order) keeps the same tokens and draws the same one on each forced lesser path as on the best,
    over tests/test_sampling.sample_row_cases (vocabularies up to 128,256, every filter)."""
    from tests.test_sampling import sample_row_results

    if isa not in native.native_isas() or os.environ.get("KVSERVE_ISA") == isa or _best_isa() == isa:
        pytest.skip(f"{isa} is not a lesser path here")
    code = "import sys, torch; from tests.test_sampling import sample_row_results; torch.save(sample_row_results(), sys.argv[1])"
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / f"{isa}.pt")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "KVSERVE_ISA": isa})
    assert done.returncode == 0, done.stderr[-2000:]
    forced = torch.load(tmp_path / f"{isa}.pt")
    ours = sample_row_results()
    assert [token for token, _ in forced] == [token for token, _ in ours]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(forced, ours, strict=True))


@needs_kernels
@pytest.mark.skipif(os.environ.get("KVSERVE_ISA") == "scalar", reason="already on the scalar path")
def test_kernel_tests_pass_on_the_scalar_path():
    """The kernel test files (against the PyTorch reference, batch invariance, thread invariance) on the forced
    scalar path; the suite itself runs them on the best path. Left out: the whole-model answer and calibration
    tests that "quant" also selects (recipes' quality, not kernels: three quarters of this run's time on scalar)."""
    env = {**os.environ, "KVSERVE_ISA": "scalar"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_decode_ops.py",
                           "tests/test_quant.py", "-k", "(kernel or fused or norms or attention or greedy_pick or "
                           "log_softmax or silu or bits or quant) and not smollm2_answers and not "
                           "calibrated_on_the_models_own_replies"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    tail = done.stdout[-3000:]
    assert done.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail
