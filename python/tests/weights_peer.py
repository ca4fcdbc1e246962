"""One publisher rank of the test weight set in a process of its own, for
test_weights.py.

    python weights_peer.py SET RANK RANKS

It starts a node, publishes rank RANK of RANKS (``weights_set``) as SET,
prints one JSON line ``{"addr": node address, "pid": pid}``, then answers
commands, one JSON line each, until stdin closes:

``{"op": "publish", "version": v}`` -> ``{"overrun": n}``: writes version
    ``v`` and publishes it; a typed error comes back as ``{"error": class
    name, "version": ..., "last": ...}``
``{"op": "run", "first": a, "last": z, "gap": s, "write_timeout": t}`` ->
    ``{"overrun": total}``: publishes ``a..=z``, ``s`` seconds apart, each
    write waiting ``t`` seconds at most for readers
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict

import ferry
from weights_set import PublisherRank

TIMEOUT = 30.0


def say(answer: Dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


def publish(publisher: ferry.Publisher, me: PublisherRank, version: int, timeout: float) -> int:
    with publisher.write(timeout=timeout) as guard:
        me.fill(version)
        guard.publish(version)
    return guard.overrun


def main() -> int:
    set_name, rank, ranks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with ferry.Node() as node:
        me = PublisherRank(node, rank, ranks)
        with ferry.Publisher(node, set_name, me.layout) as publisher:
            say({"addr": str(node.addr), "pid": os.getpid()})
            for line in sys.stdin:
                command: Dict[str, Any] = json.loads(line)
                if command["op"] == "publish":
                    try:
                        say({"overrun": publish(publisher, me, int(command["version"]), TIMEOUT)})
                    except ferry.WeightsError as error:
                        say({"error": type(error).__name__, "version": error.version,
                             "last": getattr(error, "last", None)})
                elif command["op"] == "run":
                    overrun = 0
                    for version in range(int(command["first"]), int(command["last"]) + 1):
                        overrun += publish(publisher, me, version, float(command["write_timeout"]))
                        time.sleep(float(command["gap"]))
                    say({"overrun": overrun})
    return 0


if __name__ == "__main__":
    sys.exit(main())
