#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Installs what is missing, builds, and runs the main job on the embedded default (MemoryStore in
# front of SQLite; no server needed): a storm of duplicate payments that must each charge once.
#
#   scripts/demo.sh [payment_storm flags, e.g. --payments 5000 --threads 8]
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
BUILD="${IDEM_BUILD_DIR:-build}"
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$BUILD" -j "$(nproc)" --target payment_storm
exec "$BUILD/examples/payment_storm/payment_storm" "$@"
