#!/usr/bin/env bash
# System packages for the CI tests, from Debian with apt-get: `prometheus` (the prometheus and promtool
# binaries for tests/test_prometheus_live.py and the promtool checks in tests/test_deploy.py), and the
# container tools for scripts/container_check.sh (tests/test_container.py): buildah and podman (with runc,
# netavark, iptables for its port forwarding, aardvark-dns, uidmap) to build and run the image, and
# mmdebstrap to make its base locally; and `chromium`, the browser that tests/test_ui.py drives headless through
# Playwright (pip's playwright package, pointed at this chromium: Playwright's own browser download needs a host
# that CI cannot reach).
# Never fails CI: when a package cannot be had it says why and exits 0, and those tests skip with the reason.
set -uo pipefail

say() { echo "ci_system_deps: $*"; }

CONTAINER_PACKAGES=(buildah podman runc crun netavark aardvark-dns iptables uidmap mmdebstrap)
have_prometheus() { command -v prometheus >/dev/null && command -v promtool >/dev/null; }
have_chromium() { command -v chromium >/dev/null; }
have_container_tools() { command -v buildah >/dev/null && command -v podman >/dev/null && command -v mmdebstrap >/dev/null; }

if have_prometheus && have_container_tools && have_chromium; then
  say "prometheus and promtool already installed ($(prometheus --version 2>&1 | head -n 1))"
  say "buildah, podman and mmdebstrap already installed ($(buildah --version))"
  say "chromium already installed ($(chromium --version 2>/dev/null))"
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  say "no apt-get on this machine; the Prometheus tests, the container check and the browser tests will be skipped"
  exit 0
fi
sudo=()
if [[ "$(id -u)" -ne 0 ]]; then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo=(sudo -n)
  else
    say "not root and no password-less sudo; the Prometheus tests, the container check and the browser tests will be skipped"
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
  say "apt-get update failed; the Prometheus tests, the container check and the browser tests will be skipped"
  exit 0
fi
if have_prometheus; then
  say "prometheus and promtool already installed"
elif ! timeout 600 "${sudo[@]}" apt-get install -y -q --no-install-recommends prometheus >/dev/null; then
  say "apt-get install prometheus failed; the Prometheus tests will be skipped"
else
  say "installed $(prometheus --version 2>&1 | head -n 1)"
fi
# Separately, so that one failing leaves the other installed.
if have_container_tools; then
  say "buildah, podman and mmdebstrap already installed"
elif ! timeout 600 "${sudo[@]}" apt-get install -y -q --no-install-recommends "${CONTAINER_PACKAGES[@]}" >/dev/null; then
  say "apt-get install ${CONTAINER_PACKAGES[*]} failed; the container check will be skipped"
else
  say "installed $(buildah --version), $(podman --version), mmdebstrap $(mmdebstrap --version | cut -d' ' -f2)"
fi
if have_chromium; then
  say "chromium already installed"
elif ! timeout 900 "${sudo[@]}" apt-get install -y -q --no-install-recommends chromium >/dev/null; then
  say "apt-get install chromium failed; the browser tests will be skipped"
else
  say "installed $(chromium --version 2>/dev/null)"
fi
