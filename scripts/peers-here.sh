# Sourced by the scripts that measure ferry against NIXL and Mooncake over
# TCP loopback: the peers' benchmarks ($NIXL_BENCH, $MOONCAKE_BENCH: the
# project's own, in bench/peers/) and their venvs ($NIXL_PY, $MOONCAKE_PY:
# bench/peers/venvs.sh), `peers_setup [nixl] [mooncake]`, which makes those
# venvs when they are missing (bench/peers/setup.sh: the one setup step
# every such script shares), a release `ferry` ($ferry), and serve_tcp
# ARGS..., which starts one `ferry serve` moving data over TCP only
# (256 MiB region, same-host path off), waits (at most 60 s) for its
# handle file, $dir/h, and stops it on exit.
source bench/peers/venvs.sh
NIXL_BENCH=bench/peers/nixl_bench.py
MOONCAKE_BENCH=bench/peers/mooncake_bench.py
peers_setup() {
    bench/peers/setup.sh "$@" >&2
}
# FERRY_PROFILE=debug takes the debug build instead: for smoke runs, which
# check the scripts rather than the figures, and share the test suite's build.
# ($ferry_plugin, the NIXL plugin of that build, is set too.)
if [ "${FERRY_PROFILE:-release}" = debug ]; then
    source scripts/test-build.sh
    ferry_test_build -q
    ferry=$ferry_bin
else
    cargo build --release --locked -q -p ferry-cli
    source scripts/target-dir.sh
    ferry=$target_dir/release/ferry
fi

serve_tcp() {
    dir=$(mktemp -d)
    FERRY_DISABLE_MEMORY=1 $ferry serve --size 256M --no-ibverbs --handle-file "$dir/h" "$@" \
        >/dev/null 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null || true; rm -rf "$dir"' EXIT
    local i=0
    until [ -s "$dir/h" ]; do
        i=$((i + 1)); [ $i -lt 600 ] || { echo "serve wrote no handle" >&2; exit 1; }
        sleep 0.1
    done
}
