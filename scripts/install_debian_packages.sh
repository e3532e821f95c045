#!/usr/bin/env bash
# Install the Debian packages pinned in a packages file when any of the given binaries is missing.
#   scripts/install_debian_packages.sh                      chromium (debian-packages.txt), for the tests
#   scripts/install_debian_packages.sh FILE BINARY...       e.g. deploy/compose-test-packages.txt /usr/sbin/dockerd ...
# Debian's security archive replaces some builds (Chromium's often); if a pinned build is no longer
# offered, install the archive's current build and say so (update the pin to the version printed).
set -euo pipefail
cd "$(dirname "$0")/.."
FILE="${1:-debian-packages.txt}"
if [ "$#" -gt 1 ]; then shift; BINARIES=("$@"); else BINARIES=(/usr/bin/chromium); fi
missing=0
for binary in "${BINARIES[@]}"; do
  [ -x "$binary" ] || missing=1
done
if [ "$missing" = 0 ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
mapfile -t PINS < <(grep -v '^\s*#' "$FILE" | grep -v '^\s*$')
echo "installing Debian packages: ${PINS[*]}"
$SUDO apt-get update -qq
if ! DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${PINS[@]}"; then
  NAMES=("${PINS[@]%%=*}")
  echo "WARNING: pinned versions ${PINS[*]} are not offered any more; installing the current ${NAMES[*]}" >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${NAMES[@]}"
  dpkg-query -W "${NAMES[@]}" >&2
fi
for binary in "${BINARIES[@]}"; do
  [ -x "$binary" ] || { echo "ERROR: $binary is still missing after installing ${PINS[*]}" >&2; exit 1; }
done
