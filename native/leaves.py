"""Leaf shared objects: built freestanding for the CPU emulator (native/emulate.py) or natively for ctypes, and
checked to be leaves.

A *leaf* calls nothing outside its object (no libc, no memset, no OpenMP, no allocation), has no relocations and
takes at most six integer or pointer arguments: what the emulator's loader can map and run as it is. kvserve's
micro-kernels are leaves taking one pointer to an argument struct. ``Native`` runs the same sources on this CPU
with the Emulator's interface, so one test body compares both.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from kvserve import environment

CSRC = Path(__file__).resolve().parent / "csrc"


class BuildError(RuntimeError):
    """A compiler failed; the message holds its command and the end of its output."""


class NotALeafError(RuntimeError):
    """A shared object the emulator cannot run: it has relocations or undefined symbols (names them)."""


FREESTANDING_FLAGS = ["-O2", "-fPIC", "-ffreestanding", "-fno-stack-protector",
                      # gcc turns copy and fill loops into memcpy/memset calls even when freestanding
                      "-fno-tree-loop-distribute-patterns", "-fno-asynchronous-unwind-tables"]
_CXX_FLAGS = ["-std=c++17", "-fno-exceptions", "-fno-rtti"]
# -nostdlib: nothing of libc or libgcc; -Bsymbolic: calls between the object's own functions bind inside it,
# never through the PLT (which would need relocations the emulator's loader does not apply).
_FREESTANDING_LINK = ["-shared", "-nostdlib", "-Wl,-Bsymbolic"]


def cache_dir() -> Path:
    """Where emulator builds go: ``$KVSERVE_CACHE/emu`` (``~/.cache/kvserve/emu`` by default)."""
    return environment.cache_dir() / "emu"


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
    path = compile_shared(sources, name, extra, compile_flags=FREESTANDING_FLAGS, link_flags=_FREESTANDING_LINK)
    check_leaf(path)
    return path


def build_native(sources: list[Path], name: str, defines: dict | None = None, flags: list | None = None) -> Path:
    """Compile the same sources as an ordinary ``-O2 -shared -fPIC`` library for ``ctypes.CDLL`` on this CPU.

    Tests use it to compare a kernel run emulated with the same kernel run natively. Arguments, cache and errors
    as ``build_freestanding`` (no leaf check: libc may be linked here).
    """
    extra = [*_define_flags(defines), *(flags or [])]
    return compile_shared(sources, name + "-native", extra, compile_flags=["-O2", "-fPIC"], link_flags=["-shared"])


def _define_flags(defines: dict | None) -> list[str]:
    return [f"-D{key}" if value is None else f"-D{key}={value}" for key, value in (defines or {}).items()]


def compile_shared(sources: list[Path], name: str, flags: list[str], compile_flags: list[str] | None = None,
                   link_flags: list[str] | None = None, base_command: list[str] | None = None) -> Path:
    """Compile ``sources`` into the shared object ``cache_dir()/NAME-HASH.so`` unless it exists; return its path.

    Each source is compiled on its own (gcc for C, g++ for C++, with ``compile_flags`` then ``flags``), then all
    are linked by gcc with ``link_flags``. With ``base_command`` the sources go through that one command instead
    (``cc -O2 FLAGS SOURCES -o OUT``). The key hashes every part of the command and the inputs (``_build_key``).

    Raises:
        BuildError: no sources, no compiler, or a compiler failed.
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
