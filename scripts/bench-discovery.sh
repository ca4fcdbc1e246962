#!/usr/bin/env bash
# Discovery's numbers: metadata blob size for 1,000 regions, lookup by name
# warm and cold, and kill -9 to gone (p50 over 20). Starts its own etcd on
# loopback with a temporary data directory, and stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install-deps.sh
ferry_install_deps etcd-server
cargo build --release --locked -q -p ferry-cli
cargo build --release --locked -q --features etcd --example discovery_timing
source scripts/target-dir.sh
timing=$target_dir/release/examples/discovery_timing
ferry=$target_dir/release/ferry

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
client=$(port); peer=$(port); data=$(mktemp -d)
etcd --name bench --data-dir "$data" \
    --listen-client-urls "http://127.0.0.1:$client" --advertise-client-urls "http://127.0.0.1:$client" \
    --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
    --initial-cluster "bench=http://127.0.0.1:$peer" >/dev/null 2>&1 &
etcd_pid=$!
trap 'kill $etcd_pid 2>/dev/null || true; wait $etcd_pid 2>/dev/null || true; rm -rf "$data"' EXIT
url=http://127.0.0.1:$client
for _ in $(seq 100); do "$ferry" ls --etcd "$url" >/dev/null 2>&1 && break; sleep 0.1; done

"$timing" blob
"$timing" lookup "$url" "$ferry"
"$timing" expiry "$url" "$ferry"
