"""Strips the debug info from the binaries inside a wheel, in place.

    python3 scripts/strip_wheel.py WHEEL PATH...

Each PATH (inside the wheel) goes through `strip --strip-debug`, which keeps
the symbol table (a backtrace still names its functions), and its line in
the wheel's RECORD gets its new hash and size; every other entry is copied
as it was. scripts/wheel.sh runs it on a release wheel: the release profile
keeps line tables, which made up three quarters of the wheel.
"""

import base64
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile


def record_line(path: str, data: bytes) -> str:
    """A RECORD line: the path, its urlsafe-base64 SHA-256 without padding, its size."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def main() -> None:
    wheel, paths = sys.argv[1], set(sys.argv[2:])
    with zipfile.ZipFile(wheel) as zf:
        entries = [(info, zf.read(info)) for info in zf.infolist()]
    lines = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k, (info, data) in enumerate(entries):
            if info.filename not in paths:
                continue
            path = os.path.join(tmp, "binary")
            with open(path, "wb") as f:
                f.write(data)
            subprocess.run(["strip", "--strip-debug", path], check=True)
            with open(path, "rb") as f:
                entries[k] = (info, f.read())
            lines[info.filename] = record_line(info.filename, entries[k][1])
    missing = paths - lines.keys()
    if missing:
        sys.exit(f"strip_wheel: not in {wheel}: {sorted(missing)}")
    records = [info for info, _ in entries if info.filename.endswith(".dist-info/RECORD")]
    if len(records) != 1:
        sys.exit(f"strip_wheel: {wheel} has {len(records)} RECORD files")
    out = wheel + ".stripping"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for info, data in entries:
            if info is records[0]:
                rows = data.decode().splitlines()
                data = ("\n".join(lines.get(row.split(",", 1)[0], row) for row in rows) + "\n").encode()
            zf.writestr(info, data)
    os.replace(out, wheel)


if __name__ == "__main__":
    main()
