"""A fresh install keeps working: no top-level folder shadows an installed distribution, the documented
``python -m kvserve...`` commands run from the repository root and from elsewhere, and the lock that
scripts/setup.sh installs from is complete and exact."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "constraints.txt"


def shadowing(root: Path, distributions: dict[str, list[str]]) -> dict[str, list[str]]:
    """The top-level names under ``root`` that ``python -m`` run there would import instead of an installed
    distribution's: name -> the distributions that provide it.

    ``python -m`` (and ``python -c``, pytest's rootdir) puts the working directory first on ``sys.path``, so a
    regular package there (a folder with ``__init__.py``) or a module (``name.py``) is found before site-packages.
    A folder without ``__init__.py`` is only a namespace portion, which never hides a regular package. kvserve
    itself is the one name that is ours to provide.
    """
    names = {path.name for path in root.iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    names |= {path.stem for path in root.glob("*.py")}
    return {name: sorted(set(distributions[name]) - {"kvserve"}) for name in sorted(names)
            if set(distributions.get(name, ())) - {"kvserve"}}


def test_no_top_level_folder_shadows_an_installed_distribution():
    """transformers 5.25 imports Hugging Face's ``kernels``; a repository folder of that name broke every
    ``python -m`` from the root (the suite included) until it was renamed ``native/``."""
    found = shadowing(ROOT, importlib.metadata.packages_distributions())
    assert not found, "top-level folders named like installed distributions (rename them): " + ", ".join(
        f"{name}/ shadows {' and '.join(dists)}" for name, dists in found.items())


def test_the_shadowing_check_names_the_colliding_distribution(tmp_path):
    for name in ("kernels", "tests", "docs"):
        (tmp_path / name).mkdir()
    (tmp_path / "kernels" / "__init__.py").touch()
    (tmp_path / "tests" / "__init__.py").touch()
    (tmp_path / "yaml.py").touch()
    distributions = {"kernels": ["kernels"], "yaml": ["PyYAML"], "docs": ["somedocs"], "kvserve": ["kvserve"]}
    # docs/ has no __init__.py (a namespace portion, which hides nothing); tests/ is no distribution's
    assert shadowing(tmp_path, distributions) == {"kernels": ["kernels"], "yaml": ["PyYAML"]}


# documented entry points: `--help` must run (argument parsing imports each command's module tree lazily, so the
# model-loading one below checks the heavy imports, transformers' included)
ENTRY_POINTS = (["kvserve.loadtest", "--help"], ["kvserve.clients", "--help"], ["kvserve.native", "--help"],
                ["kvserve.loadtest", "profile", "--help"], ["kvserve.loadtest", "peers", "--help"])


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_documented_python_m_commands_run_from_the_root_and_elsewhere(where, tmp_path):
    cwd = ROOT if where == "root" else tmp_path
    for args in ENTRY_POINTS:
        done = subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (args, done.stderr[-2000:])
        assert "usage:" in done.stdout, args


def test_a_documented_command_that_loads_the_model_runs_from_the_root():
    # transformers' modeling code imports Hugging Face's `kernels` as the model loads: the case that broke
    done = subprocess.run([sys.executable, "-m", "kvserve.loadtest", "profile", "--batch", "1", "--steps", "1",
                           "--context", "8", "--no-write"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SmolLM2-135M-Instruct" in done.stdout
    assert re.search(r"^\| projections \(linear/matmul\) \| \d+% \|$", done.stdout, re.M), done.stdout[-2000:]


def _requirement_names(text: str) -> dict[str, str]:
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def test_the_lock_pins_exact_versions_of_everything_installed():
    """constraints.txt (scripts/setup.sh installs with it; `bash scripts/setup.sh --refresh-lock` rewrites it) pins
    every distribution of the test environment by ``==``, and this environment is the lock's (setup installed it)."""
    text = LOCK.read_text()
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert lines and all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[^=\s,;]+", line) for line in lines), [
        line for line in lines if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[^=\s,;]+", line)]
    pins = _requirement_names(text)
    for name in ("transformers", "torch", "fastapi", "llguidance", "gguf", "pytest", "kernels"):
        assert name in pins, name
    differ = {}
    for name, version in pins.items():
        try:  # the first on sys.path, as an import finds it (setuptools adds its vendored copies at the end)
            found = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if found.split("+")[0] != version.split("+")[0]:
            differ[name] = (version, found)
    assert not differ, f"installed versions differ from constraints.txt (rerun bash scripts/setup.sh): {differ}"
