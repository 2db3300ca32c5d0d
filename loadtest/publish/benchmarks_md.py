"""Write one section of BENCHMARKS.md, leaving the other benchmarks' sections as they are.

Each benchmark owns the text between ``<!-- BEGIN name -->`` and ``<!-- END name -->``; a section is
stamped with the command that produced it, the machine and the date.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "BENCHMARKS.md"
_HEADER = "# kvserve benchmarks\n\nEvery figure below comes from the command printed with it; rerun it to refresh its section.\n"


def machine() -> str:
    """A one-line description of this machine (CPU model and its widest vector ISA, cores, memory).

    The ISA is named because one CPU model string ("AMD EPYC") covers machines whose kernels and bfloat16
    support differ (AVX2 only, or AVX-512 with BF16).
    """
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    isa = next((label for flag, label in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX-512 BF16"),
                                          ("avx512f", "AVX-512"), ("avx2", "AVX2")) if flag in flags), None)
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    text = f"{cpu}{f' ({isa})' if isa else ''}, {os.cpu_count()} cores, {mem_gib:.0f} GiB"
    torch = sys.modules.get("torch")  # never imported just for this line
    if torch is not None and torch.cuda.is_available():
        text += f", GPU {torch.cuda.get_device_name()}"
    return text


def update_section(name: str, title: str, command: str, body_markdown: str, path: Path = BENCHMARKS) -> None:
    """Replace (or append) the section ``name`` of BENCHMARKS.md.

    Args:
        name: section key, e.g. ``"compare"``.
        title: the section heading.
        command: the exact command that produced the figures.
        body_markdown: tables and prose.
    """
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
