"""The container image built and run for real: ``scripts/container_check.sh`` (buildah, podman, mmdebstrap).

It builds ./Dockerfile from a local Debian base with the torch wheel this machine's pip finds, runs the image
with its port on 127.0.0.1 and checks readiness, a streamed answer, the non-root user, the KVSERVE_*
variables and SIGTERM with a stream in flight (see the script's header). The build is real, from the
checkout under test, with the layer cache the script keeps in ~/.cache/kvserve/container: when that cache
holds the heavy layers (apt, torch, the dependencies, the GGUF conversion, the C++ kernels) for this
Dockerfile and native/, only kvserve's own layers are built again and the whole check takes minutes.
Skipped, with the reason, where the tools are missing (``bash scripts/ci_system_deps.sh`` installs them) or
where the script says it cannot run, which includes "the layer cache is cold for these inputs" (a cold build
takes about half an hour on 2 cores, past the suite's budget) unless KVSERVE_CONTAINER_CHECK=1 asks for
it; any failed check fails the test. The figures of the runs are in BENCHMARKS.md, section "Container image".
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "container_check.sh"
TOOLS = ("buildah", "podman", "mmdebstrap", "runc", "curl")
# The script bounds each of its steps (the build: 900 s on a warm cache, 2700 s cold); this only stops a wedged run.
WARM_TIMEOUT_S = 1500
COLD_TIMEOUT_S = 3600


def test_container_image_builds_runs_and_stops_cleanly():
    missing = [name for name in TOOLS if shutil.which(name) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (bash scripts/ci_system_deps.sh)")
    env = {**os.environ, "PYTHON": sys.executable}
    # A cold build takes about half an hour on the shared 2-core machine, past the whole suite's budget: by
    # default the test builds only on a warm layer cache (minutes), and cold when asked to
    # (KVSERVE_CONTAINER_CHECK=1, as a CI job of its own can).
    cold_ok = os.environ.get("KVSERVE_CONTAINER_CHECK") == "1"
    if not cold_ok:
        env["KVSERVE_CONTAINER_WARM_ONLY"] = "1"
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=COLD_TIMEOUT_S if cold_ok else WARM_TIMEOUT_S)
    out = proc.stdout + proc.stderr
    print(out)  # the timings, the size and the answer, for the CI log (pytest -s or on failure)
    if proc.returncode == 2:
        pytest.skip(re.search(r"cannot run here: (.*)", out).group(1))
    assert proc.returncode == 0, out
    # the README's question, answered with the README's text (the script compares them)
    assert re.search(r'container_check: answer \(\d+ chunks\) to "[^"]+": \w', out), out
    assert "container_check: PASS" in out


def test_container_check_says_why_it_cannot_run(tmp_path):
    """Without the tools the script exits 2 naming every one missing, before anything runs (the test above turns
    that into its skip): with nothing, with all but runc, and with a Docker client whose daemon does not answer."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "bash").symlink_to("/bin/bash")

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(["/bin/bash", str(SCRIPT)], env={"PATH": str(bin_dir)}, capture_output=True, text=True,
                              timeout=60)

    proc = run()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout.startswith("container_check: cannot run here: curl, python3, timeout, sha256sum, buildah, "
                                  "podman, mmdebstrap, runc not installed: ")
    for name in ("curl", "python3", "timeout", "sha256sum", "buildah", "podman", "mmdebstrap"):  # stubs
        (bin_dir / name).write_text('#!/bin/bash\nshift\nexec "$@"\n' if name == "timeout" else "#!/bin/bash\nexit 0\n")
        (bin_dir / name).chmod(0o755)
    proc = run()
    assert proc.returncode == 2 and proc.stdout.startswith("container_check: cannot run here: runc not installed: ")
    (bin_dir / "docker").write_text("#!/bin/bash\nexit 1\n")  # a client without its daemon
    (bin_dir / "docker").chmod(0o755)
    proc = run()
    assert proc.returncode == 2
    assert proc.stdout == ("container_check: cannot run here: docker is installed but its daemon does not answer "
                           "(docker info): start it; or install runc for buildah from an mmdebstrap base and podman on "
                           "runc (bash scripts/ci_system_deps.sh installs them on Debian)\n")
