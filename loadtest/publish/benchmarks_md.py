"""Write one section of BENCHMARKS.md, leaving the other benchmarks' sections as they are.

Each benchmark owns the text between ``<!-- BEGIN name -->`` and ``<!-- END name -->``; a section is
stamped with the command that produced it, the machine and the date. A CPU benchmark's section is one per kernel
path (``kernel_class``): a run on an AVX2-only machine, or on one with AMX tiles, writes its own section beside
the AVX-512 machine's instead of replacing it.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import sys
from pathlib import Path

from kvserve import environment, native

BENCHMARKS = Path(__file__).resolve().parents[2] / "BENCHMARKS.md"
_HEADER = "# kvserve benchmarks\n\nEvery figure below comes from the command printed with it; rerun it to refresh its section.\n"


def _cpu(cpuinfo: str | None = None) -> tuple[str, set[str]]:
    """The CPU's model name and its /proc/cpuinfo flags (empty where there is no such file); ``cpuinfo``: that
    file's text (this machine's when None).

    A model name without a model number (a VM's "AMD EPYC") gets the CPU's family and model appended: under
    that one name Zen 4 (family 25), which runs AVX-512 on 256-bit units, and Zen 5 (family 26), which runs it
    on 512-bit ones, have both been seen here, and their AVX-512 figures differ."""
    cpu, flags, ids = platform.processor() or platform.machine(), set(), {}
    try:
        for line in (Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo).splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name":
                cpu = value.strip()
            elif key in ("cpu family", "model"):
                ids[key] = value.strip()
            elif key == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    if not re.search(r"\d", cpu) and len(ids) == 2:
        cpu += f" family {ids['cpu family']} model {ids['model']}"
    return cpu, flags


def kernel_class(flags: set[str] | None = None) -> tuple[str, str, str]:
    """Which kernel path a CPU benchmark on this machine measures, as (key suffix, title suffix, command prefix).

    The AVX-512 VNNI path without AMX tiles is the reference the issues' figures are set on: ``("", "", "")``.
    A CPU with AMX-INT8 adds tiles to that path (``-amx``); an AVX2-only CPU runs the AVX2 path (``-avx2``); a
    lesser path forced with ``KVSERVE_ISA`` is that path's section, its command prefixed with the variable so
    the line reruns what was measured. The paths a CPU runs are ``native.native_isas``'s (csrc/cpu.h's rule).

    Args:
        flags: /proc/cpuinfo flags (this machine's when None).

    Raises:
        ValueError: ``KVSERVE_ISA`` names no path kvserve has.
    """
    if flags is None:
        flags = _cpu()[1]
    forced = environment.forced_isa()
    if forced is not None:
        return f"-{forced}", f" — {forced} path (forced)", f"KVSERVE_ISA={forced} "
    best = native.native_isas(flags)[-1]
    if best == "scalar":
        return "-scalar", " — scalar path", ""
    if best == "avx2":
        return "-avx2", " — AVX2 path (no AVX-512)", ""
    if "amx_int8" in flags:
        amx_off = environment.value(environment.AMX) == "0"
        return "-amx", " — AVX-512 with AMX-INT8 tiles" + (" off" if amx_off else ""), \
            "KVSERVE_AMX=0 " if amx_off else ""
    return "", "", ""


def machine() -> str:
    """A one-line description of this machine (CPU model and its widest vector ISA, cores, memory).

    The ISA is named because one CPU model string ("AMD EPYC") covers machines whose kernels and bfloat16
    support differ (AVX2 only, or AVX-512 with BF16).
    """
    cpu, flags = _cpu()
    isa = next((label for flag, label in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX-512 BF16"),
                                          ("avx512f", "AVX-512"), ("avx2", "AVX2")) if flag in flags), None)
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    text = f"{cpu}{f' ({isa})' if isa else ''}, {os.cpu_count()} cores, {mem_gib:.0f} GiB"
    torch = sys.modules.get("torch")  # never imported just for this line
    if torch is not None and torch.cuda.is_available():
        text += f", GPU {torch.cuda.get_device_name()}"
    return text


def update_section(name: str, title: str, command: str, body_markdown: str, path: Path = BENCHMARKS,
                   per_kernel_path: bool = True) -> None:
    """Replace (or append) the section ``name`` of BENCHMARKS.md.

    Args:
        name: section key, e.g. ``"compare"``.
        title: the section heading.
        command: the exact command that produced the figures.
        body_markdown: tables and prose.
        per_kernel_path: the figures depend on the CPU's kernel path: key, title and command take
            ``kernel_class()``'s suffixes (False for a GPU's figures).
    """
    if per_kernel_path:
        key, label, prefix = kernel_class()
        name, title = name + key, title + label
        command = command if command.startswith(prefix) else prefix + command
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = (f"<!-- BEGIN {name} -->\n## {title}\n\n`{command}`  \n{machine()}, {stamp}\n\n"
               f"{body_markdown.strip()}\n<!-- END {name} -->")
    text = path.read_text() if path.exists() else _HEADER
    pattern = re.compile(rf"<!-- BEGIN {re.escape(name)} -->.*?<!-- END {re.escape(name)} -->", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.write_text(text)
