#!/usr/bin/env bash
# Installs the headless browser the viewer's browser test drives: Debian's `chromium`.
#
# Where chromium is on PATH already, nothing is done. Where it is missing and this runs as
# root with apt-get, it is installed from the distribution's packages (no other download).
# Otherwise it prints why not and exits 0: the browser test then skips with that reason.
# Prints the browser's path (or nothing) as its last line.
set -uo pipefail

find_browser() {
  for c in chromium chromium-browser chromium-headless-shell; do
    command -v "$c" 2>/dev/null && return 0
  done
  return 1
}

if path=$(find_browser); then
  echo "$path"
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install_browser: chromium is missing and cannot be installed here (needs root and apt-get)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core >/dev/null 2>&1; then
  apt-get update -q >/dev/null 2>&1 || true
  apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core >/dev/null 2>&1 \
    || echo "install_browser: apt-get install chromium failed" >&2
fi
find_browser || true
