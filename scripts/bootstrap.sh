#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Installs the Debian packages idem builds, tests and benchmarks with. Does nothing when all are
# present; runs `apt-get update` only when something is missing. Root, or sudo otherwise.
set -euo pipefail

packages=(
  build-essential cmake pkg-config git procps psmisc
  libssl-dev libsqlite3-dev sqlite3
  libhiredis-dev redis-server redis-tools
  libpqxx-dev libpq-dev postgresql-15 postgresql-client-15
  mariadb-server mariadb-client libmariadb-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libfmt-dev libspdlog-dev nlohmann-json3-dev libcpp-httplib-dev prometheus-cpp-dev
  librabbitmq-dev rabbitmq-server
  curl
  chromium fonts-noto-color-emoji fonts-wqy-microhei
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  doxygen dpkg-dev openssl stunnel4
  libboost-dev libasio-dev
)
# Node.js runs the browser module's tests and drives Chromium (tests/browser); a node that is
# already installed (from anywhere) is used as it is.
if ! command -v node >/dev/null 2>&1; then
  packages+=(nodejs npm)
fi

# The npm packages of the browser tests, pinned in tests/browser/package-lock.json, into
# tests/browser/node_modules (not committed). Runs `npm ci` only when the pinned puppeteer-core
# is not the one installed.
npm_packages() {
  local dir
  dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/../tests/browser" && pwd)"
  local want have
  want="$(node -p "require('$dir/package.json').dependencies['puppeteer-core']")"
  have="$(node -p "try { require('$dir/node_modules/puppeteer-core/package.json').version } catch (e) { '' }")"
  if [ "$want" != "$have" ]; then
    echo "bootstrap: npm ci in tests/browser (puppeteer-core $want)" >&2
    (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
  fi
}

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ "${#missing[@]}" -eq 0 ]; then
  npm_packages
  exit 0
fi

echo "bootstrap: installing ${missing[*]}" >&2
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  sudo_cmd=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
# Debian's postinst scripts would start the packaged redis/postgres services; idem never uses them
# (scripts/servers.sh runs its own on other ports), so keep them from starting where possible.
if [ "$(id -u)" -eq 0 ] && [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
  chmod +x /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
npm_packages
echo "bootstrap: done" >&2
