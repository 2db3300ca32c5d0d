"""The emulated-or-native runner that the leaf tests share (tests/test_*_emulated.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvserve.native import emulate


def leaf_runner(param: str, build: Callable[..., Path]) -> Iterator[emulate.Emulator | emulate.Native]:
    """Yield ``build()``'s leaves loaded in the CPU emulator (a Sapphire Rapids core) for ``param`` "emulated"
    (skipping, with the reason, where the emulator cannot run), or ``build(native=True)`` on this CPU (ctypes)."""
    if param == "emulated":
        available, reason = emulate.available()
        if not available:
            pytest.skip(reason)
        with emulate.Emulator(emulate.CpuModel.SAPPHIRE_RAPIDS) as emu:
            emu.load(build())
            yield emu
    else:
        with emulate.Native(build(native=True)) as native:
            yield native
