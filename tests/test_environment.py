"""Every environment variable kvserve reads is in kvserve/environment.py, its table in docs/operations.md, and
``kvserve serve --help``; a bad value stops start-up; the earlier name of the kernels' switch still works."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve import environment

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "scheduler", "kvcache", "engine", "quant", "native", "planner", "clients", "loadtest")


def test_no_module_but_environment_reads_a_kvserve_variable():
    readers = []
    for folder in PACKAGES:
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            if re.search(r"""(environ(\.get)?|getenv)\s*[\[(]\s*["']KVSERVE_""", text):
                readers.append(str(path.relative_to(ROOT)))
    assert readers == [], f"read KVSERVE_* through kvserve.environment: {readers}"


def test_the_docs_table_and_help_list_every_variable():
    doc = (ROOT / "docs" / "operations.md").read_text().split("## Environment variables kvserve reads")[1]
    documented = re.findall(r"^\| `([A-Z_]+)` \|", doc, re.M)
    assert documented == [v.name for v in environment.VARIABLES]
    text = environment.help_text()
    assert all(v.name in text for v in environment.VARIABLES)


def test_values_are_checked_and_the_earlier_name_is_read(monkeypatch):
    monkeypatch.delenv("KVSERVE_NATIVE_KERNELS", raising=False)
    monkeypatch.setenv("KVSERVE_QUANT_KERNELS", "0")
    assert not environment.native_kernels_on()
    assert any("use KVSERVE_NATIVE_KERNELS" in line for line in environment.check())
    monkeypatch.setenv("KVSERVE_NATIVE_KERNELS", "1")  # the new name wins
    assert environment.native_kernels_on()
    monkeypatch.setenv("KVSERVE_ISA", " AVX2 ")
    assert environment.forced_isa() == "avx2"
    monkeypatch.setenv("KVSERVE_ISA", "sse9")
    with pytest.raises(ValueError, match="KVSERVE_ISA='sse9': expected one of scalar, avx2, avx512"):
        environment.check()


def test_serve_refuses_a_bad_switch_before_loading_anything():
    done = subprocess.run([sys.executable, "-m", "kvserve.server.cli", "serve", "--port", "1"], capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "KVSERVE_FASTPATH": "maybe",
                                                       "HOME": str(Path.home())})
    assert done.returncode == 2, done.stderr[-2000:]
    assert "KVSERVE_FASTPATH='maybe': expected one of 0, 1" in done.stderr
    assert "Loading" not in done.stderr


def test_openmp_threads_spin_briefly_unless_the_environment_says():
    env: dict[str, str] = {}
    assert environment.bound_openmp_spin(env) and env == {"GOMP_SPINCOUNT": "1000"}
    for given in ({"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "passive"}):
        env = dict(given)
        assert not environment.bound_openmp_spin(env) and env == given
    # the server's process has it before torch loads: libgomp reads it once, at load
    code = ("import os, sys; from kvserve.server import cli; cli.build_parser = lambda argv: sys.exit(0 if "
            "os.environ.get('GOMP_SPINCOUNT') == '1000' and 'torch' not in sys.modules else 3); cli.main(['serve'])")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == 0
