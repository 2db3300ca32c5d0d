"""GGUF block kernels (native/csrc/linear_ggml.cpp, ukernel*.h) for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and
Q6_K: against gguf's own dequantization, the same bits on every ISA path this CPU runs natively and in every batch,
exact pack/unpack, clear shape errors; the layers (quant/ggml.py) built by the GGUF type's name.

Paths other than the best are forced with KVSERVE_ISA in a child process (the choice is read once per process);
the AVX-512 micro-kernels are also run under the emulator (test_ggml_emulated.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvserve import native
from kvserve.native import ggml_leaves as leaves
from kvserve.quant.ggml import GGMLEmbedding, GGMLKind, GGMLLinear, dequantize_blocks
from kvserve.quant.schemes import quantize_activations
from kvserve.native.ggml_leaves import ACT_GROUP
from tests.ggmlutil import QTYPES, dequantize, magnitudes, quantized_blocks, random_blocks

ROOT = Path(__file__).resolve().parent.parent
KINDS = tuple(QTYPES)
# (N, K) per unit size: features below, at and past a 16-wide panel; K of 1, 2 and 18 blocks (SmolLM2's 576) or 1
# and 3 super-blocks, and 2048 (Llama-3.2-1B's width)
# (13, 512): two panels, the second partial (a tile of two panels storing 5 features of its second)
SHAPES = {32: [(3, 32), (16, 64), (40, 576), (24, 2048)],
          256: [(3, 256), (16, 768), (40, 2048), (24, 256), (13, 512)]}
# the batch-invariance shape: several groups of 8 blocks (and a remainder of 2 for the 32-weight formats)
BATCH_SHAPE = {32: (40, 576), 256: (40, 768)}

pytestmark = pytest.mark.skipif(native.load() is None, reason="the kernels do not build on this machine")


def weights_of(kind: str) -> int:
    return leaves.BLOCK_WEIGHTS[kind]


def activations(M: int, K: int, seed: int = 1) -> torch.Tensor:
    """float32 [M, K] with blocks of very different scales (and an all-zero block), as hidden states have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 2, K // 32).repeat_interleave(32)
    x[0, :32] = 0.0
    return x


def blocks(kind: str, N: int, K: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(random_blocks(kind, N, K, np.random.default_rng(seed)))


def assert_near_the_float64_product(y: torch.Tensor, x: torch.Tensor, raw: np.ndarray, kind: str, label) -> None:
    """y [M, N] against Q8(x) @ W^T in float64, W gguf's dequantization of raw, within float32 rounding of each
    block's terms."""
    x_hat = quantize_activations(x, ACT_GROUP[kind], 127).double().numpy()
    ref = x_hat @ dequantize(raw, kind).T
    bound = 1e-5 * (np.abs(x_hat) @ magnitudes(raw, kind).T) + 1e-30
    error = np.abs(y.double().numpy() - ref)
    assert (error <= bound).all(), (label, error.max())


@pytest.mark.parametrize("kind", KINDS)
def test_kernel_agrees_with_gguf_dequantization_in_float64(kind):
    module = native.load()
    rng = np.random.default_rng(0)
    for N, K in SHAPES[weights_of(kind)]:
        for raw in (quantized_blocks(kind, N, K, rng), random_blocks(kind, N, K, rng)):
            x = activations(7, K)
            y = module.ggml_linear(x, module.ggml_pack(torch.from_numpy(raw), kind), kind, N, K)  # [7, N]
            assert_near_the_float64_product(y, x, raw, kind, (N, K))


def test_the_embedded_models_own_blocks_round_trip_and_multiply_as_gguf_dequantizes_them():
    from gguf import GGUFReader

    from kvserve.engine.loader import default_gguf_path

    module = native.load()
    tensors = {t.name: t for t in GGUFReader(default_gguf_path()).tensors}
    for name, kind, rows in (("blk.0.ffn_down.weight", "q4_1", 576), ("token_embd.weight", "q8_0", 1000)):
        tensor = tensors[name]
        assert tensor.tensor_type is QTYPES[kind]
        raw = np.array(tensor.data[:rows])  # [rows, K/32 * bytes], the file's bytes
        N, K = rows, raw.shape[1] // leaves.BLOCK_BYTES[kind] * 32
        packed = module.ggml_pack(torch.from_numpy(raw), kind)
        assert np.array_equal(module.ggml_unpack(packed, kind, N, K).numpy(), raw)
        x = activations(4, K)
        assert_near_the_float64_product(module.ggml_linear(x, packed, kind, N, K), x, raw, kind, name)


@pytest.mark.parametrize("kind", KINDS)
def test_pack_unpack_round_trips_the_raw_bytes(kind):
    module = native.load()
    nr = leaves.NR.get(module.isa(), 8)
    for N, K in SHAPES[weights_of(kind)]:
        raw = blocks(kind, N, K, seed=N)
        packed = module.ggml_pack(raw, kind)
        assert torch.equal(module.ggml_unpack(packed, kind, N, K), raw)
        # each byte where the micro-kernels read it (leaves.pack_panels: ukernel_gguf.h's layout in numpy)
        assert np.array_equal(packed.numpy(), leaves.pack_panels(raw.numpy(), kind, nr))


def test_q5_fifth_bits_are_permuted_for_the_kernels_and_back():
    word = np.array([1 << k for k in range(32)], np.uint32)
    packed = leaves.qh_pack(word)
    assert sorted(packed.tolist()) == [1 << k for k in range(32)]  # a permutation of the bits
    assert packed[4 * 2 + 1] == 1 << (8 * 1 + 2)  # weight 4t + i (t = 2, i = 1): bit t of byte i
    assert packed[16 + 4 * 3 + 2] == 1 << (8 * 2 + 4 + 3)  # weight 16 + 4t + i: bit 4 + t of byte i


def test_bound_kernel_gives_the_bits_of_the_call():
    module = native.load()
    for kind, K in (("q4_1", 64), ("q4_k", 256)):
        packed = module.ggml_pack(blocks(kind, 40, K), kind)
        x = activations(5, K)
        assert torch.equal(module.bind_ggml(packed, kind, 40, K)(x), module.ggml_linear(x, packed, kind, 40, K))
        with pytest.raises(RuntimeError, match=f"x has 32 features, the weight {K}"):
            module.bind_ggml(packed, kind, 40, K)(torch.randn(2, 32))


def test_the_near_prefetch_changes_no_bits_and_its_setting_is_checked():
    """set_gguf_prefetch (the bytes a K-quant call of one or two rows prefetches ahead; on by default on Intel's
    and Zen 5's AVX-512 path) returns the previous value, refuses a distance outside 0..1 MiB, and the rows' bits
    are the same with it off, at 1 KB, and ahead past the call's panels (two rows: Q6_K's tile of two panels)."""
    module = native.load()
    before, threads = module.set_gguf_prefetch(0), torch.get_num_threads()
    torch.set_num_threads(1)  # every panel in one call: Q6_K's two rows then take tiles of two panels
    try:
        assert module.set_gguf_prefetch(0) == 0 and module.gguf_prefetch() == 0
        for kind in ("q4_k", "q5_k", "q6_k", "q4_1"):
            N, K = 40, 2048
            packed = module.ggml_pack(blocks(kind, N, K), kind)
            for rows in (1, 2):
                x = activations(rows, K)
                off = module.ggml_linear(x, packed, kind, N, K)
                assert torch.equal(off[-1:], module.ggml_linear(x[-1:], packed, kind, N, K))  # a row as alone
                for ahead in (1024, 1 << 20):
                    module.set_gguf_prefetch(ahead)
                    assert torch.equal(module.ggml_linear(x, packed, kind, N, K), off), (kind, rows, ahead)
                module.set_gguf_prefetch(0)
        with pytest.raises(RuntimeError, match="prefetch distance must be 0..1048576 bytes, got -1"):
            module.set_gguf_prefetch(-1)
        assert module.gguf_prefetch() == 0  # the refused value was not taken
    finally:
        module.set_gguf_prefetch(before)
        torch.set_num_threads(threads)


def test_unpacked_groups_change_no_bits_and_the_setting_round_trips():
    """set_gguf_unpack (whether calls of many rows take Q5_K's and Q6_K's groups unpacked once; on by default on
    Intel's AVX-512 path) returns the previous value, and the rows' bits are the same either way: 9 (one tile of
    8 and one row), 37 and 150 rows (the driver's slices of 64 rows) of every K-quant and a 32-weight format."""
    module = native.load()
    before = module.set_gguf_unpack(False)
    try:
        assert module.set_gguf_unpack(False) is False and module.gguf_unpack() is False
        for kind in ("q4_k", "q5_k", "q6_k", "q4_1"):
            N, K = 40, 2048
            packed = module.ggml_pack(blocks(kind, N, K), kind)
            for rows in (9, 37, 150):
                x = activations(rows, K)
                module.set_gguf_unpack(False)
                direct = module.ggml_linear(x, packed, kind, N, K)
                assert module.set_gguf_unpack(True) is False and module.gguf_unpack() is True
                assert torch.equal(module.ggml_linear(x, packed, kind, N, K), direct), (kind, rows)
    finally:
        module.set_gguf_unpack(before)


def test_amx_tiles_give_the_avx512_kernels_bits_and_the_setting_round_trips():
    """set_gguf_amx (whether calls of 32 rows or more, Q6_K's of 16 or more, Q4_K's and Q5_K's of 8 or more, take
    AMX-INT8 tiles where the CPU runs them; the emulator runs no AMX, so the tiles are tested on a CPU that has
    them, skipped elsewhere) returns whether they did, and every kind's rows have the AVX-512 kernel's bits either
    way (Q4_1 has no tiles: unchanged; the K-quants' tiles sum a super-block, Q6_K's codes times their scales in a
    signed high piece): the K-quants at 8, 12, 16, 17, 24 and 31 rows (a call of fewer than 32 rows: one unit of
    tiles of its rows; Q6_K's from 16), 32 rows (a decode batch: 2 tiles of 16), 40 (tiles and the AVX-512 kernel for the rest), 64
    (4 tiles), 100 and 150 (150 in the driver's slices of 64), 512;
    K of one block group, 18 blocks (SmolLM2's 576, a short last group), 2048 and (Q6_K) 4096; and the K-quants
    at 300 features (19 panels) on 1 and 2 threads: past the tiles' group of 8 panels on each thread, a short last
    group and panel, and at 600 rows groups of fewer panels."""
    module = native.load()
    threads_before = torch.get_num_threads()
    before = module.set_gguf_amx(False)
    try:
        assert module.gguf_amx() is False
        assert module.set_gguf_amx(True) is False
        if not module.gguf_amx():
            pytest.skip("this CPU (or its virtual machine, or Linux) runs no AMX tiles")
        amx_rows = module.gguf_amx_rows()
        assert amx_rows == 8
        for kind in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k"):
            widths = (256, 2048, 4096) if kind == "q6_k" else (256, 2048) if kind.endswith("_k") else (256, 576, 2048)
            for K in widths:
                N = 40
                packed = module.ggml_pack(blocks(kind, N, K), kind)
                for rows in ((8, 12, 16, 17, 24, 31) if kind.endswith("_k") else ()) + (32, 40, 64, 100, 150, 512):
                    x = activations(rows, K)
                    module.set_gguf_amx(False)
                    vector = module.ggml_linear(x, packed, kind, N, K)
                    assert module.set_gguf_amx(True) is False and module.gguf_amx() is True
                    assert torch.equal(module.ggml_linear(x, packed, kind, N, K), vector), (kind, K, rows)
            if kind.endswith("_k"):
                N, K = 300, 512
                packed = module.ggml_pack(blocks(kind, N, K), kind)
                for threads in (1, 2):  # 19 panels a thread (groups of 8, 8, 3) or 10 and 9 (8 + 2, 8 + 1)
                    torch.set_num_threads(threads)
                    for rows in (amx_rows, 20, 32, 100, 512, 600):  # 600: smaller groups, 8 rows left over
                        x = activations(rows, K)
                        module.set_gguf_amx(False)
                        vector = module.ggml_linear(x, packed, kind, N, K)
                        module.set_gguf_amx(True)
                        assert torch.equal(module.ggml_linear(x, packed, kind, N, K), vector), (kind, threads, rows)
                    torch.set_num_threads(threads_before)
    finally:
        module.set_gguf_amx(before)
        torch.set_num_threads(threads_before)


def test_a_chunks_activations_quantized_by_several_threads_give_the_bits_of_one():
    """A call of more than 32 rows quantizes its activations on the kernels' threads, a run of rows each: the same
    bits as one thread, split evenly or not (130 rows over 3 threads; 33, just past one thread's share), and as
    the same rows in decode batches."""
    module = native.load()
    threads = torch.get_num_threads()
    try:
        for kind in ("q4_1", "q8_0", "q6_k"):
            N, K = BATCH_SHAPE[weights_of(kind)]
            packed = module.ggml_pack(blocks(kind, N, K), kind)
            for M in (33, 130):
                x = activations(M, K)
                torch.set_num_threads(1)
                one = module.ggml_linear(x, packed, kind, N, K)
                torch.set_num_threads(3)
                assert torch.equal(module.ggml_linear(x, packed, kind, N, K), one), (kind, M)
                # and the rows of decode batches (quantized by the calling thread alone)
                batches = torch.cat([module.ggml_linear(x[m:m + 8], packed, kind, N, K) for m in range(0, M, 8)])
                assert torch.equal(batches, one), (kind, M)
    finally:
        torch.set_num_threads(threads)


def test_bad_shapes_and_kinds_raise_clear_errors():
    module = native.load()
    raw = blocks("q8_0", 16, 64)
    packed = module.ggml_pack(raw, "q8_0")
    with pytest.raises(RuntimeError, match="kind must be one of .*\"q6_k\"; got \"q3_k\""):
        module.ggml_pack(raw, "q3_k")
    with pytest.raises(RuntimeError, match=r"units \* 20"):
        module.ggml_pack(raw, "q4_1")  # 68 bytes a row: not whole Q4_1 blocks
    with pytest.raises(RuntimeError, match="multiple of 32"):
        module.ggml_linear(torch.randn(1, 48), packed, "q8_0", 16, 48)
    with pytest.raises(RuntimeError, match="q4_k weights need .* multiple of 256"):
        module.ggml_linear(torch.randn(1, 64), packed, "q4_k", 16, 64)
    with pytest.raises(RuntimeError, match="packed for another shape"):
        module.ggml_linear(torch.randn(1, 64), packed, "q8_0", 32, 64)
    with pytest.raises(RuntimeError, match="packed for another shape"):
        module.ggml_unpack(packed, "q4_1", 16, 64)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        module.ggml_linear(torch.randn(64, 2).T, packed, "q8_0", 16, 64)


@pytest.mark.parametrize("kind", KINDS)
def test_layers_are_built_by_the_gguf_type_name_and_dequantize_as_gguf(kind):
    qtype = QTYPES[kind]
    layer_kind = GGMLKind[qtype.name]
    assert layer_kind.value == kind and (layer_kind.block_weights, layer_kind.block_bytes) == (
        weights_of(kind), leaves.BLOCK_BYTES[kind])
    rng = np.random.default_rng(3)
    K = 512
    raw = random_blocks(kind, 24, K, rng)
    expected = torch.from_numpy(dequantize(raw, kind).astype(np.float32))  # float32 in gguf: exact
    assert torch.equal(dequantize_blocks(torch.from_numpy(raw), layer_kind).view(torch.int32),
                       expected.view(torch.int32))
    layer = GGMLLinear(torch.from_numpy(raw), layer_kind)
    assert (layer.in_features, layer.out_features) == (K, 24)
    assert np.array_equal(layer.blocks().numpy(), raw)
    assert torch.equal(layer.dequantize().view(torch.int32), expected.view(torch.int32))
    x = torch.randn(3, K)
    assert_near_the_float64_product(layer(x), x, raw, kind, "kernel")
    layer.use_kernel = False
    assert torch.equal(layer(x), torch.nn.functional.linear(quantize_activations(x, ACT_GROUP[kind], 127), expected))
    embedding = GGMLEmbedding(torch.from_numpy(raw), layer_kind, torch.bfloat16)
    ids = torch.tensor([[5, 0], [23, 5]])
    assert embedding.embedding_dim == K
    assert torch.equal(embedding(ids), expected[ids].bfloat16())
    tied = GGMLEmbedding.tied_to(layer, torch.bfloat16)  # rows out of the layer's panels (8 a panel, or 16)
    assert (tied.num_embeddings, tied.embedding_dim, tied.head) == (24, K, layer)
    assert torch.equal(tied(ids), expected[ids].bfloat16())
    assert np.array_equal(native.load().ggml_rows(layer.weight, kind, torch.tensor([23, 0, 9, 9]), 24, K).numpy(),
                          raw[[23, 0, 9, 9]])
    for bad in ([24], [-1]):
        with pytest.raises(RuntimeError, match="out of range for 24 rows"):
            native.load().ggml_rows(layer.weight, kind, torch.tensor(bad), 24, K)


def worker(out: str) -> None:
    """In a child process (on the ISA KVSERVE_ISA forces): every kind's and shape's outputs at 1..9 and 33 rows,
    checking that each row's bits are the same alone, in every batch of 1..64 and in a 512-row call (slices of the
    kernels' row walk and tiles included); saved to ``out``."""
    module = native.load()
    results = {"isa": module.isa()}
    for kind in KINDS:
        for N, K in SHAPES[weights_of(kind)]:
            packed = module.ggml_pack(blocks(kind, N, K), kind)
            for M in (*range(1, 10), 33):
                results[kind, N, K, M] = module.ggml_linear(activations(M, K), packed, kind, N, K)
        N, K = BATCH_SHAPE[weights_of(kind)]
        packed = module.ggml_pack(blocks(kind, N, K), kind)
        x = activations(512, K)
        full = module.ggml_linear(x, packed, kind, N, K)  # [512, N]
        for M in range(1, 65):
            start = (7 * M) % (512 - M)
            assert torch.equal(module.ggml_linear(x[start:start + M], packed, kind, N, K), full[start:start + M]), \
                (kind, M)
        alone = torch.cat([module.ggml_linear(x[m:m + 1], packed, kind, N, K) for m in range(0, 512, 37)])
        assert torch.equal(alone, full[0:512:37]), kind
        results[kind, "prefill"] = full
    torch.save(results, out)


def test_every_native_path_gives_the_scalar_bits_in_every_batch(tmp_path):
    results = {}
    for isa in native.native_isas():
        out = tmp_path / f"{isa}.pt"
        code = f"from tests.test_ggml_kernels import worker; worker({str(out)!r})"
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "KVSERVE_ISA": isa},
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        results[isa] = torch.load(out)
        assert results[isa].pop("isa") == isa
    scalar = results.pop("scalar")
    for isa, got in results.items():
        assert got.keys() == scalar.keys()
        for key, y in scalar.items():
            assert torch.equal(got[key], y), (isa, key)



# Run in a process of its own whose allocator maps every buffer of 128 KiB or more anew (a fixed threshold: no
# dynamic one), so no buffer lands in memory another one's advice left flagged and the check can fail.
HUGE_PAGES_PROBE = """
import numpy as np, torch
from kvserve import native
from kvserve.loadtest.engine.ggmlbench import mappings
from kvserve.quant.ggml import GGMLKind, GGMLLinear
from kvserve.quant.linear import concat_outputs
from tests.ggmlutil import random_blocks

def advised(t):
    # whether the mapping holding t's first whole 2 MiB page carries MADV_HUGEPAGE's flag ("hg" in VmFlags: set by
    # the advice whatever the system's THP mode)
    huge = 2 << 20
    address = (t.data_ptr() + huge - 1) // huge * huge
    assert address + huge <= t.data_ptr() + t.nbytes, "the tensor holds no whole huge page"
    [flags] = [fields["VmFlags"].split() for start, end, fields in mappings() if start <= address < end]
    return "hg" in flags

def blocks(N, K, seed):
    return torch.from_numpy(random_blocks("q4_k", N, K, np.random.default_rng(seed)))

module = native.load()
raw = blocks(4096, 2048, 0)  # 4.5 MiB of blocks
packed = module.ggml_pack(raw, "q4_k")
parts = [GGMLLinear(blocks(2048, 2048, s), GGMLKind.Q4_K) for s in (1, 2)]
expected = torch.cat([p.blocks() for p in parts])
fused = concat_outputs(parts)
w = torch.randn(2048, 2048).bfloat16()
bf16 = module.bf16_pack(w)
assert torch.equal(module.ggml_unpack(packed, "q4_k", 4096, 2048), raw)
assert torch.equal(fused.blocks(), expected)
assert torch.equal(module.bf16_unpack(bf16, 2048, 2048), w)
print(advised(torch.zeros(8 << 20, dtype=torch.uint8)), advised(packed), advised(fused.weight), advised(bf16),
      module.advise_huge_pages(torch.empty(1 << 20, dtype=torch.uint8)))
"""


@pytest.mark.skipif(sys.platform != "linux" or "VmFlags:" not in Path("/proc/self/smaps").read_text(),
                    reason="no mappings' flags to read (Linux's /proc/self/smaps)")
@pytest.mark.skipif(bool(os.environ.get("LD_PRELOAD")), reason="another allocator may be preloaded (the probe "
                    "fixes glibc's mmap threshold)")
def test_packed_weights_are_advised_for_huge_pages_before_they_are_written():
    # a plain tensor is not advised (the check can fail); ggml_pack's panels, a fused stack of layers
    # (QuantLinear._move_weights' buffer) and bf16_pack's panels are, their bytes unchanged; 1 MiB holds no whole
    # huge page to advise
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}  # torch's switch advises any
    env["GLIBC_TUNABLES"] = "glibc.malloc.mmap_threshold=131072"
    out = subprocess.run([sys.executable, "-c", HUGE_PAGES_PROBE], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "True", "True", "True", "0"], out.stdout
