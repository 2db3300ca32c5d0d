"""Run leaf x86-64 functions inside a CPU emulator, so AVX-512 kernel paths are tested on CPUs without AVX-512.

The emulator is Bochs' CPU core as the PyPI package ``bochscpu-python`` (pinned 0.4.0 in the ``test`` extra) ships
it, set to emulate a Sapphire Rapids core (AVX-512 F/BW/DQ/VL/VNNI/BF16/FP16, AVX-VNNI). Checked against AVX-512
hardware, it gives the same bits (``vpdpbusd`` with wrap-around, ``vdpbf16ps`` with denormals) at about 40-70
million instructions a second: a test tool, never a speed figure.

What runs here is a *leaf*: a function of a freestanding shared object (``build_freestanding``) that calls nothing
outside the object (no libc, no OpenMP, no allocation), has no relocations and takes at most six integer or
pointer arguments. kvserve's micro-kernels are such leaves taking one pointer to an argument struct::

    so = build_freestanding([CSRC / "emu_probe.c"], "probe")
    with Emulator() as emu:
        emu.load(so)
        args = ProbeArgs(a=emu.put(a), b=emu.put(b), out=emu.alloc(64), n=a.size)  # a ctypes.Structure
        emu.call("emu_probe_dpbusd", emu.put_struct(args))
        lanes = emu.get(args.out, 16, np.int32)

Guest memory (identity mapped, ring 0, long mode; one host mmap, so guest memory is a numpy view)::

    0x000000  not mapped: a null pointer faults
    0x001000  page tables (PML4, PDPT, the first 2 MiB's 4 KiB table, 2 MiB-page directories), read-only
    0x01F000  not mapped: guard below the stack
    0x020000  stack, growing down from 0x1FF000
    0x1FF000  return page: one ``hlt``, the return address of every call, so a call ends there
    0x200000  loaded objects (PT_LOAD segments at base + p_vaddr), 2 MiB pages from here on
    0x600000  heap: put / alloc / put_struct, a bump allocator emptied by reset_heap
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import mmap
import os
import struct
import subprocess
import tempfile
from pathlib import Path

import numpy as np

_CSRC = Path(__file__).resolve().parent / "csrc"
_SHIM_SOURCE = _CSRC / "emu_isoc23_shim.c"

PAGE = 0x1000
HUGE_PAGE = 0x200000
_PML4, _PDPT, _LOW_TABLE, _DIRECTORIES = 0x1000, 0x2000, 0x3000, 0x4000
_GUARD, _STACK_BOTTOM, _STACK_TOP = 0x1F000, 0x20000, 0x1FF000
_RETURN = 0x1FF000
_IMAGE_BASE, _HEAP_BASE = 0x200000, 0x600000
_PRESENT, _WRITABLE, _HUGE = 0x1, 0x2, 0x80

# System V AMD64 integer argument registers, in order.
_ARGUMENT_REGISTERS = ("rdi", "rsi", "rdx", "rcx", "r8", "r9")
_VECTORS = {0: "#DE (divide error)", 6: "#UD (invalid opcode: an instruction the emulated CPU lacks)",
            7: "#NM (device not available)", 12: "#SS (stack fault)", 13: "#GP (general protection)",
            14: "#PF (page fault)", 16: "#MF (x87 error)", 17: "#AC (alignment check)",
            19: "#XM (SIMD floating-point exception)"}


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


class BuildError(RuntimeError):
    """A compiler failed; the message holds its command and the end of its output."""


class NotALeafError(RuntimeError):
    """A shared object the emulator cannot run: it has relocations or undefined symbols (names them)."""


class GuestFault(RuntimeError):
    """The guest raised a CPU exception (#UD, #PF, #GP, ...) inside a call.

    Attributes: ``symbol`` (the function called), ``vector`` (the exception number), ``error_code``, ``rip`` (the
    faulting instruction's address), ``where`` (``function+0xoffset`` of that address), ``address`` (for a #PF,
    the address touched; else None).
    """

    def __init__(self, symbol: str, vector: int, error_code: int, rip: int, where: str, address: int | None):
        self.symbol, self.vector, self.error_code, self.rip, self.where, self.address = (
            symbol, vector, error_code, rip, where, address)
        name = _VECTORS.get(vector, f"exception {vector}")
        touched = f", touching {address:#x}" if address is not None else ""
        super().__init__(f"{name} in a call of {symbol} at {rip:#x} ({where}){touched}, error code {error_code:#x}")


# ----------------------------------------------------------------------------------------------------- import


_bochscpu_state: dict[str, object] = {}


def available() -> tuple[bool, str]:
    """Whether the emulator can run here, and why not: ``(True, "bochscpu 0.4.0")`` or ``(False, reason)``.

    Imports ``bochscpu`` (and ``elftools``), first preloading the glibc shim where glibc is older than 2.38
    (compiled with ``cc`` once, into the cache). Cached per process.
    """
    try:
        _import_bochscpu()
    except (ImportError, OSError, BuildError) as exc:
        return False, f"bochscpu cannot be imported ({exc}); pip install 'bochscpu-python==0.4.0' pyelftools"
    return True, "bochscpu " + _bochscpu_version()


def _bochscpu_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("bochscpu-python")
    except metadata.PackageNotFoundError:
        return "(version unknown)"


def _import_bochscpu():
    """The ``bochscpu`` module, with the glibc shim preloaded where needed. Raises ImportError, OSError, BuildError."""
    if "module" in _bochscpu_state:
        return _bochscpu_state["module"]
    import elftools  # noqa: F401  (the loader reads objects with it; refuse early when it is missing)

    if not hasattr(ctypes.CDLL(None), "__isoc23_strtoull"):
        # RTLD_GLOBAL: the wheel's extension resolves the symbols from this library when it is loaded next.
        ctypes.CDLL(str(_glibc_shim()), mode=ctypes.RTLD_GLOBAL)
    import bochscpu
    import bochscpu.cpu
    import bochscpu.memory

    _bochscpu_state["module"] = bochscpu
    return bochscpu


def _glibc_shim() -> Path:
    """The shim's shared library (glibc 2.38's C23 aliases forwarding to the old functions), built once."""
    return _compile([_SHIM_SOURCE], "isoc23_shim", ["-fPIC", "-shared"], base_command=["cc", "-O2"])


# ----------------------------------------------------------------------------------------------------- build

FREESTANDING_FLAGS = ["-O2", "-fPIC", "-ffreestanding", "-fno-stack-protector",
                      # gcc turns copy and fill loops into memcpy/memset calls even when freestanding
                      "-fno-tree-loop-distribute-patterns", "-fno-asynchronous-unwind-tables"]
_CXX_FLAGS = ["-std=c++17", "-fno-exceptions", "-fno-rtti"]
# -nostdlib: nothing of libc or libgcc; -Bsymbolic: calls between the object's own functions bind inside it,
# never through the PLT (which would need relocations the emulator's loader does not apply).
_FREESTANDING_LINK = ["-shared", "-nostdlib", "-Wl,-Bsymbolic"]


def cache_dir() -> Path:
    """Where emulator builds go: ``$KVSERVE_CACHE/emu`` (``~/.cache/kvserve/emu`` by default)."""
    return Path(os.environ.get("KVSERVE_CACHE", Path.home() / ".cache" / "kvserve")) / "emu"


def build_freestanding(sources: list[Path], name: str, defines: dict | None = None,
                       flags: list | None = None) -> Path:
    """Compile C/C++ ``sources`` into one freestanding shared object the emulator can load, and check it.

    ``gcc`` (``.c``) or ``g++`` (``.cpp``, ``.cc``) with ``-O2 -ffreestanding -nostdlib -fno-stack-protector``;
    choose instructions with target attributes in the source or ``-m`` options in ``flags``. Cached under
    ``cache_dir()``, keyed by the sources' bytes, the headers beside them, the defines and the flags.

    Args:
        sources: C or C++ files (absolute paths).
        name: the object's name in the cache (``NAME-HASH.so``).
        defines: ``-D`` macros, name -> value (None for a bare ``-DNAME``).
        flags: more compiler flags, e.g. ``["-mavx512f", "-I/path"]``.

    Returns:
        The shared object's path.

    Raises:
        BuildError: a compiler failed (its command and output in the message).
        NotALeafError: the object has relocations or undefined symbols (each named).
    """
    extra = [*_define_flags(defines), *(flags or [])]
    path = _compile(sources, name, extra, compile_flags=FREESTANDING_FLAGS, link_flags=_FREESTANDING_LINK)
    check_leaf(path)
    return path


def build_native(sources: list[Path], name: str, defines: dict | None = None, flags: list | None = None) -> Path:
    """Compile the same sources as an ordinary ``-O2 -shared -fPIC`` library for ``ctypes.CDLL`` on this CPU.

    Tests use it to compare a kernel run emulated with the same kernel run natively. Arguments, cache and errors
    as ``build_freestanding`` (no leaf check: libc may be linked here).
    """
    extra = [*_define_flags(defines), *(flags or [])]
    return _compile(sources, name + "-native", extra, compile_flags=["-O2", "-fPIC"], link_flags=["-shared"])


def _define_flags(defines: dict | None) -> list[str]:
    return [f"-D{key}" if value is None else f"-D{key}={value}" for key, value in (defines or {}).items()]


def _compile(sources: list[Path], name: str, flags: list[str], compile_flags: list[str] | None = None,
             link_flags: list[str] | None = None, base_command: list[str] | None = None) -> Path:
    """Compile ``sources`` to ``cache_dir()/NAME-HASH.so`` unless that exists; return its path.

    Each source is compiled on its own (gcc for C, g++ for C++), then all are linked with gcc. With
    ``base_command`` the sources go through that one command instead (``cc -O2 ... -o out``).
    """
    sources = [Path(s).resolve() for s in sources]
    if not sources:
        raise BuildError(f"{name}: no sources given")
    command_key = [*(base_command or []), *(compile_flags or []), *(link_flags or []), *flags]
    target = cache_dir() / f"{name}-{_build_key(sources, command_key)}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        output = Path(work) / target.name
        if base_command is not None:
            _run([*base_command, *flags, *map(str, sources), "-o", str(output)])
        else:
            objects = []
            for index, source in enumerate(sources):
                objects.append(Path(work) / f"{index}-{source.stem}.o")
                _run([_compiler(source), *compile_flags, *(_CXX_FLAGS if _is_cxx(source) else []), *flags,
                      "-c", str(source), "-o", str(objects[-1])])
            _run(["gcc", *link_flags, *map(str, objects), "-o", str(output)])
        os.replace(output, target)  # atomic: a concurrent build never sees half a file
    return target


def _build_key(sources: list[Path], command: list[str]) -> str:
    """16 hex digits of SHA-256 over the command, every source and every header in the sources' folders (a header
    change rebuilds; listing exact includes would need the preprocessor on every call)."""
    digest = hashlib.sha256("\0".join(command).encode())
    headers = {h for folder in {s.parent for s in sources} for pattern in ("*.h", "*.hpp")
               for h in folder.glob(pattern)}
    for path in [*sources, *sorted(headers)]:
        digest.update(str(path).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _is_cxx(source: Path) -> bool:
    return source.suffix in (".cpp", ".cc", ".cxx")


def _compiler(source: Path) -> str:
    return "g++" if _is_cxx(source) else "gcc"


def _run(command: list[str]) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise BuildError(f"{command[0]} not found: {exc}") from None
    if done.returncode != 0:
        raise BuildError(f"{' '.join(command)} failed ({done.returncode}):\n{(done.stderr or done.stdout)[-4000:]}")


def check_leaf(path: Path) -> None:
    """Raise NotALeafError unless the shared object at ``path`` has no relocations and no undefined symbols.

    What ``readelf -r`` and ``readelf --syms`` (UND) would show, read with pyelftools. The emulator's loader maps
    the segments as they are, so a relocation (a pointer in data, a PLT slot) or an undefined symbol (a call to
    libc, memset or a compiler helper) would run wrong or jump to nowhere.
    """
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as file:
        elf = ELFFile(file)
        relocations = _relocations(elf)
        undefined = sorted({s.name for section in elf.iter_sections() if section["sh_type"] in ("SHT_SYMTAB", "SHT_DYNSYM")
                            for s in section.iter_symbols() if s.name and s["st_shndx"] == "SHN_UNDEF"})
    problems = []
    if undefined:
        problems.append(f"undefined symbols {', '.join(undefined)} (calls outside the object: a leaf may use no "
                        "libc, no memset/memcpy, no compiler runtime)")
    if relocations:
        shown = ", ".join(relocations[:8]) + (f", ... ({len(relocations)} in all)" if len(relocations) > 8 else "")
        problems.append(f"relocations {shown} (pointers in data or calls through the PLT: keep data pointers in "
                        "the argument struct)")
    if problems:
        raise NotALeafError(f"{Path(path).name} is not a leaf the emulator can run: " + "; ".join(problems))


def _relocations(elf) -> list[str]:
    """``TYPE symbol at 0xOFFSET`` for every relocation entry of every relocation section."""
    from elftools.elf.descriptions import describe_reloc_type

    found = []
    for section in elf.iter_sections():
        if section["sh_type"] not in ("SHT_RELA", "SHT_REL"):
            continue
        symbols = elf.get_section(section["sh_link"]) if section["sh_link"] else None
        for entry in section.iter_relocations():
            symbol = symbols.get_symbol(entry["r_info_sym"]).name if symbols and entry["r_info_sym"] else ""
            kind = describe_reloc_type(entry["r_info_type"], elf)
            found.append(f"{kind}{' ' + symbol if symbol else ''} at {entry['r_offset']:#x}")
    return found


# ----------------------------------------------------------------------------------------------------- CPU model

_process_model: list[CpuModel] = []  # the one model this process emulates, once an Emulator has been made


def select_cpu_model(model: CpuModel) -> None:
    """Make the next emulated CPU a ``model``, by setting Bochs' ``cpu.model`` parameter (before its Session).

    The wheel exposes no setter: the parameter object is found through Bochs' own ``get_param_enum`` and its value
    written in place, after checking that the object's layout is the one this was written against.

    Raises:
        EmulatorError: the parameter's layout differs (another bochscpu build): refusing rather than writing
            into memory whose meaning is unknown.
    """
    bochscpu = _import_bochscpu()
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


def _claim_model(model: CpuModel) -> None:
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


# ----------------------------------------------------------------------------------------------------- emulator

_open_emulator: list["Emulator"] = []  # Bochs maps guest pages globally: one Emulator at a time


class Emulator:
    """One emulated x86-64 core with its own guest memory; a context manager (``with Emulator() as emu:``).

    Args:
        cpu_model: the CPU emulated (the first Emulator of a process fixes it for the process).
        memory_mib: guest RAM in MiB, a multiple of 2; the heap gets all of it above 6 MiB.

    Raises:
        EmulatorError: bochscpu is missing, another Emulator is open, or another model was used in this process.
    """

    def __init__(self, cpu_model: CpuModel = CpuModel.SAPPHIRE_RAPIDS, memory_mib: int = 64):
        ok, reason = available()
        if not ok:
            raise EmulatorError(reason)
        if memory_mib % 2 or memory_mib < 8:
            raise EmulatorError(f"memory_mib={memory_mib}: need an even number >= 8")
        _claim_model(cpu_model)
        if _open_emulator:
            raise EmulatorError("another Emulator is open; close it first (Bochs maps guest memory globally)")
        self._bochscpu = _import_bochscpu()
        self.cpu_model = cpu_model
        self.size = memory_mib << 20
        self._mmap = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.memory = np.frombuffer(self._mmap, dtype=np.uint8)  # [size] bytes: guest physical memory
        host = ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))
        for offset in range(0, self.size, PAGE):
            self._bochscpu.memory.page_insert(offset, host + offset)
        _open_emulator.append(self)
        self._session = self._bochscpu.Session()
        self._session.missing_page_handler = _missing_page
        self._write_page_tables()
        self.memory[_RETURN] = 0xF4  # hlt
        self.symbols: dict[str, int] = {}       # function name -> guest address
        self._functions: list[tuple[int, int, str]] = []  # (start, size, name), for naming a faulting address
        self._image_end = _IMAGE_BASE
        self._heap = _HEAP_BASE

    def __enter__(self) -> "Emulator":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Unmap guest memory from Bochs and drop the session; the Emulator is unusable afterwards."""
        if self not in _open_emulator:
            return
        for offset in range(0, self.size, PAGE):
            self._bochscpu.memory.page_remove(offset)
        self._session = None
        _open_emulator.remove(self)

    def __del__(self) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------- memory

    def _write_u64(self, address: int, value: int) -> None:
        self.memory[address:address + 8] = np.frombuffer(struct.pack("<Q", value), np.uint8)

    def _write_page_tables(self) -> None:
        """Identity map: 4 KiB pages below 2 MiB (page 0, the guard and the tables themselves left unwritable or
        absent), 2 MiB pages above."""
        huge_pages = self.size // HUGE_PAGE
        directories = -(-huge_pages // 512)  # one page directory maps 1 GiB
        if _DIRECTORIES + directories * PAGE > _GUARD:
            raise EmulatorError(f"guest RAM of {self.size >> 20} MiB needs more page directories than fit")
        self._write_u64(_PML4, _PDPT | _PRESENT | _WRITABLE)
        for index in range(directories):
            self._write_u64(_PDPT + 8 * index, (_DIRECTORIES + index * PAGE) | _PRESENT | _WRITABLE)
        self._write_u64(_DIRECTORIES, _LOW_TABLE | _PRESENT | _WRITABLE)
        for page in range(1, HUGE_PAGE // PAGE):
            address = page * PAGE
            if _GUARD <= address < _STACK_BOTTOM:
                continue
            writable = _WRITABLE if address >= _STACK_BOTTOM and address != _RETURN else 0
            self._write_u64(_LOW_TABLE + 8 * page, address | _PRESENT | writable)
        for index in range(1, huge_pages):
            self._write_u64(_DIRECTORIES + 8 * index, (index * HUGE_PAGE) | _PRESENT | _WRITABLE | _HUGE)

    def alloc(self, nbytes: int, align: int = 64) -> int:
        """``nbytes`` of zeroed guest memory aligned to ``align`` bytes; returns its guest address.

        Raises:
            EmulatorError: guest RAM is exhausted (make the Emulator with a larger ``memory_mib``, or reset_heap).
        """
        start = -(-self._heap // align) * align
        if start + nbytes > self.size:
            raise EmulatorError(f"guest RAM exhausted: {nbytes} bytes asked, {self.size - start} left of "
                                f"{self.size >> 20} MiB (pass a larger memory_mib, or reset_heap())")
        self.memory[start:start + nbytes] = 0
        self._heap = start + nbytes
        return start

    def put(self, array: np.ndarray, align: int = 64) -> int:
        """Copy ``array`` (C order) into guest memory; returns its guest address."""
        array = np.ascontiguousarray(array)
        address = self.alloc(array.nbytes, align)
        self.memory[address:address + array.nbytes] = array.reshape(-1).view(np.uint8)
        return address

    def put_struct(self, value: ctypes.Structure) -> int:
        """Copy a ctypes struct into guest memory at its natural alignment; returns its guest address.

        Pointer fields must hold guest addresses (from put/alloc): declare them ``ctypes.c_uint64`` or
        ``ctypes.c_void_p`` and assign the integers. The layout is ctypes', which is the C compiler's on x86-64.
        """
        data = bytes(value)
        address = self.alloc(len(data), max(ctypes.alignment(value), 8))
        self.memory[address:address + len(data)] = np.frombuffer(data, np.uint8)
        return address

    def get(self, address: int, count: int, dtype) -> np.ndarray:
        """A copy of ``count`` elements of ``dtype`` at guest ``address``: ndarray ``[count]``."""
        dtype = np.dtype(dtype)
        end = address + count * dtype.itemsize
        if address < 0 or end > self.size:
            raise EmulatorError(f"get({address:#x}, {count}, {dtype}) reaches past guest RAM ({self.size:#x})")
        return self.memory[address:end].view(dtype).copy()

    def reset_heap(self) -> None:
        """Forget every put/alloc: the heap starts again at its base (loaded objects stay)."""
        self._heap = _HEAP_BASE

    # ------------------------------------------------------------------------------------------------- loader

    def load(self, path: Path) -> dict[str, int]:
        """Map a leaf shared object's segments into guest memory and learn its functions.

        Returns:
            Every function loaded so far, name -> guest address (also ``self.symbols``).

        Raises:
            NotALeafError: the object has relocations or undefined symbols.
            EmulatorError: it does not fit below the heap, or defines a function another loaded object has.
        """
        from elftools.elf.elffile import ELFFile

        check_leaf(path)
        base = -(-self._image_end // HUGE_PAGE) * HUGE_PAGE if self._image_end > _IMAGE_BASE else _IMAGE_BASE
        with open(path, "rb") as file:
            elf = ELFFile(file)
            segments = [s for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
            end = base + max(s["p_vaddr"] + s["p_memsz"] for s in segments)
            if end > _HEAP_BASE:
                raise EmulatorError(f"{Path(path).name} does not fit: it would end at {end:#x}, the heap starts at "
                                    f"{_HEAP_BASE:#x}")
            for segment in segments:
                start, data = base + segment["p_vaddr"], segment.data()
                self.memory[start:start + segment["p_memsz"]] = 0
                self.memory[start:start + len(data)] = np.frombuffer(data, np.uint8)
            self._learn_functions(elf, base, Path(path).name)
        self._image_end = end
        return dict(self.symbols)

    def _learn_functions(self, elf, base: int, object_name: str) -> None:
        for section in elf.iter_sections():
            if section["sh_type"] not in ("SHT_SYMTAB", "SHT_DYNSYM"):
                continue
            for symbol in section.iter_symbols():
                if symbol["st_info"]["type"] != "STT_FUNC" or not symbol["st_value"]:
                    continue
                address = base + symbol["st_value"]
                if self.symbols.get(symbol.name, address) != address:
                    raise EmulatorError(f"{object_name} defines {symbol.name}, which a loaded object already has")
                if symbol.name not in self.symbols:
                    self.symbols[symbol.name] = address
                    self._functions.append((address, symbol["st_size"], symbol.name))

    def where(self, address: int) -> str:
        """``function+0xoffset`` for a guest code address, or the bare address outside every loaded function."""
        for start, size, name in self._functions:
            if start <= address < start + max(size, 1):
                return f"{name}+{address - start:#x}"
        return f"{address:#x}, outside every loaded function"

    # ------------------------------------------------------------------------------------------------- calls

    def call(self, symbol: str, *args: int) -> int:
        """Run the loaded function ``symbol`` with up to six integer or pointer arguments until it returns.

        Args:
            symbol: a function of a loaded object.
            args: integers (guest addresses for pointers), passed in rdi, rsi, rdx, rcx, r8, r9; negative values
                as two's complement.

        Returns:
            rax when it returned, as an unsigned 64-bit integer (mask or convert for narrower or signed results).

        Raises:
            KeyError: no loaded object defines ``symbol``.
            ValueError: more than six arguments.
            GuestFault: a CPU exception inside the call (#UD for an instruction the emulated CPU lacks, #PF for a
                bad pointer, ...), naming the symbol and the faulting address.
            EmulatorError: the guest stopped elsewhere than its return (a stray ``hlt``).
        """
        if self not in _open_emulator:
            raise EmulatorError("this Emulator is closed")
        if symbol not in self.symbols:
            raise KeyError(f"{symbol}: not a function of any loaded object (loaded: {', '.join(sorted(self.symbols))})")
        if len(args) > len(_ARGUMENT_REGISTERS):
            raise ValueError(f"{symbol}: {len(args)} arguments; a leaf takes at most 6 (pass a struct pointer)")
        self._session.cpu.state = self._entry_state(self.symbols[symbol], args)
        stops: list[tuple] = []
        self._session.run([self._hooks(stops)])
        if not stops:
            raise EmulatorError(f"{symbol}: the emulator stopped without a return or an exception")
        if stops[0][0] == "exception":
            _, vector, error_code, rip, cr2 = stops[0]
            raise GuestFault(symbol, vector, error_code, rip, self.where(rip), cr2 if vector == 14 else None)
        rip = stops[0][1]
        if rip != _RETURN + 1:  # hlt leaves rip after itself
            raise EmulatorError(f"{symbol}: stopped at a hlt at {rip - 1:#x} ({self.where(rip - 1)}), not its return")
        return self._session.cpu.rax & 0xFFFFFFFFFFFFFFFF

    def _hooks(self, stops: list[tuple]):
        hooks = self._bochscpu.Hook()

        def on_hlt(session, cpu_id):
            stops.append(("hlt", session.cpu.rip))
            session.stop()

        def on_exception(session, cpu_id, vector, error_code):
            stops.append(("exception", vector, error_code, session.cpu.rip, session.cpu.cr2))
            session.stop()

        hooks.hlt = on_hlt
        hooks.exception = on_exception
        return hooks

    def _entry_state(self, rip: int, args: tuple[int, ...]):
        """Long mode, ring 0, flat segments, SSE/AVX/AVX-512 state enabled, the arguments in their registers and
        the return page as the return address (rsp % 16 == 8 at entry, as after a call)."""
        bochscpu = self._bochscpu
        state = bochscpu.State()
        bochscpu.cpu.set_long_mode(state)
        cr4 = bochscpu.cpu.ControlRegister(state.cr4)
        cr4.OSFXSR = cr4.OSXMMEXCPT = cr4.OSXSAVE = True  # SSE, SIMD exceptions, XSAVE (needed for AVX)
        state.cr4 = int(cr4)
        state.cr3 = _PML4
        state.xcr0 = 0xE7     # x87 | SSE | AVX | opmask | ZMM_Hi256 | Hi16_ZMM: AVX-512 state enabled
        state.mxcsr = 0x1F80  # all SIMD exceptions masked, round to nearest, no DAZ/FTZ: Linux's default
        state.fpcw = 0x37F
        state.rflags = 0x2
        state.cs = _segment(bochscpu, 0x10, 0x209B)  # present, DPL 0, code, 64-bit (L)
        data = _segment(bochscpu, 0x18, 0xC093)      # present, DPL 0, data, read/write
        state.ss = state.ds = state.es = state.fs = state.gs = data
        for register, value in zip(_ARGUMENT_REGISTERS, args):
            setattr(state, register, int(value) & 0xFFFFFFFFFFFFFFFF)
        rsp = _STACK_TOP - 8
        self._write_u64(rsp, _RETURN)
        state.rsp = rsp
        state.rip = rip
        return state


class Native:
    """The same interface as Emulator (put, alloc, put_struct, get, call, reset_heap) over a library loaded with
    ctypes and run on this CPU, so one test body runs a kernel emulated and natively (``build_native``).

    Addresses are host addresses of buffers this object keeps alive until reset_heap or close.
    """

    def __init__(self, path: Path):
        self._library = ctypes.CDLL(str(path))
        self._keep: list = []

    def __enter__(self) -> "Native":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Drop every buffer (the library stays loaded: ctypes never unloads one)."""
        self._keep.clear()

    def alloc(self, nbytes: int, align: int = 64) -> int:
        """``nbytes`` of zeroed host memory aligned to ``align`` bytes; returns its address."""
        raw = np.zeros(nbytes + align, np.uint8)
        self._keep.append(raw)
        return -(-raw.ctypes.data // align) * align

    def put(self, array: np.ndarray, align: int = 64) -> int:
        """Copy ``array`` (C order) into memory kept alive here; returns its address."""
        array = np.ascontiguousarray(array)
        address = self.alloc(array.nbytes, align)
        ctypes.memmove(address, array.ctypes.data, array.nbytes)
        return address

    def put_struct(self, value: ctypes.Structure) -> int:
        """Copy a ctypes struct (pointer fields holding addresses from put/alloc); returns its address."""
        data = bytes(value)
        address = self.alloc(len(data), max(ctypes.alignment(value), 8))
        ctypes.memmove(address, data, len(data))
        return address

    def get(self, address: int, count: int, dtype) -> np.ndarray:
        """A copy of ``count`` elements of ``dtype`` at ``address``: ndarray ``[count]``."""
        dtype = np.dtype(dtype)
        return np.frombuffer(ctypes.string_at(address, count * dtype.itemsize), dtype).copy()

    def reset_heap(self) -> None:
        """Drop every buffer handed out so far."""
        self._keep.clear()

    def call(self, symbol: str, *args: int) -> int:
        """Call ``symbol`` with integer or pointer arguments; returns its 64-bit result as unsigned."""
        function = getattr(self._library, symbol)
        function.argtypes = [ctypes.c_uint64] * len(args)
        function.restype = ctypes.c_uint64
        return function(*(int(a) & 0xFFFFFFFFFFFFFFFF for a in args))


def host_cpu_flags() -> set[str]:
    """This CPU's feature flags as Linux names them in /proc/cpuinfo (``avx512_vnni``, ...); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def _segment(bochscpu, selector: int, attributes: int):
    segment = bochscpu.Segment()
    segment.present = True
    segment.selector = selector
    segment.base = 0
    segment.limit = 0xFFFFFFFF
    segment.attr = attributes
    return segment


def _missing_page(physical_address: int) -> None:
    # The page tables map only inserted pages, so Bochs never asks for another; if it does, say where.
    raise EmulatorError(f"the guest touched guest-physical {physical_address:#x}, outside its RAM")
