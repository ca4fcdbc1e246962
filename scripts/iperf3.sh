# Sourced by the benchmarks that set ferry's TCP against iperf3 over
# loopback, so that each measures the reference the same way.
#
# iperf3 3.12 (Debian 12) runs all -P streams of one process on one
# thread, while ferry uses every core, so one `iperf3 -P N` understates
# what loopback TCP can do: the scripts also measure N single-stream
# processes at once (iperf3_sum N 1 ...) and compare with the faster.
# Install iperf3 first (scripts/install-deps.sh: ferry_install_deps iperf3).

# iperf3_sum PROCS STREAMS_PER_PROC SECONDS PORT DIR [-R]: PROCS iperf3
# pairs at once on 127.0.0.1 (ports PORT to PORT+PROCS-1), each client with
# -P STREAMS_PER_PROC for SECONDS (whole seconds); prints their summed GB/s
# (1e9 B/s), from the receivers' counts. -R: the servers send. Their JSON
# goes through DIR. Fails when a client failed.
iperf3_sum() {
    local procs=$1 per=$2 seconds=$3 port=$4 dir=$5 reverse=${6:-} i servers=() clients=() rc=0
    for ((i = 0; i < procs; i++)); do
        # (a time limit, so that no server outlives an interrupted run)
        timeout $((seconds + 60)) iperf3 -s -B 127.0.0.1 -p $((port + i)) -1 >/dev/null 2>&1 &
        servers+=($!)
    done
    # The servers need a moment to listen; wait only while a port is closed.
    for ((i = 0; i < procs; i++)); do
        for _ in $(seq 50); do
            ss -ltn "sport = :$((port + i))" | grep -q LISTEN && break
            sleep 0.1
        done
    done
    for ((i = 0; i < procs; i++)); do
        timeout $((seconds + 30)) iperf3 -c 127.0.0.1 -p $((port + i)) -P "$per" -t "$seconds" -J \
            $reverse >"$dir/iperf3.$i.json" &
        clients+=($!)
    done
    for i in "${clients[@]}"; do wait "$i" || rc=1; done
    for i in "${servers[@]}"; do
        timeout 10 tail --pid="$i" -f /dev/null || kill "$i" 2>/dev/null || true
    done
    ((rc == 0)) && python3 -c 'import json, sys
print(sum(json.load(open(f))["end"]["sum_received"]["bits_per_second"] for f in sys.argv[1:]) / 8 / 1e9)' \
        "$dir"/iperf3.*.json || rc=1
    rm -f "$dir"/iperf3.*.json
    return $rc
}
