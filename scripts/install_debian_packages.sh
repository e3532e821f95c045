#!/usr/bin/env bash
# Install the Debian packages pinned in debian-packages.txt when their binaries are missing.
# Debian's security archive replaces Chromium builds; if the pinned build is no longer offered,
# install the archive's current build and say so (update the pin to the version printed).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x /usr/bin/chromium ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
mapfile -t PINS < <(grep -v '^\s*#' debian-packages.txt | grep -v '^\s*$')
echo "installing Debian packages: ${PINS[*]}"
$SUDO apt-get update -qq
if ! DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${PINS[@]}"; then
  NAMES=("${PINS[@]%%=*}")
  echo "WARNING: pinned versions ${PINS[*]} are not offered any more; installing the current ${NAMES[*]}" >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${NAMES[@]}"
  dpkg-query -W "${NAMES[@]}" >&2
fi
/usr/bin/chromium --version
