"""shared/ARCHITECTURE.md's import rules, checked from the imports themselves (lazy ones inside functions too)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("server", "scheduler", "kvcache", "engine", "quant", "kernels", "planner", "clients", "loadtest")

# package -> what it must never import (kvserve packages, and the few third-party ones that matter)
FORBIDDEN = {
    "kvcache": {"server", "scheduler", "engine", "quant", "kernels", "loadtest"},  # block accounting: no model, no HTTP
    "engine": {"server", "scheduler", "loadtest"},  # the runner computes what it is told
    "scheduler": {"server", "engine", "quant", "kernels", "loadtest", "torch"},  # plans with counts and ids, no tensors
    "quant": {"engine", "kvcache", "scheduler", "server", "loadtest"},  # knows nothing of serving
    "kernels": {"server", "scheduler", "kvcache", "engine", "quant", "loadtest"},  # called by engine/ and quant/
    "clients": set(PACKAGES) - {"clients"} | {"torch"},  # HTTP only; installs without torch
}
# Exceptions by full module name: the step types (plain dataclasses) are the scheduler/engine interface.
ALLOWED = {"scheduler": {"kvserve.engine.plan"}}


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of the file (absolute imports; ``from a.b import c`` is a.b,
    ``from kvserve import engine`` is kvserve.engine)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "kvserve":
            modules.update(f"kvserve.{alias.name}" for alias in node.names)  # from kvserve import kernels
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
    return modules


def subpackage(module: str) -> str | None:
    """The kvserve subpackage ``module`` belongs to (``kvserve.engine.plan`` -> ``engine``), else None."""
    parts = module.split(".")
    return parts[1] if parts[0] == "kvserve" and len(parts) > 1 else None


def violations(package: str) -> set[str]:
    """``file imports module`` for each import of ``package`` that FORBIDDEN rules out."""
    return {f"{path.relative_to(ROOT)} imports {module}"
            for path in sorted((ROOT / package).rglob("*.py")) for module in imported_modules(path)
            if (subpackage(module) or module.split(".")[0]) in FORBIDDEN[package]
            and module not in ALLOWED.get(package, ())}


def test_every_import_names_the_kvserve_package():
    """The folders install as kvserve.<folder> only: an import of a bare folder name would find nothing in a wheel."""
    bare = {f"{path.relative_to(ROOT)} imports {module}"
            for folder in (*PACKAGES, "tests") for path in sorted((ROOT / folder).rglob("*.py"))
            for module in imported_modules(path) if module.split(".")[0] in PACKAGES}
    assert not bare, sorted(bare)


def test_imported_modules_sees_lazy_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import os\nfrom kvserve import kernels\n\ndef f():\n    from kvserve.engine.loader import load_model\n"
                      "    import torch.nn\n")
    assert imported_modules(source) == {"os", "kvserve.kernels", "kvserve.engine.loader", "torch.nn"}


def test_a_forbidden_import_is_reported(tmp_path, monkeypatch):
    (tmp_path / "quant").mkdir()
    (tmp_path / "quant" / "bench.py").write_text("def run():\n    from kvserve.engine.runner import ModelRunner\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert violations("quant") == {"quant/bench.py imports kvserve.engine.runner"}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_follow_the_architecture(package):
    assert list((ROOT / package).rglob("*.py")), package
    assert not violations(package), sorted(violations(package))


def test_native_code_has_one_home():
    """C/C++ sources live under kernels/ only (its build and the CPU-feature dispatch are there too)."""
    native = [p.relative_to(ROOT) for ext in ("*.cpp", "*.cc", "*.c", "*.h", "*.hpp")
              for p in ROOT.rglob(ext) if not {".venv", ".git", "build"} & set(p.parts)]
    assert native and all(p.parts[0] == "kernels" for p in native), native
    dispatch = [p.name for p in (ROOT / "kernels" / "csrc").iterdir() if "__builtin_cpu_supports" in p.read_text()]
    assert dispatch == ["cpu.h"]


def test_the_wheel_installs_one_top_level_package(tmp_path):
    """``pip install .`` puts everything under ``kvserve`` (no ``server``, ``kernels``, ... at top level), with the
    kernels' sources, the workload files and the live page's assets inside it."""
    import subprocess
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True, cwd=tmp_path)
    names = zipfile.ZipFile(next(tmp_path.glob("kvserve-*.whl"))).namelist()
    assert {name.split("/")[0] for name in names} == {"kvserve", "kvserve-0.1.0.dist-info"}
    assert {f"kvserve/{folder}/__init__.py" for folder in PACKAGES} <= set(names)
    assert "kvserve/kernels/csrc/cpu.h" in names and "kvserve/loadtest/workloads/seed64.json" in names
    page = {f"kvserve/server/ui/{name}" for name in ("index.html", "app.js", "style.css", "vendor/uPlot.iife.min.js",
                                                      "vendor/uPlot.min.css", "vendor/LICENSE")}
    assert page <= set(names), sorted(page - set(names))
