"""Every environment variable kvserve's own code reads, in one table, and the one place that reads them.

A variable is a switch for debugging or a path, never a serving setting (those are ``kvserve serve`` flags; the
container's ``KVSERVE_*`` settings are flags too, which ``docker/entrypoint.sh`` turns into them). ``kvserve
serve --help`` prints this table (``help_text``), docs/operations.md lists it, and ``check`` reads every switch
at start-up so that a bad value stops the server before it loads anything.

The values are read when asked (``value``), not once at import: the kernels' build, the lean forward and the
weight cache are each set up once per process anyway, and tests set a variable for one subprocess.

This module imports nothing of kvserve and no third-party package, so that every layer may read it.
"""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Variable:
    """One environment variable.

    Attributes:
        name: its name.
        default: the value when unset (a description for a path).
        does: what it does, in one line.
        choices: the values it takes (empty: any).
        replaces: an earlier name still read, with a warning (``check``), when the new one is unset.
    """

    name: str
    default: str
    does: str
    choices: tuple[str, ...] = ()
    replaces: str | None = None


FASTPATH = Variable("KVSERVE_FASTPATH", "1", "0 runs transformers' own forward instead of the lean Llama-family one "
                    "(engine/fastpath.py): a debugging switch", ("0", "1"))
NATIVE_KERNELS = Variable("KVSERVE_NATIVE_KERNELS", "1", "0 turns off every C++ kernel (projections, RMSNorm, RoPE, "
                          "attention): pure PyTorch, for debugging", ("0", "1"), replaces="KVSERVE_QUANT_KERNELS")
ISA = Variable("KVSERVE_ISA", "the best the CPU has", "forces the kernels' instruction-set path (a lesser one on "
               "any CPU; a greater one than the CPU has falls back to the best it has)", ("scalar", "avx2", "avx512"))
AMX = Variable("KVSERVE_AMX", "1", "0 keeps GGUF prefill chunks and decode batches off AMX-INT8 tiles on a CPU that "
               "runs them (the same bits either way; native/csrc/cpu.h reads it)", ("0", "1"))
CACHE = Variable("KVSERVE_CACHE", "~/.cache/kvserve", "where GGUF files' converted tokenizers (`gguf/`), quantized "
                 "codes and emulator builds are kept")
KERNEL_CACHE = Variable("KVSERVE_KERNEL_CACHE", "$KVSERVE_CACHE/kernels", "where the C++ kernels are built, one folder "
                        "per build key (sources, flags, torch and Python versions): the container prebuilds them here")
COMPILER = Variable("CXX", "c++", "the C++ compiler torch builds the kernels with; part of their build key")
HUB_OFFLINE = Variable("HF_HUB_OFFLINE", "1", "kvserve never downloads: set to 1 unless the environment says "
                       "otherwise, before transformers loads")
OPENMP_SPIN = Variable("GOMP_SPINCOUNT", "1000", "how many times the kernels' OpenMP threads spin (~25 ns each here) "
                       "before they sleep, waiting for work: set before torch loads unless it or OMP_WAIT_POLICY "
                       "is already set (libgomp's own default, 300,000, keeps a core busy for ms after each step)")
CLIENT_URL = Variable("KVSERVE_URL", "", "the server `python -m kvserve.clients` talks to (its --url; unset: "
                     "http://127.0.0.1:8000)")
CLIENT_API_KEY = Variable("KVSERVE_API_KEY", "", "the bearer token `python -m kvserve.clients` sends (its --api-key; "
                         "the container's entrypoint passes it to kvserve serve as --api-key)")

VARIABLES = (FASTPATH, NATIVE_KERNELS, ISA, AMX, CACHE, KERNEL_CACHE, COMPILER, HUB_OFFLINE, OPENMP_SPIN, CLIENT_URL,
             CLIENT_API_KEY)


def value(variable: Variable) -> str:
    """The variable's value (stripped; an ISA lower-cased), its earlier name's where only that is set, else its
    default. Paths are not validated here.

    Raises:
        ValueError: a value outside ``variable.choices`` (the message lists them).
    """
    raw = os.environ.get(variable.name)
    if raw is None and variable.replaces is not None:
        raw = os.environ.get(variable.replaces)
    if raw is None or not raw.strip():
        return variable.default
    text = raw.strip().lower() if variable.choices else raw
    if variable.choices and text not in variable.choices:
        raise ValueError(f"{variable.name}={raw!r}: expected one of {', '.join(variable.choices)} (or unset: "
                         f"{variable.default})")
    return text


def fastpath_on() -> bool:
    """Whether the lean forward may run (``KVSERVE_FASTPATH`` is not 0)."""
    return value(FASTPATH) != "0"


def native_kernels_on() -> bool:
    """Whether the C++ kernels may be built and run (``KVSERVE_NATIVE_KERNELS`` is not 0)."""
    return value(NATIVE_KERNELS) != "0"


def forced_isa() -> str | None:
    """The path ``KVSERVE_ISA`` forces, or None when unset.

    Raises:
        ValueError: a path kvserve does not have.
    """
    chosen = value(ISA)
    return None if chosen == ISA.default else chosen


def cache_dir() -> Path:
    """``$KVSERVE_CACHE``, or ``~/.cache/kvserve``."""
    chosen = value(CACHE)
    return Path.home() / ".cache" / "kvserve" if chosen == CACHE.default else Path(chosen)


def kernel_cache_dir() -> Path:
    """``$KVSERVE_KERNEL_CACHE``, or ``cache_dir() / "kernels"``."""
    chosen = value(KERNEL_CACHE)
    return cache_dir() / "kernels" if chosen == KERNEL_CACHE.default else Path(chosen)


def compiler() -> str:
    """``$CXX``, or ``c++`` (what torch's extension build runs)."""
    return value(COMPILER)


def stay_offline() -> None:
    """Tell the Hugging Face libraries never to reach a hub, unless the environment already says what to do
    (called before transformers is imported by the model loader)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def bound_openmp_spin(env: dict | None = None) -> bool:
    """Cap how long an idle OpenMP thread spins before it sleeps (``GOMP_SPINCOUNT``, default ``OPENMP_SPIN``), unless
    the environment already says (``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` set); True where it set it.

    Why: the kernels' threads are torch's OpenMP team, and libgomp reads its wait policy once, when it loads (with
    torch), so this must run first. Its default, with as many threads as cores, spins 300,000 times (~7 ms here)
    at every wait: after each decode step a worker keeps its core busy while the event loop streams the token,
    and within a step a thread whose partner was preempted burns its own turn. The serving process always has a
    third busy thread (the event loop) beside a team as large as the cores, and libgomp's manual gives 1,000 spins
    for a team larger than the machine. ``env``: the mapping to read and set (default ``os.environ``).
    """
    env = os.environ if env is None else env
    if "GOMP_SPINCOUNT" in env or "OMP_WAIT_POLICY" in env:
        return False
    env["GOMP_SPINCOUNT"] = OPENMP_SPIN.default
    return True


def check() -> list[str]:
    """Read every variable once (at start-up) and return the lines a start log shows: each one that is set, and
    a warning for an earlier name still in use.

    Raises:
        ValueError: a value a variable does not take.
    """
    lines = []
    for variable in VARIABLES:
        value(variable)
        if variable.name in os.environ:
            lines.append(f"{variable.name}={os.environ[variable.name]}")
        elif variable.replaces is not None and variable.replaces in os.environ:
            lines.append(f"{variable.replaces}={os.environ[variable.replaces]} (an earlier name: use "
                         f"{variable.name})")
    return lines


def help_text() -> str:
    """The table as ``--help`` prints it: a line per variable."""
    width = max(len(v.name) for v in VARIABLES)
    rows = [textwrap.fill(v.does + (f" (default: {v.default})" if v.default else ""), 100,
                          initial_indent=f"  {v.name:<{width}}  ", subsequent_indent=" " * (width + 4))
            for v in VARIABLES]
    return "environment variables (switches and paths, not settings):\n" + "\n".join(rows)
