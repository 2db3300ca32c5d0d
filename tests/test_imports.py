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
ALLOWED = {"scheduler": {"engine.plan"}}


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of the file (absolute imports; ``from a.b import c`` is a.b)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
    return modules


def violations(package: str) -> set[str]:
    """``file imports module`` for each import of ``package`` that FORBIDDEN rules out."""
    return {f"{path.relative_to(ROOT)} imports {module}"
            for path in sorted((ROOT / package).rglob("*.py")) for module in imported_modules(path)
            if module.split(".")[0] in FORBIDDEN[package] and module not in ALLOWED.get(package, ())}


def test_imported_modules_sees_lazy_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import os\n\ndef f():\n    from engine.loader import load_model\n    import torch.nn\n")
    assert imported_modules(source) == {"os", "engine.loader", "torch.nn"}


def test_a_forbidden_import_is_reported(tmp_path, monkeypatch):
    (tmp_path / "quant").mkdir()
    (tmp_path / "quant" / "bench.py").write_text("def run():\n    from engine.runner import ModelRunner\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert violations("quant") == {"quant/bench.py imports engine.runner"}


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
