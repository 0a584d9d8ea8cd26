#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# rediss:// through idem's TLS relay, side by side with the two alternatives (see README.md):
# the same calls through a stunnel client (TLS in another process: redis:// to stunnel), and over
# plain TCP (no TLS). Run by scripts/bench.sh (IDEM_BENCH_BUILD). A private redis-server serves
# both a plain and a TLS port (certificates made now); 1-thread runs pin the server, stunnel and
# the client to CPU 0 (per-call cost, as bench/redis does); 8-thread runs are unpinned.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
BUILD="${IDEM_BENCH_BUILD:?IDEM_BENCH_BUILD is not set (scripts/bench.sh sets it)}"
BIN="$BUILD/bench/redis_tls/idem_redis_tls_bench"
[ -x "$BIN" ] || { echo "bench/redis_tls: $BIN not built (IDEM_WITH_REDIS=OFF?)" >&2; exit 1; }
command -v stunnel4 >/dev/null || { echo "bench/redis_tls: stunnel4 is not installed" >&2; exit 1; }

# Ports: IDEM_BENCH_TLS_PORT (plain), +1 (TLS), +2 (stunnel); default IDEM_REDIS_PORT + 1100.
base="${IDEM_BENCH_TLS_PORT:-$(( ${IDEM_REDIS_PORT:-16379} + 1100 ))}"
plain=$base tls=$((base + 1)) tunnel=$((base + 2))
dir="$(mktemp -d /tmp/idem-bench-tls.XXXXXX)"
certs="$(IDEM_SERVERS_DIR="$dir" "$ROOT/scripts/servers.sh" tls-certs)"
stop_private() {
  redis-cli -h 127.0.0.1 -p "$plain" SHUTDOWN NOSAVE >/dev/null 2>&1 || true
  [ -s "$dir/stunnel.pid" ] && kill "$(cat "$dir/stunnel.pid")" 2>/dev/null || true
  rm -rf "$dir"
}
trap stop_private EXIT
taskset -c 0 redis-server --port "$plain" --tls-port "$tls" --bind 127.0.0.1 --dir "$dir" \
  --save '' --appendonly no --daemonize yes --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" \
  --tls-cert-file "$certs/server.pem" --tls-key-file "$certs/server-key.pem" \
  --tls-ca-cert-file "$certs/ca.pem" --tls-auth-clients no
# stunnel as a client-side tunnel, verifying as idem does (chain, host name, SNI).
cat >"$dir/stunnel.conf" <<CONF
pid = $dir/stunnel.pid
output = $dir/stunnel.log
[redis]
client = yes
accept = 127.0.0.1:$tunnel
connect = 127.0.0.1:$tls
CAfile = $certs/ca.pem
verifyChain = yes
checkHost = localhost
sni = localhost
CONF
taskset -c 0 stunnel4 "$dir/stunnel.conf"
for _ in $(seq 1 100); do
  [ "$(redis-cli -h 127.0.0.1 -p "$plain" PING 2>/dev/null || true)" = "PONG" ] &&
    [ "$(redis-cli -h 127.0.0.1 -p "$tunnel" PING 2>/dev/null || true)" = "PONG" ] && break
  sleep 0.1
done
echo "redis-server $(redis-server --version | sed 's/.*v=\([^ ]*\).*/\1/'), $(stunnel4 -version 2>&1 | grep -m1 '^stunnel'); A = rediss:// (idem relay)"
relay="rediss://localhost:$tls"
taskset -c 0 "$BIN" --a "$relay" --b "redis://127.0.0.1:$tunnel" --ca "$certs/ca.pem" \
  --name redis_tls_relay_over_stunnel --threads 1 --ops 2000 --rounds 21
taskset -c 0 "$BIN" --a "$relay" --b "redis://127.0.0.1:$plain" --ca "$certs/ca.pem" \
  --name redis_tls_over_plain --threads 1 --ops 2000 --rounds 21
"$BIN" --a "$relay" --b "redis://127.0.0.1:$tunnel" --ca "$certs/ca.pem" \
  --name redis_tls_relay_over_stunnel_8_threads_unpinned --threads 8 --ops 1000 --rounds 11
"$BIN" --a "$relay" --b "redis://127.0.0.1:$plain" --ca "$certs/ca.pem" \
  --name redis_tls_over_plain_8_threads_unpinned --threads 8 --ops 1000 --rounds 11
