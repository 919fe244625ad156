#!/usr/bin/env bash
# Installs a Debian package when any of the commands it provides is missing.
#   scripts/ensure-debian-package.sh PACKAGE COMMAND [COMMAND ...]
# (prometheus: prometheus + promtool, for the dashboards' tests; chromium: the waterfall page's test;
#  prometheus-alertmanager: the alert chain's test)
set -euo pipefail
package=$1
shift
missing() { for command in "$@"; do command -v "$command" >/dev/null || return 0; done; return 1; }
if ! missing "$@"; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "$* missing: install Debian's '$package' package (needs root and apt-get)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "$package" >/dev/null
! missing "$@"
