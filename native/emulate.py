"""Run leaf x86-64 functions inside a CPU emulator, so AVX-512 kernel paths are tested on CPUs without AVX-512.

The emulator is Bochs' CPU core as the PyPI package ``bochscpu-python`` (pinned 0.4.0 in the ``test`` extra) ships
it, set to emulate a Sapphire Rapids core (AVX-512 F/BW/DQ/VL/VNNI/BF16/FP16, AVX-VNNI). Checked against AVX-512
hardware, it gives the same bits (``vpdpbusd`` with wrap-around, ``vdpbf16ps`` with denormals) at about 40-70
million instructions a second: a test tool, never a speed figure. Importing the wheel and choosing the emulated
CPU model live in native/bochs.py (re-exported here); this module builds the guest machine and calls into it.

What runs here is a *leaf* (native/leaves.py: built by ``build_freestanding``, re-exported here with the rest of
a kernel test's needs): a function that calls nothing outside its object, has no relocations and takes at most
six integer or pointer arguments. kvserve's micro-kernels are leaves taking one pointer to an argument struct::

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
import mmap
import struct
from pathlib import Path

import numpy as np

from kvserve.native.bochs import CpuModel, EmulatorError, available, claim_model, import_bochscpu, select_cpu_model
from kvserve.native.leaves import (CSRC, BuildError, Native, NotALeafError, build_freestanding, build_native,
                                    cache_dir, check_leaf, host_cpu_flags)

__all__ = ["CSRC", "BuildError", "CpuModel", "Emulator", "EmulatorError", "GuestFault", "Native", "NotALeafError",
           "available", "build_freestanding", "build_native", "cache_dir", "check_leaf", "host_cpu_flags",
           "select_cpu_model"]

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
        claim_model(cpu_model)
        if _open_emulator:
            raise EmulatorError("another Emulator is open; close it first (Bochs maps guest memory globally)")
        self._bochscpu = import_bochscpu()
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
        self._heap, self._top = _HEAP_BASE, self.size  # put/alloc between the two; put_at_end above _top

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
        try:
            self.close()
        except Exception:  # at interpreter exit bochscpu may be torn down first; the process unmaps all anyway
            pass

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
        if start + nbytes > self._top:
            raise EmulatorError(f"guest RAM exhausted: {nbytes} bytes asked, {self._top - start} left of "
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

    def put_at_end(self, array: np.ndarray) -> int:
        """Copy ``array`` so that it ends at the last byte of guest RAM; returns its guest address.

        Nothing is mapped after it, so a read or write past its end is a #PF (GuestFault): tests that a kernel's
        tail loads and stores are masked. Once per reset_heap (put and alloc go on below it).

        Raises:
            EmulatorError: already used since reset_heap, or no room above the heap.
        """
        array = np.ascontiguousarray(array)
        address = self.size - array.nbytes
        if self._top != self.size:
            raise EmulatorError("put_at_end: RAM's end is taken since the last reset_heap()")
        if address < self._heap:
            raise EmulatorError(f"put_at_end: {array.nbytes} bytes do not fit above the heap's top {self._heap:#x}")
        self.memory[address:] = array.reshape(-1).view(np.uint8)
        self._top = address
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
        """Forget every put/alloc/put_at_end: the heap starts again at its base (loaded objects stay)."""
        self._heap, self._top = _HEAP_BASE, self.size

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
        """Record the object's exported functions in ``symbols``, and every function (static ones too) for
        ``where``; the symbol table lists an exported function twice (.symtab and .dynsym), at one address."""
        for section in elf.iter_sections():
            if section["sh_type"] not in ("SHT_SYMTAB", "SHT_DYNSYM"):
                continue
            for symbol in section.iter_symbols():
                if symbol["st_info"]["type"] != "STT_FUNC" or not symbol["st_value"]:
                    continue
                address = base + symbol["st_value"]
                entry = (address, symbol["st_size"], symbol.name)
                if entry not in self._functions:
                    self._functions.append(entry)
                if symbol["st_info"]["bind"] == "STB_LOCAL":
                    continue
                if self.symbols.setdefault(symbol.name, address) != address:
                    raise EmulatorError(f"{object_name} defines {symbol.name}, which a loaded object already has")

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
        state.mxcsr_mask = 0xFFFF  # every MXCSR bit writable, DAZ included, as on any AVX CPU (0: ldmxcsr faults)
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
