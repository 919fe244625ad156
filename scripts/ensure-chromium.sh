#!/usr/bin/env bash
# Installs Debian's chromium (the waterfall page's browser test) when it is missing.
set -euo pipefail
if command -v chromium >/dev/null; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "chromium missing: install Debian's 'chromium' package (needs root and apt-get)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium >/dev/null
command -v chromium >/dev/null
