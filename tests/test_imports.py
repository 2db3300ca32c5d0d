"""docs/architecture.md's import rules, checked from the imports themselves (lazy ones inside functions too):
what each package never imports (read from the page's table), no import cycles, and every import naming the
kvserve package."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGES = ("server", "scheduler", "speculation", "kvcache", "engine", "quant", "native", "planner", "clients",
            "loadtest")


def rules(text: str) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """The "Import rules" table of docs/architecture.md: package -> what it never imports, and package -> the
    modules excepted from that (full names).

    Raises:
        ValueError: the page has no such table.
    """
    section = text.split("## Import rules", 1)[-1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith(("| package", "|---"))]
    if not rows:
        raise ValueError("docs/architecture.md has no import-rules table")
    split = lambda cell: {word.strip() for word in cell.split(",") if word.strip()}  # noqa: E731
    return ({package: split(never) for package, never, *_ in rows},
            {package: split(allowed) for package, _, allowed, *_ in rows if allowed})


FORBIDDEN, ALLOWED = rules(ARCHITECTURE.read_text())


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of the file (absolute imports; ``from a.b import c`` is a.b,
    ``from kvserve import engine`` is kvserve.engine)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "kvserve":
            modules.update(f"kvserve.{alias.name}" for alias in node.names)  # from kvserve import native
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


def module_name(path: Path) -> str:
    """``server/app.py`` -> ``kvserve.server.app``; a package's ``__init__.py`` is the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(["kvserve", *(parts[:-1] if parts[-1] == "__init__" else parts)])


def import_graph(root: Path) -> dict[str, set[str]]:
    """kvserve module -> the kvserve modules it imports (``from a import b`` is ``a.b`` where that is a module).

    Edges from a package's ``__init__`` to its own submodules are left out: importing a submodule runs its
    package's ``__init__`` whatever that imports, so such an edge closes no cycle a reader must untangle.
    """
    paths = {module_name(p): p for package in PACKAGES for p in sorted((root / package).rglob("*.py"))}
    graph = {}
    for name, path in paths.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                named = {f"{node.module}.{alias.name}" for alias in node.names} & paths.keys()
                targets.update(named or {node.module})
        package_init = path.name == "__init__.py"
        graph[name] = {t for t in targets & paths.keys()
                       if t != name and not (package_init and t.startswith(name + "."))}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert cycles(import_graph(ROOT)) == []


def test_the_rules_are_the_documented_table():
    forbidden, allowed = rules(ARCHITECTURE.read_text())
    assert forbidden["scheduler"] >= {"server", "engine", "torch"}
    assert allowed == {"scheduler": {"kvserve.engine.plan"},
                       "planner": {"kvserve.engine.options", "kvserve.server.config"}}
    assert set(forbidden) == {"kvcache", "engine", "scheduler", "speculation", "server", "planner", "quant", "native",
                              "clients"}
    with pytest.raises(ValueError):
        rules("# no table here")


def private_imports(folder: Path) -> set[str]:
    """``file imports module.name`` for each ``from kvserve... import _name`` under ``folder`` (dunders aside)."""
    found = set()
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvserve"):
                found |= {f"{path.relative_to(ROOT)} imports {node.module}.{alias.name}" for alias in node.names
                          if alias.name.startswith("_") and not alias.name.startswith("__")}
    return found


def test_loadtest_imports_no_private_name():
    """Load tests go through public seams (the engine core's contract, the offline runner, HTTP): what they measure is
    what a caller can reach."""
    assert not private_imports(ROOT / "loadtest"), sorted(private_imports(ROOT / "loadtest"))


def test_a_private_import_is_reported(tmp_path, monkeypatch):
    (tmp_path / "loadtest").mkdir()
    (tmp_path / "loadtest" / "bench.py").write_text("from kvserve.scheduler.core import EngineCore, _hidden\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert private_imports(tmp_path / "loadtest") == {"loadtest/bench.py imports kvserve.scheduler.core._hidden"}


def test_imported_modules_sees_lazy_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import os\nfrom kvserve import native\n\ndef f():\n    from kvserve.engine.loader import load_model\n"
                      "    import torch.nn\n")
    assert imported_modules(source) == {"os", "kvserve.native", "kvserve.engine.loader", "torch.nn"}


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
    """C/C++ sources live under native/ only (its build and the CPU-feature dispatch are there too)."""
    native = [p.relative_to(ROOT) for ext in ("*.cpp", "*.cc", "*.c", "*.h", "*.hpp")
              for p in ROOT.rglob(ext) if not {".venv", ".git", "build"} & set(p.parts)]
    assert native and all(p.parts[0] == "native" for p in native), native
    dispatch = [p.name for p in (ROOT / "native" / "csrc").iterdir() if "__builtin_cpu_supports" in p.read_text()]
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
    assert {"kvserve/native/csrc/cpu.h", "kvserve/native/csrc/emu_isoc23_shim.c",
            "kvserve/loadtest/loadgen/workloads/seed64.json"} <= set(names)
    page = {f"kvserve/server/ui/{name}" for name in ("index.html", "app.js", "style.css", "vendor/uPlot.iife.min.js",
                                                      "vendor/uPlot.min.css", "vendor/LICENSE")}
    assert page <= set(names), sorted(page - set(names))
