"""The emulator harness (kvserve.native.emulate): AVX-512 leaves run under Bochs give numpy's bits, and the hardware's.

The probe leaves (native/csrc/emu_probe.c) cover what the AVX-512 micro-kernels rely on: ``vpdpbusd`` with int32
wrap-around, ``vdpbf16ps`` with denormals, masked loads and stores. Each runs emulated and, on a CPU that has these
instructions, natively too, against one numpy reference bit for bit. CPU models without VNNI, BF16 or AVX-512
raise #UD on those instructions, in a child process each (Bochs emulates one model per process).
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvserve.native import emulate
from kvserve.native.emulate import CpuModel, Emulator, GuestFault

ROOT = Path(__file__).resolve().parent.parent
AVAILABLE, REASON = emulate.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=REASON)

PROBE_SOURCES = [emulate.CSRC / "emu_probe.c"]
NATIVE_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"}
MISSING_NATIVE = NATIVE_FLAGS - emulate.host_cpu_flags()


class DotArgs(ctypes.Structure):
    """struct emu_probe_dot."""

    _fields_ = [("a", ctypes.c_uint64), ("b", ctypes.c_uint64), ("out", ctypes.c_uint64), ("n", ctypes.c_int64)]


class MaskedArgs(ctypes.Structure):
    """struct emu_probe_masked."""

    _fields_ = [("src", ctypes.c_uint64), ("dst", ctypes.c_uint64), ("n", ctypes.c_int64), ("add", ctypes.c_int32)]


@pytest.fixture(scope="module")
def emulator():
    with Emulator(CpuModel.SAPPHIRE_RAPIDS) as emu:
        emu.load(emulate.build_freestanding(PROBE_SOURCES, "emu_probe"))
        yield emu


@pytest.fixture(scope="module")
def native():
    with emulate.Native(emulate.build_native(PROBE_SOURCES, "emu_probe")) as library:
        yield library


@pytest.fixture(params=["emulated", "native"])
def runner(request):
    """The probe leaves emulated, or run on this CPU (skipped where it lacks the instructions)."""
    if request.param == "native" and MISSING_NATIVE:
        pytest.skip(f"this CPU lacks {', '.join(sorted(MISSING_NATIVE))}: the emulated run covers it")
    target = request.getfixturevalue("emulator" if request.param == "emulated" else "native")
    target.reset_heap()
    return target


def dot_lanes(target, symbol: str, a: np.ndarray, b: np.ndarray, dtype) -> np.ndarray:
    """The probe's 16 lane sums of a * b: ndarray [16] of ``dtype``."""
    args = DotArgs(a=target.put(a), b=target.put(b), out=target.alloc(64), n=a.size)
    target.call(symbol, target.put_struct(args))
    return target.get(args.out, 16, dtype)


def wrap_int32(values: np.ndarray) -> np.ndarray:
    return ((values + 2**31) % 2**32 - 2**31).astype(np.int32)


def dpbusd_reference(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(wrapped int32 lane sums [16], exact int64 lane sums [16]); lane j holds bytes 4j..4j+3 of each 64."""
    exact = (a.astype(np.int64) * b.astype(np.int64)).reshape(-1, 16, 4).sum(axis=(0, 2))
    return wrap_int32(exact), exact


DPBUSD_CASES = {
    "random": lambda rng, n: (rng.integers(0, 256, n, dtype=np.uint8), rng.integers(-128, 128, n, dtype=np.int8)),
    "255 x -128 past int32's minimum": lambda rng, n: (np.full(n, 255, np.uint8), np.full(n, -128, np.int8)),
    "255 x 127 past int32's maximum": lambda rng, n: (np.full(n, 255, np.uint8), np.full(n, 127, np.int8)),
}


@pytest.mark.parametrize("case", DPBUSD_CASES)
def test_vpdpbusd_accumulates_in_int32_and_wraps_around(runner, case):
    # 255 * 128 * 4 per lane and block: 16,448 blocks of 64 bytes pass 2**31; 17,000 do, in both directions.
    n = 64 * (17_000 if case != "random" else 64)
    a, b = DPBUSD_CASES[case](np.random.default_rng(1234), n)
    wrapped, exact = dpbusd_reference(a, b)
    if case != "random":
        assert np.all(np.abs(exact) > 2**31), "the case must overflow int32"
    assert np.array_equal(dot_lanes(runner, "emu_probe_dpbusd", a, b, np.int32), wrapped)


def bfloat16_rne(x) -> np.ndarray:
    """float32 -> bfloat16 bits, rounding to nearest even: uint16 array."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def flush_denormals(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32).copy()
    tiny = (np.abs(x) < np.finfo(np.float32).tiny) & (x != 0)
    x[tiny] = np.copysign(np.float32(0), x[tiny])
    return x


def dpbf16_reference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """VDPBF16PS as the Intel SDM specifies it: lane j adds a[2j+1]*b[2j+1], then a[2j]*b[2j], per block of 32;
    inputs, products and sums with denormals flushed to zero (DAZ, FTZ), float32 round to nearest even."""
    left = flush_denormals((a.astype(np.uint32) << 16).view(np.float32)).reshape(-1, 16, 2)
    right = flush_denormals((b.astype(np.uint32) << 16).view(np.float32)).reshape(-1, 16, 2)
    lanes = np.zeros(16, np.float32)
    with np.errstate(all="ignore"):
        for block in range(left.shape[0]):
            for half in (1, 0):
                lanes = flush_denormals(lanes + flush_denormals(left[block, :, half] * right[block, :, half]))
    return lanes


def _denormal_mix(rng, n):
    a, b = bfloat16_rne(rng.standard_normal(n)), bfloat16_rne(rng.standard_normal(n))
    a[::7] = rng.integers(1, 0x80, a[::7].shape, dtype=np.uint16)  # bfloat16 denormal inputs
    b[3::11] = bfloat16_rne(np.full(b[3::11].shape, 1e-30))         # products below float32's normal range
    a[5::13], b[5::13] = bfloat16_rne(1e30), bfloat16_rne(1e15)     # products that overflow to inf
    return a, b


BF16_CASES = {
    "normal": lambda rng, n: (bfloat16_rne(rng.standard_normal(n)), bfloat16_rne(rng.standard_normal(n))),
    "wide exponents": lambda rng, n: tuple(bfloat16_rne(rng.standard_normal(n) * np.exp2(rng.integers(-60, 60, n)))
                                           for _ in range(2)),
    "denormals, tiny and overflowing products": _denormal_mix,
    # denormal x 1e30 is about 1e-9 unless the input is flushed first (DAZ)
    "denormal inputs are flushed": lambda rng, n: (rng.integers(0x10, 0x80, n, dtype=np.uint16),
                                                   bfloat16_rne(np.full(n, 1e30))),
    # 1e-20 x 1e-19 is a float32 denormal: zero only if products are flushed (FTZ)
    "denormal products are flushed": lambda rng, n: (bfloat16_rne(np.full(n, 1e-20)), bfloat16_rne(np.full(n, 1e-19))),
}

FLUSHED_TO_ZERO = {"denormal inputs are flushed", "denormal products are flushed"}


@pytest.mark.parametrize("case", BF16_CASES)
def test_vdpbf16ps_matches_the_sdm_bit_for_bit(runner, case):
    a, b = BF16_CASES[case](np.random.default_rng(99), 4096)
    expected = dpbf16_reference(a, b)
    if case in FLUSHED_TO_ZERO:
        assert np.all(expected == 0)
    got = dot_lanes(runner, "emu_probe_dpbf16", a, b, np.float32)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_the_flush_cases_are_not_zero_without_flushing():
    """The two flush cases above test something: without DAZ/FTZ their lanes would not be zero."""
    denormal = (np.full(32, 0x40, np.uint32) << 16).view(np.float32)
    assert np.all(denormal * np.float32(1e30) > 0)
    assert np.float32(1e-20) * np.float32(1e-19) > 0


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 40])
def test_masked_loads_and_stores_stop_at_n(runner, n):
    src = np.arange(1, 49, dtype=np.int32) * 1000
    untouched = np.full(48, -7, np.int32)
    args = MaskedArgs(src=runner.put(src), dst=runner.put(untouched), n=n, add=5)
    runner.call("emu_probe_masked_add", runner.put_struct(args))
    dst = runner.get(args.dst, 48, np.int32)
    assert np.array_equal(dst[:n], src[:n] + 5)
    assert np.array_equal(dst[n:], untouched[n:])


def test_a_masked_tail_never_touches_memory_past_n(emulator):
    """The source ends where guest RAM ends: an unmasked 64-byte load of its 17-element tail would fault."""
    emulator.reset_heap()
    src = np.arange(17, dtype=np.int32)
    args = MaskedArgs(src=emulator.put_at_end(src), dst=emulator.alloc(64 * 4), n=src.size, add=1)
    emulator.call("emu_probe_masked_add", emulator.put_struct(args))
    assert np.array_equal(emulator.get(args.dst, src.size, np.int32), src + 1)
    # the same 68 bytes read unmasked, 64 at a time (vpdpbusd), fault in the second load: the check above can fail
    unmasked = DotArgs(a=args.src, b=args.src, out=emulator.alloc(64), n=128)
    with pytest.raises(GuestFault, match="#PF") as fault:
        emulator.call("emu_probe_dpbusd", emulator.put_struct(unmasked))
    assert fault.value.address >= emulator.size


@pytest.mark.skipif(bool(MISSING_NATIVE), reason=f"this CPU lacks {', '.join(sorted(MISSING_NATIVE))}")
def test_emulated_and_native_runs_agree_bit_for_bit(emulator, native):
    rng = np.random.default_rng(7)
    for _ in range(3):
        emulator.reset_heap()
        native.reset_heap()
        a, b = rng.integers(0, 256, 4096, dtype=np.uint8), rng.integers(-128, 128, 4096, dtype=np.int8)
        assert np.array_equal(dot_lanes(emulator, "emu_probe_dpbusd", a, b, np.int32),
                              dot_lanes(native, "emu_probe_dpbusd", a, b, np.int32))
        x, y = (bfloat16_rne(rng.standard_normal(2048) * np.exp2(rng.integers(-130, 60, 2048))) for _ in range(2))
        assert np.array_equal(dot_lanes(emulator, "emu_probe_dpbf16", x, y, np.float32).view(np.uint32),
                              dot_lanes(native, "emu_probe_dpbf16", x, y, np.float32).view(np.uint32))


# ------------------------------------------------------------------------------------------ calls and faults


def test_six_integer_arguments_arrive_in_order(emulator):
    assert emulator.call("emu_probe_weighted_sum", 1, 2, 3, 4, 5, 6) == 91
    assert emulator.call("emu_probe_weighted_sum", -1, 0, 0, 0, 0, 0) == 2**64 - 1  # two's complement
    with pytest.raises(ValueError, match="at most 6"):
        emulator.call("emu_probe_weighted_sum", 1, 2, 3, 4, 5, 6, 7)
    with pytest.raises(KeyError, match="emu_probe_missing"):
        emulator.call("emu_probe_missing")


def test_a_null_pointer_is_a_page_fault_naming_the_function_and_address(emulator):
    with pytest.raises(GuestFault, match=r"#PF .* emu_probe_store at 0x[0-9a-f]+ \(emu_probe_store\+0x") as fault:
        emulator.call("emu_probe_store", 0, 5)
    assert fault.value.vector == 14 and fault.value.address == 0
    emulator.reset_heap()
    target = emulator.alloc(8)  # the emulator still runs after a fault
    emulator.call("emu_probe_store", target, 77)
    assert emulator.get(target, 1, np.int64)[0] == 77


def test_guest_ram_exhaustion_is_an_error(emulator):
    emulator.reset_heap()
    with pytest.raises(emulate.EmulatorError, match="guest RAM exhausted"):
        emulator.alloc(emulator.size)


def test_a_second_cpu_model_in_one_process_is_refused(emulator):
    with pytest.raises(emulate.EmulatorError, match="already emulates SAPPHIRE_RAPIDS"):
        Emulator(CpuModel.CANNON_LAKE)
    with pytest.raises(emulate.EmulatorError, match="another Emulator is open"):
        Emulator(CpuModel.SAPPHIRE_RAPIDS)


def run_probes_in_this_process(model_name: str, so: str, symbols: list[str]) -> None:
    """Child process body: print ``{symbol: "returned" | [vector, where]}`` for each probe leaf run on ``model``."""
    rng = np.random.default_rng(0)
    results = {}
    with Emulator(CpuModel[model_name]) as emu:
        emu.load(so)
        for symbol in symbols:
            emu.reset_heap()
            try:
                if symbol == "emu_probe_masked_add":
                    src = np.arange(20, dtype=np.int32)
                    args = MaskedArgs(src=emu.put(src), dst=emu.alloc(src.nbytes), n=src.size, add=1)
                    emu.call(symbol, emu.put_struct(args))
                else:
                    # 64 elements: one block of either instruction (the bfloat16 bits here are small normals)
                    a, b = (rng.integers(0x3F00, 0x3F80, 64, dtype=np.uint16) for _ in range(2))
                    dot_lanes(emu, symbol, a, b, np.int32)
                results[symbol] = "returned"
            except GuestFault as fault:
                results[symbol] = [fault.vector, fault.where]
    print(json.dumps(results))


@pytest.mark.parametrize("model, faulting, returning", [
    # AVX-512 without VNNI: vpdpbusd is #UD, the AVX-512F masked tail runs (so the set-up is not what fails)
    (CpuModel.CANNON_LAKE, ["emu_probe_dpbusd", "emu_probe_dpbf16"], ["emu_probe_masked_add"]),
    (CpuModel.ICE_LAKE, ["emu_probe_dpbf16"], ["emu_probe_dpbusd", "emu_probe_masked_add"]),  # VNNI, no BF16
    (CpuModel.ARROW_LAKE, ["emu_probe_dpbusd", "emu_probe_masked_add"], []),  # no AVX-512 at all
], ids=lambda value: value.name if isinstance(value, CpuModel) else None)
def test_a_cpu_without_the_instruction_raises_invalid_opcode(model, faulting, returning):
    so = emulate.build_freestanding(PROBE_SOURCES, "emu_probe")
    code = ("from tests.test_emulate import run_probes_in_this_process as run; "
            f"run({model.name!r}, {str(so)!r}, {faulting + returning!r})")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.splitlines()[-1])
    for symbol in faulting:
        vector, where = results[symbol]
        assert vector == 6 and where.startswith(symbol + "+"), results
    assert all(results[symbol] == "returned" for symbol in returning), results


# ------------------------------------------------------------------------------------------ building


def test_a_cxx_leaf_builds_loads_beside_another_and_runs(emulator, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    source = tmp_path / "twice.cpp"
    source.write_text('#include <stdint.h>\nextern "C" int64_t emu_test_twice(int64_t x) { return 2 * x; }\n')
    symbols = emulator.load(emulate.build_freestanding([source], "twice"))
    assert "emu_probe_dpbusd" in symbols and "emu_test_twice" in symbols
    assert emulator.call("emu_test_twice", 21) == 42


def test_the_build_is_cached_by_sources_and_defines(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    source = tmp_path / "twice.cpp"
    source.write_text('#include <stdint.h>\nextern "C" int64_t twice(int64_t x) { return FACTOR * x; }\n')
    first = emulate.build_freestanding([source], "twice", defines={"FACTOR": 2})
    assert first.parent == tmp_path / "emu"
    mtime = first.stat().st_mtime_ns
    assert emulate.build_freestanding([source], "twice", defines={"FACTOR": 2}) == first
    assert first.stat().st_mtime_ns == mtime
    other = emulate.build_freestanding([source], "twice", defines={"FACTOR": 3})
    assert other != first
    (tmp_path / "unused.h").write_text("#define UNUSED 1\n")  # a header beside the source is part of the key
    assert emulate.build_freestanding([source], "twice", defines={"FACTOR": 2}) not in (first, other)
    with pytest.raises(emulate.BuildError, match="FACTOR"):
        emulate.build_freestanding([source], "twice")  # FACTOR undefined: the compiler's message says so


def test_the_build_refuses_data_pointers_that_need_relocations(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    source = tmp_path / "table.c"
    source.write_text("static int value = 7;\nint* const table[1] = {&value};\nint first(void) { return *table[0]; }\n")
    with pytest.raises(emulate.NotALeafError, match=r"relocations R_X86_64_RELATIVE at 0x"):
        emulate.build_freestanding([source], "table")


def test_the_build_refuses_calls_outside_the_object(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    source = tmp_path / "clear.c"
    source.write_text("void* memset(void*, int, unsigned long);\n"
                      "void clear(char* p, unsigned long n) { memset(p, 0, n); }\n")
    with pytest.raises(emulate.NotALeafError, match=r"undefined symbols memset .*R_X86_64_JUMP_SLOT memset"):
        emulate.build_freestanding([source], "clear")
