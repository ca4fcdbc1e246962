"""``python -m ferry.nixl install [--python PYTHON]``: installs the wheel's
NIXL plugin into a Python's NIXL (default: this one's); prints where it
went, one line per NIXL wheel."""

import argparse
import sys

from . import install


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m ferry.nixl")
    commands = parser.add_subparsers(dest="command", required=True)
    install_cmd = commands.add_parser(
        "install", help="put the FERRY plugin where a Python's NIXL loads plugins"
    )
    install_cmd.add_argument(
        "--python", help="the Python whose NIXL gets the plugin (default: this one)"
    )
    args = parser.parse_args()
    try:
        for path in install(args.python):
            print(path)
    except RuntimeError as e:
        print(f"python -m ferry.nixl: {e}", file=sys.stderr)
        return 1
    return 0


sys.exit(main())
