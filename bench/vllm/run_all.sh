#!/usr/bin/env bash
# The vLLM check (README.md): vLLM 0.33's own NixlConnector between two CPU
# engines, over UCX and FERRY, for each TP pair and block sizes below, then
# the per-request timing outside vLLM. About 15 minutes on 2 cores.
# Run bench/vllm/setup.sh first.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=../peers/venvs.sh
source "$here/../peers/venvs.sh"
py=$FERRY_PEERS_VENVS/vllm/bin/python
export FERRY_VLLM_CHECK=${FERRY_VLLM_CHECK:-$FERRY_PEERS_VENVS/vllm-check}
runs=$FERRY_VLLM_CHECK/runs
mkdir -p "$runs"
run() { # name, run_pd.py's arguments
    local name=$1
    shift
    timeout 900 "$py" "$here/run_pd.py" "$@" --out "$runs/$name" >"$runs/$name.out" 2>&1
    cat "$runs/$name.out"
    grep "\[decode\] req" "$runs/$name/decode.log"
    "$py" "$here/analyze.py" "$runs/$name" --json "$runs/$name/analysis.json" | tail -n 1
}
for backend in UCX FERRY; do
    run "p2d1-$backend" --ptp 2 --dtp 1 --backend "$backend" --requests 3
    run "p1d2-$backend" --ptp 1 --dtp 2 --backend "$backend" --requests 3
    run "p1d2-bs32-64-$backend" --ptp 1 --dtp 2 --pbs 32 --dbs 64 --backend "$backend" --requests 3
done
# The pairs vLLM refuses: its error in decode.log, no tokens in done-0.json.
run refuse-p2d1-bs32-64 --ptp 2 --dtp 1 --pbs 32 --dbs 64 --backend UCX --requests 1
run refuse-p1d1-bs64-32 --ptp 1 --dtp 1 --pbs 64 --dbs 32 --backend UCX --requests 1
# Time per request outside vLLM's step loop, on the same geometry.
: >"$FERRY_VLLM_CHECK/bench_results.jsonl"
for r in p2d1-UCX p1d2-UCX p1d2-bs32-64-UCX; do
    for backend in UCX FERRY; do
        timeout 300 "$py" "$here/bench_replay.py" "$runs/$r" --backend "$backend" --iters 300 2>/dev/null |
            tail -n 1 >>"$FERRY_VLLM_CHECK/bench_results.jsonl"
    done
done
"$py" "$here/summarize.py"
