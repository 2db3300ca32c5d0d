"""kvserve's native code: its sources (``native/csrc``), its build, and the choice of instruction set.

Two extensions, built once with torch's C++ extension tooling:

- ``load()``: the linear (projection) kernels, one source file per family: ``linear_f32.cpp`` (float32
  weights), ``linear_int8.cpp`` (int8 weights x int16 activations), ``linear_int4.cpp`` (int4 panels x int8
  activations), ``linear_lut4.cpp`` (NF4 and other 16-level tables), ``linear_ggml.cpp`` (GGUF's Q4_1 and Q8_0
  blocks, around the leaf micro-kernels of ``ukernel*.h``), ``linear_bf16.cpp`` (bfloat16 weights, AVX512-BF16,
  around ``ukernel_bf16.h``), bound in ``linear_module.cpp``;
- ``load_ops()``: the fast path's fused ops (``decode_ops.cpp``: RMSNorm, RoPE, KV write, paged decode
  attention, SwiGLU, greedy pick; ``kv_quant.cpp``: the int8 / int4 cache's write and attention;
  ``decode_layers.cpp``: every layer of an all-decode step in one call, calling the linear kernels through the
  projection handles of ``projection_handle.h``).

Which instruction-set path runs is decided in one place, ``csrc/cpu.h``: the best the CPU supports (cpuid),
unless ``KVSERVE_ISA`` names a lesser one (``scalar``, ``avx2``; ``avx512`` is the best), so every path can be
tested on one machine. ``isa()`` says which runs and why. ``python -m kvserve.native --build`` compiles both
extensions (the install step runs it); otherwise the first use builds them (about a minute each on 2 cores). If a build fails, callers fall back to
the pure-PyTorch reference and one warning is logged. ``KVSERVE_NATIVE_KERNELS=0`` forces that reference
everywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from types import ModuleType

from kvserve import environment

log = logging.getLogger("kvserve.native")

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = {
    "kvserve_qlinear": [_CSRC / f for f in ("linear_module.cpp", "linear_f32.cpp", "linear_int8.cpp",
                                           "linear_int4.cpp", "linear_lut4.cpp", "linear_ggml.cpp",
                                           "linear_bf16.cpp")],
    "kvserve_decode_ops": [_CSRC / "decode_ops.cpp", _CSRC / "kv_quant.cpp", _CSRC / "decode_layers.cpp",
                          _CSRC / "sample_row.cpp"],
}
# kv_quant.cpp's attention gives the same bits on every ISA path: its fused multiply-adds are written out
# (intrinsics, std::fma); no other multiply and add may fuse into one on one path only (native/kv_leaves.py builds
# the same body as leaves with the same flag).
_EXTRA_CFLAGS = {"kvserve_decode_ops": ["-ffp-contract=off"]}
# The paths csrc/cpu.h knows, best last; KVSERVE_ISA may name one to force it (a lesser one than the CPU has).
ISAS = ("scalar", "avx2", "avx512")
_state: dict[str, ModuleType | None] = {}


def forced_isa() -> str | None:
    """The instruction-set path ``KVSERVE_ISA`` forces, or None when unset (the best the CPU has runs).

    Raises:
        ValueError: the variable names no path kvserve has (the message lists them).
    """
    return environment.forced_isa()


def native_isas(flags: set[str] | None = None) -> tuple[str, ...]:
    """The paths of ``ISAS`` this CPU runs natively (its /proc/cpuinfo flags, as csrc/cpu.h tests them), lesser
    first: AVX2 needs AVX2 + FMA + F16C, AVX-512 needs F + BW + VL + VNNI as well. Tests and benchmarks force each
    with ``KVSERVE_ISA``; the AVX-512 micro-kernels also run emulated where the CPU lacks them.

    Args:
        flags: /proc/cpuinfo flag names to judge instead of this CPU's."""
    if flags is None:
        from kvserve.native.emulate import host_cpu_flags

        flags = host_cpu_flags()
    if not {"avx2", "fma", "f16c"} <= flags:
        return ("scalar",)
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        return ISAS
    return ("scalar", "avx2")


def isa() -> str:
    """Which path the kernels run and why, e.g. ``avx2 (the best this CPU supports)``, ``scalar (forced by
    KVSERVE_ISA)`` or ``reference (KVSERVE_NATIVE_KERNELS=0)``."""
    module = load()
    if module is None:
        return "reference (pure PyTorch: " + ("KVSERVE_NATIVE_KERNELS=0)" if _disabled() else "no kernel build)")
    chosen = module.isa()
    forced = forced_isa()
    if forced is None:
        return f"{chosen} (the best this CPU supports)"
    if forced == chosen:
        return f"{chosen} (forced by KVSERVE_ISA)"
    return f"{chosen} (KVSERVE_ISA={forced} asks for more than this CPU has)"


def _disabled() -> bool:
    return not environment.native_kernels_on()


def load(build: bool = True) -> ModuleType | None:
    """The linear kernels (csrc/linear_*.cpp), or None when disabled or unbuildable (cached).

    Args:
        build: compile if no up-to-date build exists (otherwise return None in that case).
    """
    return _load("kvserve_qlinear", build)


def load_ops(build: bool = True) -> ModuleType | None:
    """The fast path's fused ops (csrc/decode_ops.cpp, csrc/kv_quant.cpp), or None when disabled or unbuildable (cached)."""
    if _torch_only:
        return None
    return _load("kvserve_decode_ops", build)


_torch_only: list[bool] = []


@contextlib.contextmanager
def torch_ops_only():
    """Within the block ``load_ops()`` returns None, so callers run torch's own ops (MAC counting, profiling)."""
    _torch_only.append(True)
    try:
        yield
    finally:
        _torch_only.pop()


def _load(name: str, build: bool) -> ModuleType | None:
    if name in _state:
        return _state[name]
    module = None
    forced_isa()  # a typo in KVSERVE_ISA stops here, before any kernel runs on a path nobody asked for
    if not _disabled():
        try:
            module = _compile(name) if build else _load_prebuilt(name)
        except Exception as exc:  # a missing compiler or headers: serve with the reference path
            log.warning("%s unavailable (%s); using the pure-PyTorch reference", name, exc)
    if module is not None or build:
        _state[name] = module
    return module


# torch's build lock is a bare file; a build killed midway (Ctrl-C or SIGTERM during the first start) leaves it,
# and torch then waits for it forever. On Linux a live build has a process (ninja, the compiler) working in the
# build directory; a lock with none there for LOCK_GRACE_S is a dead build's. Elsewhere only age can tell.
LOCK_GRACE_S = 60.0
STALE_LOCK_S = 1800.0


def _builders(build_dir: Path) -> int | None:
    """Processes whose working directory is ``build_dir`` (torch runs ninja there); None where /proc cannot tell."""
    proc = Path("/proc")
    if not (proc / "self" / "cwd").exists():
        return None
    target, count = os.path.realpath(build_dir), 0
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                count += os.readlink(entry / "cwd") == target
            except OSError:  # gone, or another user's
                continue
    return count


def _clear_stale_lock(build_dir: Path, poll_s: float = 2.0) -> None:
    """Wait while a live build holds ``build_dir/lock``; remove the lock of a dead one.

    Dead: no process works in ``build_dir`` and the lock is older than ``LOCK_GRACE_S`` (torch creates it just
    before starting ninja), or, where that cannot be seen, older than ``STALE_LOCK_S``.
    """
    lock = build_dir / "lock"
    announced = False
    while True:
        try:
            age = abs(time.time() - lock.stat().st_mtime)  # abs: a clock step must not make it young for hours
        except FileNotFoundError:
            return
        builders = _builders(build_dir)
        if (builders == 0 and age >= LOCK_GRACE_S) or age >= STALE_LOCK_S:
            log.warning("removing the build lock %s of a build that was killed (%.0f s old, no build running)",
                        lock, age)
            lock.unlink(missing_ok=True)
            return
        if not announced:
            log.warning("waiting for another build of %s to finish (lock %s)", build_dir.name, lock)
            announced = True
        time.sleep(poll_s)


def build_key(name: str) -> str:
    """What a build of extension ``name`` depends on, hashed: every source and header (content), the compiler
    flags, torch's and Python's versions and the machine. Two checkouts or environments share a library only when
    all of these agree, so neither can rebuild the other's or load a library built from other sources."""
    import platform

    import torch

    digest = hashlib.sha256()
    for path in sorted({*_SOURCES[name], *_CSRC.glob("*.h")}):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(repr((_CFLAGS, _EXTRA_CFLAGS.get(name, []), torch.__version__, sys.version, platform.machine(),
                        environment.compiler())).encode())
    return digest.hexdigest()[:16]


def build_dir(name: str) -> Path:
    """Where extension ``name`` is built: ``$KVSERVE_KERNEL_CACHE/<name>-<build_key>``."""
    return environment.kernel_cache_dir() / f"{name}-{build_key(name)}"


# -fopenmp: at::parallel_for is an inline OpenMP loop; compiled without it, it silently runs on one thread
# (and `omp simd` reductions stay scalar).
_CFLAGS = ("-O3", "-fopenmp")


def _compile(name: str) -> ModuleType:
    from torch.utils import cpp_extension

    where = build_dir(name)
    where.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(where)
    if (where / f"{name}.so").exists():  # built from exactly these sources (the folder's key says so)
        try:
            return cpp_extension._import_module_from_library(name, str(where), True)
        except ImportError as exc:  # a build cut short: let ninja finish it
            log.info("rebuilding %s (%s)", name, exc)
    # a build takes minutes (on a fresh checkout, or after native/csrc changed): say so, or a server's start looks
    # hung between its first lines and "serving"
    log.warning("compiling %s for this checkout's sources into %s: a few minutes, once (`python -m kvserve.native "
                "--build` does it ahead)", name, where)
    return cpp_extension.load(name=name, sources=[str(p) for p in _SOURCES[name]],
                              extra_cflags=[*_CFLAGS, *_EXTRA_CFLAGS.get(name, [])],
                              extra_ldflags=["-fopenmp"], build_directory=str(where), verbose=False)


def _load_prebuilt(name: str) -> ModuleType | None:
    if not (build_dir(name) / f"{name}.so").exists():
        return None
    return _compile(name)  # current: imported as it is


def main(argv: list[str] | None = None) -> int:
    """``python -m kvserve.native --build``: compile both extensions now and say which path they run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true", help="compile (or check) the extension")
    args = parser.parse_args(argv)
    if not args.build:
        parser.print_help()
        return 0
    module = load(build=True)
    if module is None:
        print("linear kernels: not built (the pure-PyTorch reference will be used)", file=sys.stderr)
        return 0  # the install must not fail over an optional speed-up
    print(f"linear kernels: built, {isa()}; bfloat16-weight kernel (AVX512-BF16): "
          + ("runs" if module.bf16_native() else "off (needs AVX512-BF16 on the avx512 path)")
          + f"; GGUF calls of {module.gguf_amx_rows()} rows or more (Q6_K: 16, the 32-weight formats: 32) on AMX-INT8 tiles: "
          + ("yes" if module.gguf_amx() else "no (needs AMX on the avx512 path; KVSERVE_AMX=0 refuses it)"))
    ops = load_ops(build=True)
    print("engine decode ops: " + ("built" if ops is not None else "not built (torch ops will be used)"))
    return 0

