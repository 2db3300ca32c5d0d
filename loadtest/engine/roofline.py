"""The machine's own limits, measured by the roofline probes of the native library of leaves (native/csrc/leaves.cpp
and ukernel_bf16.h, built by ``native.ggml_leaves.build``), for the benchmarks that set a kernel against them.

- ``read_bandwidth``: GB/s of ``kv_read_bytes`` (32-byte loads into 8 independent chains, as a kernel streams its
  weights) over buffers larger than the L3;
- ``peak_gmacs``: one core's multiply-adds per CPU second of a probe whose independent chains stay on registers:
  ``kv_vnni_peak`` (``vpdpbusd``, 16 chains of 64 a round), ``kv_int8_peak_avx2`` (``vpmaddubsw`` added in int16,
  the AVX2 path's int8 dot, 8 of 32 a round, only the int16 sums chained), ``kv_bf16_peak`` (``vdpbf16ps``, 16
  of 32), ``kv_fma_peak_avx512`` / ``kv_fma_peak_avx2`` (float32 FMA, 16 zmm or 12 ymm chains);
  ``int8_peak_gmacs``, ``bf16_peak_gmacs`` and ``fma_peak_gmacs`` name them.

Rates are per CPU second of the measuring thread (``time.thread_time``), so another process's turns on the core do
not count: on a shared machine they are the core's, not the wall clock's.
"""

from __future__ import annotations

import ctypes
import threading
import time
from functools import cache

import numpy as np

STREAM_BYTES = 256 << 20  # more than the L3: the bytes come from memory, as a decode step reads its weights
# Per ISA path, the float32 FMA probe and its multiply-adds a round (16 zmm chains, or 12 ymm chains)
FMA_PROBES = {"avx512": ("kv_fma_peak_avx512", 16 * 16), "avx2": ("kv_fma_peak_avx2", 12 * 8)}
# Per ISA path, the int8 probe of the instruction its GGUF dots multiply with, and its multiply-adds a round
INT8_PROBES = {"avx512": ("vpdpbusd", "kv_vnni_peak", 16 * 64), "avx2": ("vpmaddubsw", "kv_int8_peak_avx2", 8 * 32)}


@cache
def _leaves() -> ctypes.CDLL:
    from kvserve.native import ggml_leaves

    library = ctypes.CDLL(str(ggml_leaves.build(native=True)))
    library.kv_read_bytes.argtypes, library.kv_read_bytes.restype = [ctypes.c_void_p, ctypes.c_int64], ctypes.c_uint32
    return library


def read_bandwidth(threads: int = 1, nbytes: int = STREAM_BYTES) -> float:
    """GB/s that ``threads`` threads read together, each over its own ``nbytes`` (ctypes releases the GIL), per CPU
    second of each thread: process CPU time / threads, so time another process takes the core does not count."""
    library = _leaves()
    buffers = [np.ones(nbytes, np.uint8) for _ in range(threads)]
    for b in buffers:
        library.kv_read_bytes(b.ctypes.data, nbytes)  # touched: no page faults in the timing
    rounds = 3

    def read(b: np.ndarray) -> None:
        for _ in range(rounds):
            library.kv_read_bytes(b.ctypes.data, nbytes)

    workers = [threading.Thread(target=read, args=(b,)) for b in buffers]
    started = time.process_time()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    busy = (time.process_time() - started) / threads
    return threads * rounds * nbytes / busy / 1e9


def peak_gmacs(symbol: str, macs_per_round: int, iterations: int = 20_000_000) -> float | None:
    """One core's multiply-adds per CPU second (GMAC/s) of probe ``symbol`` (``macs_per_round`` a round), run once
    short to warm up, then for ``iterations`` rounds; None where the library lacks the probe."""
    probe = getattr(_leaves(), symbol, None)
    if probe is None:
        return None
    probe.argtypes, probe.restype = [ctypes.c_int64], None  # its result only keeps the chains from being dropped
    probe(iterations // 10)
    started = time.thread_time()
    probe(iterations)
    return iterations * macs_per_round / (time.thread_time() - started) / 1e9


def int8_peak_gmacs(path: str = "avx512", iterations: int = 20_000_000) -> float | None:
    """The int8 multiply-adds per core of ISA path ``path``'s dots: ``vpdpbusd`` on "avx512" (``kv_vnni_peak``),
    ``vpmaddubsw`` on "avx2" (``kv_int8_peak_avx2``); None for another path or where this CPU lacks it."""
    from kvserve import native

    if path not in INT8_PROBES or path not in native.native_isas():
        return None
    return peak_gmacs(*INT8_PROBES[path][1:], iterations)


def bf16_peak_gmacs(iterations: int = 20_000_000) -> float | None:
    """``vdpbf16ps`` (``kv_bf16_peak``); call it only where the CPU has AVX-512 BF16 (the probe would fault)."""
    return peak_gmacs("kv_bf16_peak", 16 * 32, iterations)


def fma_peak_gmacs(path: str, iterations: int = 20_000_000) -> float | None:
    """Float32 FMAs on ISA path ``path`` ("avx512": zmm, "avx2": ymm, as the float32 attention tiles of
    attend_tile.h run them); None for another path (the scalar one has no probe) or where this CPU lacks it."""
    from kvserve import native

    if path not in FMA_PROBES or path not in native.native_isas():
        return None
    return peak_gmacs(*FMA_PROBES[path], iterations)
