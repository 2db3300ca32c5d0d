"""The emulated-or-native runner that the leaf tests share (tests/test_*_emulated.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvserve.native import emulate


@functools.cache
def _objects(build: Callable[..., Path]) -> dict[str, Path | Exception]:
    """``build``'s freestanding object (only where the emulator runs) and its native one, compiled at once on two
    threads: on a cold cache each is one long compiler process, so the pair costs the longer of the two, not their
    sum. A failed build is kept as its exception and raised by the runner that needs it."""
    jobs = {"native": functools.partial(build, native=True)}
    if emulate.available()[0]:
        jobs["emulated"] = build
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {param: pool.submit(job) for param, job in jobs.items()}
    return {param: future.exception() or future.result() for param, future in futures.items()}


def _object(param: str, build: Callable[..., Path]) -> Path:
    built = _objects(build)[param]
    if isinstance(built, Exception):
        raise built
    return built


def leaf_runner(param: str, build: Callable[..., Path]) -> Iterator[emulate.Emulator | emulate.Native]:
    """Yield ``build()``'s leaves loaded in the CPU emulator (a Sapphire Rapids core) for ``param`` "emulated"
    (skipping, with the reason, where the emulator cannot run), or ``build(native=True)`` on this CPU (ctypes)."""
    if param == "emulated":
        available, reason = emulate.available()
        if not available:
            pytest.skip(reason)
        with emulate.Emulator(emulate.CpuModel.SAPPHIRE_RAPIDS) as emu:
            emu.load(_object(param, build))
            yield emu
    else:
        with emulate.Native(_object(param, build)) as native:
            yield native
