#!/usr/bin/env bash
# Measures what a user of the wheel waits for: the wheel's size, the time
# from `pip install` of it into a fresh virtual environment to a first
# verified transfer (a Python node reads another's region over same-host
# memory and over TCP, bytes compared), and `import ferry`'s time (the
# median of 5 fresh interpreters, less an empty interpreter's). No network,
# no compiler: the wheel has no dependencies.
#
#   scripts/install-time.sh WHEEL
set -euo pipefail
wheel=$(readlink -f "$1")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
printf 'wheel: %s, %.1f MiB\n' "$(basename "$wheel")" "$(($(stat -c %s "$wheel") * 10 / 1048576))e-1"
start=$(date +%s.%N)
python3 -m venv "$dir/venv"
venv_done=$(date +%s.%N)
"$dir/venv/bin/pip" install -q --no-index --disable-pip-version-check "$wheel"
installed=$(date +%s.%N)
(cd "$dir" && "$dir/venv/bin/python" - <<'PY'
import os, ferry
payload = os.urandom(4 << 20)
for transport in ("memory", "tcp"):
    with ferry.Node() as owner, ferry.Node(memory=(transport == "memory")) as reader:
        region = owner.register(bytearray(payload))
        got = bytearray(len(payload))
        reader.read(reader.register(got), region.remote(), timeout=30.0)
        assert got == payload, f"{transport}: bytes differ"
        print(f"verified 4 MiB read over {transport} ({', '.join(reader.transports())} running)")
PY
)
done_at=$(date +%s.%N)
awk -v s="$start" -v v="$venv_done" -v i="$installed" -v d="$done_at" 'BEGIN {
    printf "fresh venv: %.1f s; pip install: %.1f s; first verified transfers: %.1f s; pip install to verified: %.1f s\n",
        v - s, i - v, d - i, d - v }'
times() { for _ in 1 2 3 4 5; do
    a=$(date +%s%N); "$dir/venv/bin/python" -c "$1"; b=$(date +%s%N); echo $(((b - a) / 1000000))
done | sort -n | sed -n 3p; }
empty=$(times pass)
imported=$(times 'import ferry')
echo "import ferry: $((imported - empty)) ms (python -c 'import ferry' $imported ms, empty interpreter $empty ms; medians of 5)"
