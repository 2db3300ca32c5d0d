"""Build llama.cpp's ``llama-server`` (and ``llama-quantize``) from the sources inside the llama-cpp-python sdist,
outside the repo.

The peers benchmark needs llama.cpp's own server serving the same GGUF file, and ``loadtest requant`` needs its
quantizer. We take the llama.cpp tree that llama-cpp-python vendors (one PyPI download, no git), configure it with
cmake, and build only those targets, at the lowest CPU priority so it yields to whoever else shares the machine.
The sources and the build live in a temporary directory (default ``/tmp/kvserve-llamacpp``) and never enter
the repo.

    python -m kvserve.loadtest llamacpp            # prints the path of the built binary
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

DEFAULT_DIR = Path("/tmp/kvserve-llamacpp")


def cpu_key() -> str:
    """This CPU's model name and feature flags (/proc/cpuinfo), hashed to 12 hex digits: the name of its build.

    The build is native (``GGML_NATIVE``: the build machine's instructions), and /tmp can outlive a move to
    another CPU, where such a binary dies on an invalid opcode; so each CPU gets a build directory of its own."""
    import hashlib

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        lines = [platform.processor() or platform.machine()]
    wanted = sorted({line for line in lines if line.startswith(("model name", "flags"))})
    return hashlib.sha256("\n".join(wanted).encode()).hexdigest()[:12]


def build_dir_name() -> str:
    """The build directory (under the vendored llama.cpp tree) of this CPU's build (``-noamx``: built without AMX,
    see ``build``)."""
    return f"build-{cpu_key()}-noamx"


def find_server(workdir: Path = DEFAULT_DIR, tool: str = "llama-server") -> Path | None:
    """The ``tool`` (``llama-server`` or ``llama-quantize``) built for this CPU under ``workdir``, or None when it
    has not been built here."""
    for candidate in sorted(workdir.glob(f"llama_cpp_python-*/vendor/llama.cpp/{build_dir_name()}/bin/{tool}")):
        return candidate
    return None


def _download_sdist(workdir: Path) -> Path:
    """Fetch the llama-cpp-python source distribution with pip (sources only, no dependencies)."""
    found = sorted(workdir.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        "llama-cpp-python", "-d", str(workdir)], check=True)
        found = sorted(workdir.glob("llama_cpp_python-*.tar.gz"))
    return found[-1]


def build(workdir: Path = DEFAULT_DIR, jobs: int = 2, tool: str = "llama-server") -> Path:
    """Download, configure and build ``tool`` (``llama-server`` or ``llama-quantize``); returns the binary's path.

    Raises:
        subprocess.CalledProcessError: pip, cmake or the compiler failed.
    """
    existing = find_server(workdir, tool)
    if existing is not None:
        return existing
    workdir.mkdir(parents=True, exist_ok=True)
    sdist = _download_sdist(workdir)
    source_root = workdir / sdist.name.removesuffix(".tar.gz")
    if not source_root.exists():
        with tarfile.open(sdist) as archive:
            archive.extractall(workdir, filter="data")
    llama = source_root / "vendor" / "llama.cpp"
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []
    # No network at build time: no prebuilt web UI download, no curl/openssl; Release for a fair comparison.
    # No AMX: virtual machines list amx_tile in /proc/cpuinfo without enabling its register state, and the native
    # build's first tile instruction then dies on an invalid opcode (seen on a Sapphire Rapids VM); kvserve has
    # no AMX path either, so both sides run their AVX-512 VNNI code.
    out = llama / build_dir_name()
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    subprocess.run(nice + ["cmake", "-S", str(llama), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release",
                           "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                           "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=ON", "-DGGML_AMX_TILE=OFF",
                           "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF", f"-DCMAKE_C_FLAGS={no_amx}",
                           f"-DCMAKE_CXX_FLAGS={no_amx}"], check=True)
    subprocess.run(nice + ["cmake", "--build", str(out), "--target", tool, "-j", str(jobs)], check=True)
    binary = find_server(workdir, tool)
    if binary is None:
        raise FileNotFoundError(f"{tool} was not produced under {out}")
    return binary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's flags: where to build, how many compile jobs."""
    parser.add_argument("--workdir", type=Path, default=DEFAULT_DIR, help="temporary build directory")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")


def run(args: argparse.Namespace) -> int:
    """Build (or find) llama-server and print its path."""
    print(build(args.workdir, args.jobs))
    return 0
