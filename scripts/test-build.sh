# Sourced by the scripts that run ferry's debug binaries beside the test
# suite (python-tests.sh, nixl-tests.sh, the RDMA VM tests, smoke runs of
# the performance page). ferry_test_build [CARGO TEST FLAGS...] builds what
# `cargo test --workspace --all-targets --all-features` builds, so that in
# scripts/test.sh, right after that step, it compiles nothing: a `cargo
# build -p ferry-cli`, a `cargo test -p ferry` or a `cargo run --example`
# there unifies features over other packages (no dev-dependencies of the
# rest of the workspace, no etcd) and rebuilt tokio, kameo and the ferry
# crates once per script, minutes of CI's 45 on 2 cores. Extra flags (e.g.
# `--test ibverbs`) narrow what is built, not how.
#
# Sets, from cargo's own artifact messages:
#   ferry_bin     the `ferry` CLI
#   ferry_plugin  the NIXL plugin, libplugin_FERRY.so
#   ferry_tests   NAME=PATH per integration test binary built, one per line
#   ferry_examples  NAME=PATH per example built, one per line
# Needs python3 (to read cargo's JSON), and $target_dir is set as
# scripts/target-dir.sh sets it.
ferry_test_build() {
    local artifacts
    artifacts=$(cargo test --workspace --all-features --locked --no-run \
        --message-format=json-render-diagnostics "$@" | python3 -c '
import json, sys
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("reason") != "compiler-artifact":
        continue
    kind, name, exe = msg["target"]["kind"], msg["target"]["name"], msg.get("executable")
    if "bin" in kind and exe and not msg["profile"]["test"]:
        print("bin", name + "=" + exe)
    elif "test" in kind and exe:
        print("test", name + "=" + exe)
    elif "example" in kind and exe:
        print("example", name + "=" + exe)
    elif "cdylib" in kind:
        for path in msg["filenames"]:
            if path.endswith(".so"):
                print("cdylib", name + "=" + path)
') || return 1
    ferry_bin=$(sed -n 's/^bin ferry=//p' <<<"$artifacts")
    ferry_plugin=$(sed -n 's/^cdylib plugin_FERRY=//p' <<<"$artifacts")
    ferry_tests=$(sed -n 's/^test //p' <<<"$artifacts")
    ferry_examples=$(sed -n 's/^example //p' <<<"$artifacts")
    # Every path cargo named must be there: a missing one would otherwise
    # surface later as some script's "command not found". (What a narrowed
    # build did not make stays unset.)
    local path
    for path in "$ferry_bin" "$ferry_plugin" \
        $(printf '%s\n%s\n' "$ferry_tests" "$ferry_examples" | sed 's/^[^=]*=//'); do
        [ -z "$path" ] || [ -e "$path" ] || {
            echo "ferry_test_build: cargo built $path, but it is not there" >&2
            return 1
        }
    done
    source scripts/target-dir.sh
}
