"""The GGUF micro-kernels (``csrc/ukernel*.h``) built freestanding, for the CPU emulator (``kernels.emulate``).

The extension compiles the same headers (``csrc/linear_ggml.cpp``); here ``csrc/leaves.c`` becomes a shared object
of leaf functions alone: no libc (``-ffreestanding -nostdlib``), no stack protector, no position-independent code
and no jump tables, so it has no relocations and no undefined symbols, and a loader that only copies its
segments can run it. ``-mfma`` lets the scalar kernels' ``fmaf`` be the one instruction instead of a libm call
(the same correctly rounded result). ``Args`` mirrors ``kv_ggml_args`` for callers that lay one out in memory.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE = CSRC / "leaves.c"
FLAGS = ("-O2", "-ffreestanding", "-nostdlib", "-fno-stack-protector", "-fno-pic", "-fno-jump-tables",
         "-fno-tree-loop-distribute-patterns", "-mfma", "-shared")
KINDS = ("q4_1", "q8_0")
ISAS = ("scalar", "avx2", "avx512")
SYMBOLS = tuple(f"kv_{kind}_{isa}" for kind in KINDS for isa in ISAS)
# Panel widths and register tile rows (ukernel.h's KV_NR_* / KV_MR_*) per ISA; the scalar kernel reads any width.
NR = {"avx2": 8, "avx512": 16}
MR = {"avx2": 4, "avx512": 8}
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}


class Args(ctypes.Structure):
    """``kv_ggml_args`` (csrc/ukernel.h), field for field: pointers as 64-bit addresses."""

    _fields_ = [("w", ctypes.c_uint64), ("xq", ctypes.c_uint64), ("xd", ctypes.c_uint64), ("xs", ctypes.c_uint64),
                ("xsum", ctypes.c_uint64), ("y", ctypes.c_uint64), ("ldq", ctypes.c_int64),
                ("ldb", ctypes.c_int64), ("ldy", ctypes.c_int64), ("nb", ctypes.c_int32),
                ("rows", ctypes.c_int32), ("cols", ctypes.c_int32), ("nr", ctypes.c_int32)]


def build(out_dir: Path | None = None, compiler: str | None = None) -> Path:
    """Compile ``csrc/leaves.c`` freestanding (again only when a source is newer) and return the .so's path.

    Args:
        out_dir: where the library goes; default ``$TORCH_EXTENSIONS_DIR`` (or ``~/.cache/kvserve``)/leaves.
        compiler: a C compiler; default ``$CC`` or ``cc``.

    Raises:
        subprocess.CalledProcessError: the compiler failed (its message is in the exception's stderr).
    """
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvserve")
    out_dir = Path(out_dir or Path(base) / "leaves")
    out_dir.mkdir(parents=True, exist_ok=True)
    library = out_dir / "kvserve_leaves.so"
    newest = max(p.stat().st_mtime for p in [SOURCE, *CSRC.glob("ukernel*.h")])
    if not library.exists() or library.stat().st_mtime < newest:
        partial = library.with_suffix(f".{os.getpid()}.tmp")  # another process may be loading the old one
        subprocess.run([compiler or os.environ.get("CC", "cc"), *FLAGS, str(SOURCE), "-o", str(partial)], check=True,
                       capture_output=True, text=True)
        partial.replace(library)
    return library
