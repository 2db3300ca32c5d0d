#!/usr/bin/env bash
# Builds the kvserve image for real and runs it. With buildah, podman, mmdebstrap and runc (what CI has), it needs no
# Docker engine, no Docker Hub and no PyTorch index:
#
#   1. a local base image: Debian bookworm with python3 and venv, made by mmdebstrap from the Debian mirror
#      that apt uses here (/etc/apt/sources.list.d/*.sources, else /etc/apt/sources.list); the tarball is
#      cached under ~/.cache/kvserve/container/, keyed by its inputs, so only the first run pays for it;
#   2. the CPU torch==2.13.0 wheel, from wherever this machine's pip finds it (`pip download`), handed to the
#      build as `--build-context torch-wheels=DIR`; every other Python package comes from PyPI;
#   3. `buildah bud --layers --isolation chroot` of ./Dockerfile (BASE_IMAGE, TORCH_INDEX_URL=) into a storage
#      directory of its own that persists, ~/.cache/kvserve/container/storage-DRIVER (overlay as root, else
#      vfs): the layer cache. The Dockerfile puts the heavy layers (apt, torch, the dependencies, the GGUF
#      conversion, the C++ kernels, keyed on native/ only) before the one that copies the source, so after a
#      source edit only kvserve's own small layers are built again (minutes, not the cold build's ~30);
#   4. `podman run` with the port published on 127.0.0.1 only, then checks from outside: /health turns
#      ready within the HEALTHCHECK's start period (and the image's HEALTHCHECK passes), the README's curl
#      streams the README's answer (a well-formed stream: chunks, a finish reason, [DONE]; and the text the
#      README shows, which tests/test_docs_examples.py keeps the default model's), the server runs as the
#      image's non-root user, KVSERVE_* variables
#      reach its flags, and SIGTERM with a stream in flight drains (/health 503, the stream goes on, and is
#      cut when the drain's time runs out) and the container exits within podman's (and Docker's) default stop
#      grace period of 10 s. It prints the timings and the image size.
#
# Without buildah, podman or mmdebstrap, a running Docker engine does the same: `docker build` of ./Dockerfile as it
# stands (python:3.11-slim-bookworm from Docker Hub, torch from PyTorch's index, PyPI), Docker's own layer cache, and
# the same run and checks with `docker run` (KVSERVE_CONTAINER_ENGINE=docker picks it where both are installed).
#
# Everything it makes lives in that private storage (never the machine's own images; with Docker, its image is
# tagged kvserve:check); its containers are removed on exit, its layers and the last image kept as the cache. Each
# step runs under `timeout`. Exit status: 0 all checks passed, 1 a check failed, 2 it cannot run here (a tool is
# missing, or Docker's daemon does not answer: every missing tool is named, first, before anything is built).
#
#   bash scripts/container_check.sh            # root, or rootless buildah/podman with subuids
#   KVSERVE_CONTAINER_KEEP=1 ...               # keep the stopped container and the logs for a look afterwards
#   KVSERVE_CONTAINER_REBUILD=1 ...            # build every layer again (--no-cache): a cold build's time
#   KVSERVE_CONTAINER_BUILD_TIMEOUT_S=2700 ... # the build's bound (default 2700 s; 900 s with WARM_ONLY)
#   KVSERVE_CONTAINER_WARM_ONLY=1 ...          # exit 2 (cannot run) unless the layer cache holds the heavy
#                                              # layers for these inputs: tests/test_container.py in CI
#   KVSERVE_CONTAINER_ENGINE=podman|docker ... # which engine (default: podman where its tools are all here)
set -euo pipefail

PYTHON="${PYTHON:-python3}"
SUITE=bookworm               # the Dockerfile pins bookworm's g++; bookworm's python3 is 3.11 (the wheel's cp311)
BASE_PACKAGES=python3,python3-venv,python-is-python3  # the Dockerfile adds the C headers in its build stage only; the runtime imports the prebuilt kernels without ninja
GRACE_S=10                   # `podman stop` / `docker stop` default: SIGTERM, then SIGKILL after 10 s
WARM_ONLY="${KVSERVE_CONTAINER_WARM_ONLY:-}"
# A cold build measured about half an hour on the loaded 2 cores; a warm one, minutes (BENCHMARKS.md)
BUILD_TIMEOUT_S="${KVSERVE_CONTAINER_BUILD_TIMEOUT_S:-$([[ "$WARM_ONLY" == 1 ]] && echo 900 || echo 2700)}"

say() { echo "container_check: $*"; }
fail() {
  say "FAIL: $*"
  exit 1
}
cannot() {
  say "cannot run here: $*"
  exit 2
}
elapsed() { echo $(($(date +%s) - $1)); }

# ---- 0. the tools, all checked before anything runs: every missing one is named at once -----------------
missing() { for cmd in "$@"; do command -v "$cmd" >/dev/null || printf '%s ' "$cmd"; done; }
listed() { local names="${1% }"; printf '%s' "${names// /, }"; }  # "a b " -> "a, b"
# every engine: curl and python3 check the server from outside, coreutils' timeout bounds each step and sha256sum
# keys the caches
common=$(missing curl "$PYTHON" timeout sha256sum)
# podman on runc, not crun: crun refuses a host with cgroups in hybrid (v1 + v2) mode, as these VMs have
podman_missing=$(missing buildah podman mmdebstrap runc)
PODMAN_TOOLS="buildah from an mmdebstrap base and podman on runc (bash scripts/ci_system_deps.sh installs them on \
Debian)"
ENGINE="${KVSERVE_CONTAINER_ENGINE:-}"
chosen="$ENGINE"
if [[ -z "$ENGINE" ]]; then  # podman where its tools are all here; else Docker where its client is
  if [[ -n "$podman_missing" ]] && command -v docker >/dev/null; then ENGINE=docker; else ENGINE=podman; fi
fi
# where Docker was only the fallback, its failure names what podman lacks too
instead=""
if [[ -z "$chosen" && -n "$podman_missing" ]]; then
  instead="; or install $(listed "$podman_missing") for $PODMAN_TOOLS"
fi
case "$ENGINE" in
  podman)
    [[ -z "$common$podman_missing" ]] || cannot "$(listed "$common$podman_missing") not installed: this check \
builds and runs the image with $PODMAN_TOOLS, or with a running Docker engine (KVSERVE_CONTAINER_ENGINE=docker)" ;;
  docker)
    [[ -z "$common" ]] || cannot "$(listed "$common") not installed"
    command -v docker >/dev/null || cannot "docker is not installed (KVSERVE_CONTAINER_ENGINE=docker)$instead"
    timeout 30 docker info >/dev/null 2>&1 || cannot "docker is installed but its daemon does not answer \
(docker info): start it$instead"
    timeout 30 docker buildx version >/dev/null 2>&1 || cannot "docker has no buildx (BuildKit), which the \
Dockerfile's RUN --mount steps need: install the docker-buildx plugin$instead" ;;
  *) cannot "KVSERVE_CONTAINER_ENGINE=$ENGINE: expected podman or docker" ;;
esac
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/kvserve/container"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/kvserve-container.XXXXXX")"  # this run's logs and answers
NAME="kvserve-check-$$"
STREAM_PID=""
say "engine: $ENGINE"

cleanup() {
  local rc=$?
  if [[ -n "$STREAM_PID" ]]; then kill "$STREAM_PID" 2>/dev/null || true; fi
  if [[ "${KVSERVE_CONTAINER_KEEP:-}" == 1 ]]; then
    say "kept the container $NAME and $WORK"
  else
    local rm=(rm --force)
    if [[ "$ENGINE" == podman ]]; then rm+=(--time 0); fi
    if [[ -n "${CTR[*]:-}" ]]; then timeout 60 "${CTR[@]}" "${rm[@]}" "$NAME" >/dev/null 2>&1 || true; fi
    # a leftover mount (a killed run) is unmounted before removal
    grep -o " ${WORK}[^ ]*" /proc/mounts 2>/dev/null | sort -r | xargs -r -n 1 umount -l 2>/dev/null || true
    rm -rf "$WORK" 2>/dev/null || { [[ "$ENGINE" == podman ]] && "${BUILDAH[@]}" unshare rm -rf "$WORK"; } 2>/dev/null \
      || true
  fi
  exit "$rc"
}
CTR=()
BUILDAH=()
trap cleanup EXIT
trap 'exit 130' INT TERM

# pip inside the build trusts what pip trusts here (PIP_CERT, else the system's CA bundle): a mirror's private
# CA, or a proxy that inspects TLS, as on the machines this runs on. Handed in as a secret: in no layer.
secret=()
cert="${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}"
if [[ -s "$cert" ]]; then secret=(--secret "id=pip-cert,src=$cert"); fi
no_cache=()
if [[ "${KVSERVE_CONTAINER_REBUILD:-}" == 1 ]]; then no_cache=(--no-cache); fi

if [[ "$ENGINE" == podman ]]; then
# ---- storage (podman): the layer cache persists; run state and logs are per run -------------------------
# overlay needs root (or fuse-overlayfs); vfs works anywhere but copies every layer whole. Each driver has
# its own directory, as containers/storage cannot switch one in place.
driver=vfs
if [[ "$(id -u)" -eq 0 ]] && grep -qw overlay /proc/filesystems; then driver=overlay; fi
STORAGE="$CACHE/storage-$driver"
mkdir -p "$STORAGE"
# Run state at a fixed path: podman's database records the runroot and tmpdir, and refuses another pair
# ("database configuration mismatch"). Under /run for root (a tmpfs on most systems, cleared at boot; it need not
# be: no container outlives a run).
# One per storage directory (named after its path): two storages sharing a runroot would mix their state.
run_id="$(printf '%s' "$STORAGE" | sha256sum | cut -c1-12)"
if [[ "$(id -u)" -eq 0 ]]; then RUNDIR="/run/kvserve-container-$run_id"; else
  RUNDIR="${XDG_RUNTIME_DIR:-/tmp}/kvserve-container-$(id -u)-$run_id"; fi
mkdir -p "$RUNDIR"
STORE=(--storage-driver "$driver" --root "$STORAGE" --runroot "$RUNDIR/run")
# --log-level error: both warn on every call about CNI plugins that the netavark backend does not use
BUILDAH=(buildah "${STORE[@]}" --log-level error)
# runc, not crun: crun refuses a host with cgroups in hybrid (v1 + v2) mode, as these VMs have. cgroupfs and a
# file for events: no systemd or journald needed.
PODMAN=(podman "${STORE[@]}" --log-level error --runtime runc --cgroup-manager cgroupfs --events-backend file
  --tmpdir "$RUNDIR/tmp")
IMAGE="localhost/kvserve:check"  # the last image built, kept: its layers are the next build's cache
CTR=("${PODMAN[@]}")

# A storage first used with other run paths (an older version of this script) has a database that names them.
# It holds container state only, and this script keeps no container between runs: start it afresh.
info=$(timeout 60 "${PODMAN[@]}" info 2>&1 || true)
if [[ "$info" == *"database configuration mismatch"* ]]; then
  say "podman's database in $STORAGE names other run paths; removing it (images and layers stay)"
  rm -f "$STORAGE/libpod/bolt_state.db"
fi

# ---- 1. base image --------------------------------------------------------------------------------------
sources=""
for f in /etc/apt/sources.list.d/*.sources; do
  [[ -f "$f" ]] && grep -q 'debian' "$f" && sources="$f" && break
done
if [[ -z "$sources" ]]; then
  [[ -f /etc/apt/sources.list ]] || cannot "no apt sources to find a Debian mirror in"
  sources=/etc/apt/sources.list
fi
mkdir -p "$CACHE"
key="$( (echo "$SUITE $BASE_PACKAGES"; mmdebstrap --version; grep -v '^#' "$sources") | sha256sum | cut -c1-16)"
base_tar="$CACHE/base-$SUITE-$key.tar"
t0=$(date +%s)
if [[ ! -s "$base_tar" && "$WARM_ONLY" == 1 ]]; then
  cannot "the layer cache is cold (no base made yet) and KVSERVE_CONTAINER_WARM_ONLY=1: a cold build takes about \
30 min on 2 cores; run bash scripts/container_check.sh once, or set KVSERVE_CONTAINER_CHECK=1 for the test"
elif [[ ! -s "$base_tar" ]]; then
  say "making the base: mmdebstrap $SUITE (+$BASE_PACKAGES) from the mirror in $sources"
  mirror=("$sources")
  if [[ "$sources" == */sources.list ]]; then  # one-line format: hand mmdebstrap the Debian lines themselves
    mapfile -t mirror < <(grep -E '^deb .*debian' "$sources" | sed "s/ [a-z]*-*[a-z]* main/ $SUITE main/" | head -n 1)
  fi
  # shellcheck disable=SC2016  # "$1" is the hook's own argument (the new root), expanded by mmdebstrap
  timeout 900 mmdebstrap --quiet --variant=minbase --include="$BASE_PACKAGES" --format=tar \
    --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/usr/share/doc/* "$1"/usr/share/man/*' \
    "$SUITE" "$base_tar.part" "${mirror[@]}" || fail "mmdebstrap failed"
  mv "$base_tar.part" "$base_tar"
  say "base made in $(elapsed "$t0") s ($base_tar)"
else
  say "base from the cache: $base_tar"
fi

# ---- 2. the CPU torch wheel ------------------------------------------------------------------------------
wheels="$CACHE/torch-wheels"
mkdir -p "$wheels"
if ! compgen -G "$wheels/torch-2.13.0+cpu-cp311-*.whl" >/dev/null; then
  say "fetching the torch wheel with this machine's pip"
  timeout 600 "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_28_x86_64 --dest "$wheels" torch==2.13.0 || cannot "pip download torch==2.13.0 failed"
fi
torch_wheel="$(compgen -G "$wheels/torch-2.13.0+cpu-cp311-*.whl" | head -n 1)" \
  || cannot "no CPU build of torch 2.13.0 for cp311 (only $(ls "$wheels")); the CUDA one would make a multi-GB image"

# ---- 3. build, with the layer cache -----------------------------------------------------------------------
# The base goes into the storage once per tarball: a fresh import would be a new image, and every layer above
# it a cache miss.
BASE_IMAGE="localhost/kvserve-base:$SUITE-$key"
if ! "${PODMAN[@]}" image exists "$BASE_IMAGE"; then
  timeout 300 "${PODMAN[@]}" import --quiet --change 'CMD ["python3"]' "$base_tar" "$BASE_IMAGE" >/dev/null \
    || fail "podman import of the base failed"
fi
# What the heavy layers depend on: the base, the wheel, the Dockerfile and native/ (the C++ build, the
# slowest step). A marker in the storage says a build from these inputs finished, so their layers are in the
# cache; WARM_ONLY runs refuse to build without it, as a cold build would take the CI run's whole budget.
# pyproject.toml is left out: a change there rebuilds the dependencies' layer and the GGUF conversion only
# (a few minutes more, bounded by the build's timeout).
heavy_key="$(cd "$ROOT" && { echo "$key ${torch_wheel##*/}"; find Dockerfile native -type f \
  ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z | xargs -0 sha256sum; } | sha256sum | cut -c1-16)"
warm_marker="$STORAGE/warm-$heavy_key"
if [[ "$WARM_ONLY" == 1 && ! -e "$warm_marker" ]]; then
  cannot "the layer cache is cold for these inputs (no build yet from this Dockerfile, native/, base and torch \
wheel) and KVSERVE_CONTAINER_WARM_ONLY=1: a cold build takes about 30 min on 2 cores; run \
bash scripts/container_check.sh once, or set KVSERVE_CONTAINER_CHECK=1 for the test"
fi
say "building $IMAGE (buildah bud --layers, $driver storage in $STORAGE, chroot isolation; bound ${BUILD_TIMEOUT_S} s)"
t0=$(date +%s)
timeout "$BUILD_TIMEOUT_S" "${BUILDAH[@]}" bud --layers "${no_cache[@]}" --force-rm --isolation chroot \
  --format docker --pull=never --build-context "torch-wheels=$wheels" "${secret[@]}" \
  --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg TORCH_INDEX_URL= \
  --iidfile "$WORK/iid" --tag "$IMAGE" --file "$ROOT/Dockerfile" "$ROOT" 2>&1 \
  | while IFS= read -r line; do printf '%5d %s\n' "$(elapsed "$t0")" "$line"; done >"$WORK/build.log" \
  || { tail -n 40 "$WORK/build.log"; fail "the image did not build"; }
# how long each step that ran took (the seconds before each log line; cached steps left out)
awk '{ last = $1 }
  / STEP [0-9]+\/[0-9]+: / { if (step != "" && !cached) printf "%5d s  %s\n", $1 - t, step
    t = $1; step = substr($0, index($0, "[")); cached = 0 }
  /--> Using cache/ { cached = 1 }
  END { if (step != "" && !cached) printf "%5d s  %s\n", last - t, step }' "$WORK/build.log" | cut -c1-130 \
  | awk '$1 >= 2' >"$WORK/steps.log" || true
build_s=$(elapsed "$t0")
touch "$warm_marker"
image_id="$(cat "$WORK/iid")"
steps=$(grep -c 'STEP [0-9]' "$WORK/build.log" || true)
cached=$(grep -c -- '--> Using cache' "$WORK/build.log" || true)
say "built in $build_s s ($cached of $steps steps from the layer cache): ${image_id:0:19}"
sed 's/^/container_check:   /' "$WORK/steps.log"  # the steps that took 2 s or more

fi

if [[ "$ENGINE" == docker ]]; then
# ---- 1-3 (Docker): build ./Dockerfile as it stands, with Docker's own layer cache ---------------------------
IMAGE="kvserve:check"  # the last image built, kept in Docker's store: its layers are the next build's cache
CTR=(docker)
# What the heavy layers depend on (as above, with the base and torch from Docker Hub and PyTorch's index): the
# Dockerfile and native/. A marker says a build from these inputs finished, so WARM_ONLY runs build only then.
heavy_key="$(cd "$ROOT" && { echo docker; find Dockerfile native -type f ! -path '*/__pycache__/*' ! -name '*.pyc' \
  -print0 | sort -z | xargs -0 sha256sum; } | sha256sum | cut -c1-16)"
mkdir -p "$CACHE"
warm_marker="$CACHE/docker-warm-$heavy_key"
if [[ "$WARM_ONLY" == 1 && ! -e "$warm_marker" ]]; then
  cannot "Docker's layer cache is cold for these inputs (no build yet from this Dockerfile and native/) and \
KVSERVE_CONTAINER_WARM_ONLY=1: a cold build takes about 30 min on 2 cores; run bash scripts/container_check.sh once, \
or set KVSERVE_CONTAINER_CHECK=1 for the test"
fi
say "building $IMAGE (docker buildx build, Docker's layer cache; bound ${BUILD_TIMEOUT_S} s)"
t0=$(date +%s)
timeout "$BUILD_TIMEOUT_S" docker buildx build --load --progress plain "${no_cache[@]}" "${secret[@]}" \
  --iidfile "$WORK/iid" --tag "$IMAGE" --file "$ROOT/Dockerfile" "$ROOT" >"$WORK/build.log" 2>&1 \
  || { tail -n 40 "$WORK/build.log"; fail "the image did not build"; }
build_s=$(elapsed "$t0")
touch "$warm_marker"
image_id="$(cat "$WORK/iid")"
say "built in $build_s s: ${image_id:0:19}"

fi
size=$("${CTR[@]}" image inspect --format '{{.Size}}' "$image_id")
say "image size $((size / 1000000)) MB ($size bytes; docs/operations.md and BENCHMARKS.md report it)"

# ---- 4. run and check from outside -------------------------------------------------------------------
port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
url="http://127.0.0.1:$port"
served_name=kvserve-container-check
# podman: --health-interval disable, as there is no systemd timer for the HEALTHCHECK here (it is run once below).
# Explicit ulimits: podman's defaults (nofile, nproc 1048576 / 4194304) exceed what a root without
# CAP_SYS_RESOURCE may set, as in these VMs.
health_flags=()
if [[ "$ENGINE" == podman ]]; then health_flags=(--health-interval disable); fi
timeout 120 "${CTR[@]}" run --detach --name "$NAME" --publish "127.0.0.1:$port:8000" "${health_flags[@]}" \
  --ulimit nofile=4096:4096 --ulimit nproc=4096:4096 \
  --env KVSERVE_MAX_NUM_SEQS=3 --env "KVSERVE_SERVED_MODEL_NAME=$served_name" --env KVSERVE_KV_CACHE_MEMORY=128MiB \
  "$image_id" >/dev/null 2>"$WORK/run.err" || { cat "$WORK/run.err"; fail "$ENGINE run failed"; }
t0=$(date +%s)

# /health within the HEALTHCHECK's start period (the image's; JSON gives Go durations in nanoseconds)
field='{{json .Config.Healthcheck}}'
if [[ "$ENGINE" == podman ]]; then field='{{json .HealthCheck}}'; fi
healthcheck=$("${CTR[@]}" image inspect --format "$field" "$image_id")
start_s=$(printf '%s' "$healthcheck" \
  | "$PYTHON" -c 'import json, sys; print((json.load(sys.stdin) or {}).get("StartPeriod", 0) // 10**9)')
[[ "$start_s" -gt 0 ]] || fail "the image has no HEALTHCHECK start period (built without --format docker?)"
until curl -fsS --max-time 3 "$url/health" 2>/dev/null | grep -q '"ok"'; do
  if [[ "$("${CTR[@]}" inspect --format '{{.State.Running}}' "$NAME")" != true ]]; then
    "${CTR[@]}" logs "$NAME" 2>&1 | tail -n 30
    fail "the container exited before turning ready"
  fi
  if [[ "$(elapsed "$t0")" -gt "$start_s" ]]; then
    "${CTR[@]}" logs "$NAME" 2>&1 | tail -n 30
    fail "/health not ready within the start period ($start_s s)"
  fi
  sleep 1
done
ready_s=$(elapsed "$t0")
say "ready in $ready_s s (HEALTHCHECK start period $start_s s)"
if [[ "$ENGINE" == podman ]]; then
  timeout 30 "${CTR[@]}" healthcheck run "$NAME" >/dev/null || fail "the image's HEALTHCHECK reports unhealthy"
else  # Docker runs it on its own clock: run its command once, as the engine would
  mapfile -t check < <(printf '%s' "$healthcheck" \
    | "$PYTHON" -c 'import json, sys; print("\n".join(json.load(sys.stdin)["Test"][1:]))')
  timeout 30 docker exec "$NAME" "${check[@]}" >/dev/null || fail "the image's HEALTHCHECK reports unhealthy"
fi
say "the image's HEALTHCHECK (docker/healthcheck.py, inside) passes"

# the README's request, streamed: a well-formed stream (content chunks, a finish reason, then [DONE]) whose text is
# the README's own output block's, which tests/test_docs_examples.py keeps what the default model answers
expected=$("$PYTHON" - "$ROOT/README.md" <<'EOF'
import json, re, sys
block = re.search(r"```text output\n(.*?)```", open(sys.argv[1]).read(), re.S).group(1)
print("".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
              for line in block.splitlines() if line.startswith("data: {")))
EOF
) || fail "README.md has no streamed example output to compare with"
question=$("$PYTHON" -c 'import re, sys; print(re.search(r"\"content\": \"([^\"]*)\"", open(sys.argv[1]).read()).group(1))' \
  "$ROOT/README.md")
answer=$(timeout 120 curl -sSN --max-time 110 "$url/v1/chat/completions" -H 'Content-Type: application/json' -d "{
  \"messages\": [{\"role\": \"user\", \"content\": \"$question\"}],
  \"temperature\": 0, \"max_tokens\": 32, \"stream\": true}" | tee "$WORK/answer.sse" \
  | "$PYTHON" -c '
import json, sys
text, reasons, done, chunks = [], [], False, 0
for line in sys.stdin:
    if line.startswith("data: [DONE]"):
        done = True
    elif line.startswith("data: "):
        chunk = json.loads(line[6:])
        chunks += 1
        for choice in chunk["choices"]:
            text.append(choice["delta"].get("content") or "")
            reasons += [choice["finish_reason"]] if choice.get("finish_reason") else []
problems = [p for p, bad in (("no [DONE]", not done), ("no finish_reason", reasons not in (["stop"], ["length"])),
                             ("no text", not "".join(text).strip()), ("under 2 chunks", chunks < 2)) if bad]
print("".join(text) + "".join(f" [{p}]" for p in problems))') || fail "the streamed request failed"
chunks=$(grep -c '^data: {' "$WORK/answer.sse" || true)
say "answer ($chunks chunks) to \"$question\": $answer"
[[ "$answer" != *" [no "* && "$answer" != *" [under "* ]] || fail "the stream is not well formed: $answer"
[[ "$answer" == "$expected" ]] || fail "the answer differs from README.md's ($expected)"

# the server process: its user and its command line, read from the host
pid=$("${CTR[@]}" inspect --format '{{.State.Pid}}' "$NAME")
uid=$(awk '/^Uid:/ {print $2}' "/proc/$pid/status")
image_user=$("${CTR[@]}" image inspect --format '{{.Config.User}}' "$image_id")
cmdline=$(tr '\0' ' ' <"/proc/$pid/cmdline")
inner_uid=$(timeout 30 "${CTR[@]}" exec "$NAME" python -c 'import os; print(os.getuid())')
say "PID 1 in the container: uid $inner_uid inside, $uid on the host (image USER $image_user): $cmdline"
[[ "$inner_uid" == "${image_user%%:*}" && "$inner_uid" -ne 0 ]] || fail "the server does not run as the image's user"
[[ "$cmdline" == *"serve --host 0.0.0.0 --port 8000"*"--max-num-seqs 3"*"--served-model-name $served_name"* ]] \
  || fail "the KVSERVE_* variables did not become flags"
models=$(curl -fsS --max-time 10 "$url/v1/models")
[[ "$models" == *"\"$served_name\""* ]] || fail "/v1/models does not list $served_name: $models"
say "KVSERVE_* reached the flags (/v1/models lists $served_name)"

# SIGTERM with a stream in flight: kvserve drains (server/drain.py): /health turns 503, the open stream goes on
# for up to KVSERVE_DRAIN_SECONDS (the image's 3 s), is cut if still open then, and the server exits; all
# within the 10 s grace.
curl -sSN --max-time 120 "$url/v1/completions" -H 'Content-Type: application/json' \
  -d '{"prompt": "1, 2, 3, 4,", "temperature": 0, "max_tokens": 2000, "stream": true}' \
  >"$WORK/stream.sse" 2>"$WORK/stream.err" &
STREAM_PID=$!
t1=$(date +%s)
until [[ "$(grep -c '^data: {' "$WORK/stream.sse" 2>/dev/null || true)" -ge 5 ]]; do
  [[ "$(elapsed "$t1")" -lt 60 ]] || fail "the long stream did not start"
  sleep 0.2
done
timeout 30 "${CTR[@]}" kill --signal TERM "$NAME" >/dev/null || fail "podman kill --signal TERM failed"
t1=$(date +%s%N)
at_term=$(grep -c '^data: {' "$WORK/stream.sse" || true)
sleep 1
health=$(curl -sS --max-time 2 -o /dev/null -w '%{http_code}' "$url/health" 2>/dev/null || true)
left_s=$((GRACE_S - ($(date +%s%N) - t1) / 1000000000))
status=$(timeout "$left_s" "${CTR[@]}" wait "$NAME") || fail "still running $GRACE_S s after SIGTERM"
stop_ms=$((($(date +%s%N) - t1) / 1000000))
stop_s="$((stop_ms / 1000)).$(printf '%03d' $((stop_ms % 1000)) | cut -c1)"
stream_rc=0
timeout 10 tail --pid="$STREAM_PID" -f /dev/null || fail "the stream did not end after the server exited"
wait "$STREAM_PID" || stream_rc=$?
STREAM_PID=""
total=$(grep -c '^data: {' "$WORK/stream.sse" || true)
drained=$("${CTR[@]}" logs "$NAME" 2>&1 | grep -o 'drain done in .*' | head -n 1)
if grep -q '^data: \[DONE\]' "$WORK/stream.sse"; then ending="finished ([DONE])"
elif [[ "$stream_rc" == 0 ]]; then ending="ended by the server"
else ending="cut at the drain's end (curl: $(tr -d '\n' <"$WORK/stream.err"))"; fi
say "SIGTERM: /health answered $health while draining; the container exited with status $status $stop_s s after \
SIGTERM; the stream got $((total - at_term)) more chunks while draining ($total in all) and was $ending; \
the log: $drained"
[[ "$health" == 503 ]] || fail "/health answered $health, not 503, while draining"
[[ "$status" == 0 ]] || fail "exit status $status after SIGTERM (a drained stop exits 0)"
[[ "$total" -gt "$at_term" ]] || fail "the stream stopped at SIGTERM instead of going on while draining"
[[ -n "$drained" ]] || fail "no drain in the log"
# a stream that did not finish is one the drain counted as cut, not one dropped some other way
[[ "$ending" != cut* || "$drained" =~ [1-9][0-9]*\ cut ]] || fail "the stream was cut but the drain counts none cut"
"${CTR[@]}" logs "$NAME" 2>&1 | grep -q 'Finished server process' || fail "no clean uvicorn shutdown in the log"

say "PASS: build ${build_s} s, image $((size / 1000000)) MB, ready ${ready_s} s, SIGTERM exit ${stop_s} s"
