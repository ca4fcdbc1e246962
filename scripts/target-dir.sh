# Sourced by the scripts that run what cargo built: where cargo puts it.
# Not always ./target: CARGO_TARGET_DIR, build.target-dir in a cargo config
# or a shared build cache move it, and a script that assumed ./target ran a
# stale binary or none. Sets $target_dir to cargo's own answer.
target_dir=$(cargo metadata --format-version 1 --no-deps --locked |
    sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
[ -n "$target_dir" ] || { echo "cannot ask cargo for its target directory" >&2; exit 1; }
