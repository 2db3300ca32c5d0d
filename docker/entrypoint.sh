#!/usr/bin/env bash
# Container entry point: turns KVSERVE_<FLAG_IN_UPPER_SNAKE> environment variables into
# `kvserve serve --<flag>` arguments, then execs kvserve so it runs as PID 1 and receives SIGTERM itself.
#
#   KVSERVE_MAX_NUM_SEQS=16 KVSERVE_QUANTIZATION=int8  ->  kvserve serve --max-num-seqs 16 --quantization int8
#
# Arguments given to the container come after the flags made from the environment, so they win
# (argparse keeps the last value). A first argument that is not a flag is run as a command instead
# (`docker run IMAGE kvserve plan ...`, `docker run -it IMAGE bash`).
# KVSERVE_DRY_RUN=1 (or true/yes/on) prints the command, shell-quoted, and exits 0 without running it.
set -euo pipefail

# Flags that take a value; each is read from KVSERVE_<FLAG> with '-' -> '_' and upper case.
VALUE_FLAGS=(
  model host port device dtype quantization kv-cache-memory kv-cache-dtype num-kv-blocks block-size max-num-seqs
  max-num-batched-tokens max-queue max-model-len max-request-bytes scheduler api-key served-model-name
  scheduling-policy
  sse-ping-seconds
  step-log
  drain-seconds
  allowed-hosts
  header-timeout-seconds
  speculative
  num-speculative-tokens
  draft-model
  draft-quantization
  api-key-file
  max-prompts-per-request
  log-level
  body-timeout-seconds
  allowed-origins
  admin-key
  default-max-tokens
  reasoning-parser
  prefix-caching-hash-algo
  kv-events-config
  long-prefill-token-threshold
  max-num-partial-prefills
  max-long-partial-prefills
  attention-cost-context
)
# Switches: KVSERVE_<FLAG>=true|1|yes|on adds the flag; false|0|no|off|empty leaves it out.
SWITCH_FLAGS=(no-prefix-caching vllm-metric-names allow-pickle no-ui share-cache-across-keys metrics-require-key)
# KVSERVE_* variables that are read by kvserve itself (or by this script) rather than being flags.
NOT_FLAGS=(KVSERVE_CACHE KVSERVE_KERNEL_CACHE KVSERVE_DRY_RUN KVSERVE_FASTPATH KVSERVE_ISA KVSERVE_AMX KVSERVE_NATIVE_KERNELS
  KVSERVE_QUANT_KERNELS KVSERVE_URL)

die() {
  echo "kvserve entrypoint: $*" >&2
  exit 2
}

env_name() {  # max-num-seqs -> KVSERVE_MAX_NUM_SEQS
  local upper="${1^^}"
  echo "KVSERVE_${upper//-/_}"
}

dry_run() {  # KVSERVE_DRY_RUN: true|1|yes|on or false|0|no|off|empty, any case, like the switches
  local value="${KVSERVE_DRY_RUN:-}"
  case "${value,,}" in
    true | 1 | yes | on) return 0 ;;
    false | 0 | no | off | "") return 1 ;;
    *) die "KVSERVE_DRY_RUN=${value}: expected true or false" ;;
  esac
}

print_command() {  # shell-quoted, one line
  local first=1 arg
  for arg in "$@"; do
    if ((first)); then first=0; else printf ' '; fi
    printf '%q' "$arg"
  done
  printf '\n'
}

if [[ $# -gt 0 && "$1" != -* ]]; then
  if dry_run; then
    print_command "$@"
    exit 0
  fi
  exec "$@"
fi

# Kubernetes injects <SERVICE>_PORT=tcp://ip:port for every Service in the namespace unless the pod sets
# enableServiceLinks: false; a Service named "kvserve" would otherwise hand us KVSERVE_PORT=tcp://...
if [[ -n "${KVSERVE_PORT:-}" && ! "${KVSERVE_PORT}" =~ ^[0-9]+$ ]]; then
  die "KVSERVE_PORT=${KVSERVE_PORT} is not a port number (a Kubernetes service link? set enableServiceLinks: false)"
fi

args=(serve)
known=("${NOT_FLAGS[@]}")
for flag in "${VALUE_FLAGS[@]}"; do
  name="$(env_name "$flag")"
  known+=("$name")
  if [[ -n "${!name:-}" ]]; then
    args+=("--${flag}" "${!name}")
  fi
done
for flag in "${SWITCH_FLAGS[@]}"; do
  name="$(env_name "$flag")"
  known+=("$name")
  value="${!name:-}"
  case "${value,,}" in
    true | 1 | yes | on) args+=("--${flag}") ;;
    false | 0 | no | off | "") ;;
    *) die "${name}=${value}: expected true or false" ;;
  esac
done

# A misspelt variable would otherwise be ignored without a word.
while IFS= read -r name; do
  if [[ " ${known[*]} " != *" ${name} "* ]]; then
    echo "kvserve entrypoint: ignoring unknown variable ${name} (not a kvserve serve flag)" >&2
  fi
done < <(compgen -e | grep '^KVSERVE_' || true)

args+=("$@")
if dry_run; then
  print_command kvserve "${args[@]}"
  exit 0
fi
exec kvserve "${args[@]}"
