#!/usr/bin/env bash
# System packages for the CI tests, from Debian with apt-get: `prometheus` (the prometheus and promtool
# binaries for tests/test_prometheus_live.py and the promtool checks in tests/test_deploy.py).
# Never fails CI: when a package cannot be had it says why and exits 0, and those tests skip with the reason.
set -uo pipefail

say() { echo "ci_system_deps: $*"; }

if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
  say "prometheus and promtool already installed ($(prometheus --version 2>&1 | head -n 1))"
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  say "no apt-get on this machine; the Prometheus tests will be skipped"
  exit 0
fi
sudo=()
if [[ "$(id -u)" -ne 0 ]]; then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo=(sudo -n)
  else
    say "not root and no password-less sudo; the Prometheus tests will be skipped"
    exit 0
  fi
fi

# The package would start a system-wide Prometheus on :9090; the tests start their own on 127.0.0.1.
# A policy-rc.d that answers 101 ("action forbidden") keeps the service down during the install.
policy=/usr/sbin/policy-rc.d
ours=0
if [[ ! -e "$policy" ]]; then
  if printf '#!/bin/sh\nexit 101\n' | "${sudo[@]}" tee "$policy" >/dev/null && "${sudo[@]}" chmod 755 "$policy"; then
    ours=1
  fi
fi
cleanup() {
  if [[ "$ours" -eq 1 ]]; then
    "${sudo[@]}" rm -f "$policy"
  fi
}
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
if ! timeout 300 "${sudo[@]}" apt-get update -q >/dev/null; then
  say "apt-get update failed; the Prometheus tests will be skipped"
  exit 0
fi
if ! timeout 600 "${sudo[@]}" apt-get install -y -q --no-install-recommends prometheus >/dev/null; then
  say "apt-get install prometheus failed; the Prometheus tests will be skipped"
  exit 0
fi
say "installed $(prometheus --version 2>&1 | head -n 1)"
