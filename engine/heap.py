"""The C heap while a model loads: freed copies go back to the OS instead of staying resident.

Imports nothing but the standard library (a fresh process tests it without torch).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Iterator
from contextlib import contextmanager

# glibc's mallopt parameter and the largest value its dynamic threshold reaches on a 64-bit machine (man 3 mallopt)
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20
_LOADING_MMAP_THRESHOLD = 256 << 10


@functools.cache
def _glibc():
    """The C library's handle where it is glibc (it has ``malloc_trim``), else None."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


@contextmanager
def loading_heap() -> Iterator[bool]:
    """Run a model's loading (and the server's assembly) with a heap that gives freed memory back to the OS.

    Loading frees nearly as much as it keeps: blocks are copied into the kernels' order or stacked into fused
    projections and the parts dropped. With glibc's default, a free of an mmapped chunk raises the size from which
    allocations are mmapped (up to 32 MiB), so most of the later copies land in the heap, and the parts freed
    there stay resident as holes the next, larger copy does not fit: on a 1B-parameter GGUF file the start's peak
    resident set was several hundred MiB above its resident set at rest, which kept that much besides
    (``python -m kvserve.loadtest ready`` measures both). Inside this context an allocation of 256 KiB or more
    that no free chunk of the heap holds is its own mapping, given back when freed; on leaving, the threshold is set to 32 MiB (where the dynamic
    one ends after such frees, so serving allocates as it would have) and ``malloc_trim`` returns the heap's free
    pages (man 3 mallopt, malloc_trim).

    Yields:
        whether the heap is managed: False where the C library is not glibc (nothing is changed then).
    """
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, _LOADING_MMAP_THRESHOLD)
    try:
        yield libc is not None
    finally:
        if libc is not None:
            libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
            libc.malloc_trim(0)


def give_back() -> bool:
    """Return the C heap's free pages to the OS now (``malloc_trim``): after a one-time build whose transients
    outweigh what it keeps (llguidance's tokenizer, engine.constraints). Returns whether the heap is glibc's."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
    return libc is not None
