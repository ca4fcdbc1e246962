"""One side of a KV hand-off in a process of its own, for test_layouts.py.

    python layout_peer.py SPEC_JSON

SPEC: {"model": Model fields, "side": Side fields, "role": "prefill" |
"decode", "seed", "tokens", "table"}. It starts a node per rank, gives each
a pool (a prefill's holds tokens ``0..tokens`` of the logical KV of
``seed`` through ``table``; a decode's is zeroed), prints one JSON line
``{"layouts": [hex of RankLayout.to_bytes() per rank]}``, then answers
commands, one JSON line each, until stdin closes:

``{"op": "notifications", "count": n}`` -> ``{"got": [[body, ...] per rank]}``
    (waits until every rank got ``n`` in all, or 30 s)
``{"op": "check"}`` -> ``{"equal": [per rank]}``: a decode rank's pool
    against the reference (tokens ``0..tokens`` through ``table``)
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Dict, List

import numpy as np

import ferry
from kv_layouts import Model, Side, expected, layout, logical, per_layer, pool_shape, scatter


def main() -> int:
    spec = json.loads(sys.argv[1])
    model, side = Model(**spec["model"]), Side(**spec["side"])
    kv = logical(model, int(spec["seed"]))
    table = np.array(spec["table"], dtype=np.int64)
    tokens = int(spec["tokens"])
    nodes: List[ferry.Node] = []
    pools: List[Any] = []
    keep: List[Any] = []
    layouts = []
    for r in range(side.tp):
        node = ferry.Node()
        nodes.append(node)
        pool = np.zeros(pool_shape(model, side, r), dtype=model.dtype)
        if spec["role"] == "prefill":
            scatter(model, side, r, pool, kv, table, tokens)
        if side.layers == "per_layer":
            arrays = per_layer(model, side, r, pool)
            regions: Any = [node.register(a) for a in arrays]
            pools.append(arrays)
            rank = layout(model, side, r, arrays, regions)
        else:
            regions = node.register(pool)
            pools.append(pool)
            rank = layout(model, side, r, pool, regions)
        keep.append(regions)
        layouts.append(rank.to_bytes().hex())
    print(json.dumps({"layouts": layouts}), flush=True)

    for line in sys.stdin:
        command: Dict[str, Any] = json.loads(line)
        if command["op"] == "notifications":
            got: List[List[str]] = [[] for _ in nodes]
            deadline = time.monotonic() + 30.0
            while sum(map(len, got)) < int(command["count"]) and time.monotonic() < deadline:
                for i, node in enumerate(nodes):
                    got[i].extend(d.body.decode() for d in node.notifications())
                time.sleep(0.005)
            print(json.dumps({"got": [g for g in got if g]}), flush=True)
        elif command["op"] == "check":
            equal = []
            for r, pool in enumerate(pools):
                whole = np.stack(pool, axis=1) if isinstance(pool, list) else pool
                equal.append(bool(np.array_equal(whole, expected(model, side, r, kv, table, tokens))))
            print(json.dumps({"equal": equal}), flush=True)
    for node in nodes:
        node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
