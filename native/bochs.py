"""bochscpu as the emulator harness uses it: importing the PyPI wheel (preloading a glibc shim where glibc is older
than 2.38), the Bochs CPU models it ships, and choosing one through the 0.4.0 wheel's parameter layout.

native/emulate.py builds the guest machine (memory, page tables, loaded objects, calls) on top of this module;
what changes here is what a new bochscpu build changes.
"""

from __future__ import annotations

import ctypes
import enum
import functools
from pathlib import Path

from kvserve.native.leaves import CSRC, BuildError, compile_shared

_SHIM_SOURCE = CSRC / "emu_isoc23_shim.c"


class CpuModel(enum.IntEnum):
    """Bochs CPU models by their index in the wheel's cpudb (Bochs 3.0).

    The wheel's own name list is out of step with its cpudb: its "default" model, 27, is really Cannon Lake. The
    features were read from the emulated CPUID (brand string, leaf 7).
    """

    CANNON_LAKE = 27      # AVX-512 F/CD/BW/DQ/VL/IFMA/VBMI; no VNNI, no BF16 (the wheel's default)
    ICE_LAKE = 28         # + AVX-512 VNNI; no BF16
    TIGER_LAKE = 29       # + AVX-512 VNNI; no BF16
    SAPPHIRE_RAPIDS = 30  # AVX-512 F/BW/DQ/VL/VNNI/BF16/FP16, AVX-VNNI: what kvserve's AVX-512 paths need
    ARROW_LAKE = 31       # no AVX-512 at all; AVX2 and AVX-VNNI


class EmulatorError(RuntimeError):
    """The emulator cannot be used as asked (not installed, a second model in one process, guest RAM full)."""


def available() -> tuple[bool, str]:
    """Whether the emulator can run here, and why not: ``(True, "bochscpu 0.4.0")`` or ``(False, reason)``.

    Imports ``bochscpu`` (and ``elftools``), first preloading the glibc shim where glibc is older than 2.38
    (compiled with ``cc`` once, into the cache). Cached per process.
    """
    try:
        import_bochscpu()
    except (ImportError, OSError, BuildError) as exc:
        return False, f"bochscpu cannot be imported ({exc}); pip install 'bochscpu-python==0.4.0' pyelftools"
    return True, "bochscpu " + _bochscpu_version()


def _bochscpu_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("bochscpu-python")
    except metadata.PackageNotFoundError:
        return "(version unknown)"


@functools.cache  # a failed import raises, and is tried again next time
def import_bochscpu():
    """The ``bochscpu`` module, with the glibc shim preloaded where needed. Raises ImportError, OSError, BuildError."""
    import elftools  # noqa: F401  (the loader reads objects with it; refuse early when it is missing)

    if not hasattr(ctypes.CDLL(None), "__isoc23_strtoull"):
        # RTLD_GLOBAL: the wheel's extension resolves the symbols from this library when it is loaded next.
        ctypes.CDLL(str(_glibc_shim()), mode=ctypes.RTLD_GLOBAL)
    import bochscpu
    import bochscpu.cpu
    import bochscpu.memory

    return bochscpu


def _glibc_shim() -> Path:
    """The shim's shared library (glibc 2.38's C23 aliases forwarding to the old functions), built once."""
    return compile_shared([_SHIM_SOURCE], "isoc23_shim", ["-fPIC", "-shared"], base_command=["cc", "-O2"])


_process_model: list[CpuModel] = []  # the one model this process emulates, once an Emulator has been made


def select_cpu_model(model: CpuModel) -> None:
    """Make the next emulated CPU a ``model``, by setting Bochs' ``cpu.model`` parameter (before its Session).

    The wheel exposes no setter: the parameter object is found through Bochs' own ``get_param_enum`` and its value
    written in place, after checking that the object's layout is the one this was written against.

    Raises:
        EmulatorError: the parameter's layout differs (another bochscpu build): refusing rather than writing
            into memory whose meaning is unknown.
    """
    bochscpu = import_bochscpu()
    library = ctypes.CDLL(bochscpu._bochscpu.__file__)
    get_param_enum = library._ZN13bx_real_sim_c14get_param_enumEPKcP10bx_param_c  # bx_real_sim_c::get_param_enum
    get_param_enum.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    get_param_enum.restype = ctypes.c_void_p
    address = get_param_enum(None, b"cpu.model", None)
    if not address:
        raise EmulatorError("Bochs has no cpu.model parameter; cannot choose the emulated CPU")
    words = (ctypes.c_int64 * 20).from_address(address)
    # bx_param_num_c in the 0.4.0 wheel: [14] min, [15] max, [16] initial, [17] value; the cpudb has >= 28 models.
    minimum, maximum, value = words[14], words[15], words[17]
    if not (minimum == 0 and maximum >= CpuModel.CANNON_LAKE and 0 <= value <= 64):
        raise EmulatorError(f"unexpected layout of Bochs' cpu.model parameter (min {minimum}, max {maximum}, value "
                            f"{value}); this harness knows bochscpu-python 0.4.0 only")
    words[15] = max(maximum, int(model))
    words[17] = int(model)


def claim_model(model: CpuModel) -> None:
    """Pin the process to ``model`` on first use; refuse another one later.

    Bochs disables, in tables shared by every CPU it makes, the instructions a model lacks, and never enables them
    again: after a Cannon Lake CPU, a Sapphire Rapids one raises #UD on ``vpdpbusd`` too. So one process emulates
    one model; run another in a child process.
    """
    if not _process_model:
        select_cpu_model(model)
        _process_model.append(model)
    elif _process_model[0] != model:
        raise EmulatorError(f"this process already emulates {_process_model[0].name}; Bochs cannot switch to "
                            f"{model.name} in the same process (run it in a child process)")
