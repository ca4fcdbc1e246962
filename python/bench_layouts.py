"""What layouts and plans cost from Python: a KV cache of 32 layers, 8 KV
heads of 128 fp16 elements, prefill TP 4 (blocks of 16 tokens) to decode
TP 2 (blocks of 32), NHD or HND on each side; one request of 4,096 tokens.

    python bench_layouts.py [--repeat N]

Prints, per case: the plan's segments and the time to plan (with the node:
checking, compiling, preparing the peers' memory), then per request the
descriptors it moves, the time of ``plan.request`` (tables in, an Xfer
out), of ``descriptor_count``, and of ``NixlPlan.indices``, medians of
``--repeat`` calls; and the rows of NIXL's prepared lists. Nothing is
posted: the pools are never touched, so their pages are never allocated.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, List, Tuple

import numpy as np

import ferry

LAYERS, HEADS, DIM, MAX_TOKENS = 32, 8, 128, 8192
PREFILL = (4, 16, 512)  # tp, block tokens, blocks
DECODE = (2, 32, 256)
TOKENS = 4096


def rank_layout(rank: int, tp: int, block: int, blocks: int, order: str, node: Any) -> Tuple[ferry.RankLayout, Any]:
    heads = HEADS // tp
    inner = (block, heads) if order == "NHD" else (heads, block)
    pool = np.zeros((2, LAYERS, blocks, *inner, DIM), dtype=np.float16)
    region = node.register(pool) if node is not None else pool
    names = ("token", "head") if order == "NHD" else ("head", "token")
    tensors = [
        ferry.TensorLayout.from_array(
            name, pool[i], region, axes=("layer", "block", *names, "dim"),
            paged=("token", "block"), table="kv",
            global_sizes={"token": MAX_TOKENS}, parts={"head": (rank, tp)},
        )
        for i, name in enumerate(("k", "v"))
    ]
    return ferry.RankLayout(rank, tensors), (pool, region)


def median(call: Callable[[], Any], repeat: int) -> float:
    times: List[float] = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    theirs = rng.permutation(PREFILL[2])[: TOKENS // PREFILL[1]]
    ours = rng.permutation(DECODE[2])[: TOKENS // DECODE[1]]
    for prefill_order, decode_order in (("HND", "HND"), ("NHD", "NHD"), ("NHD", "HND")):
        keep = []
        with ferry.Node() as decode_node:
            prefill_nodes = [ferry.Node() for _ in range(PREFILL[0])]
            try:
                peers = []
                for r, node in enumerate(prefill_nodes):
                    layout, held = rank_layout(r, *PREFILL, prefill_order, node)
                    keep.append(held)
                    peers.append(ferry.RankLayout.from_bytes(layout.to_bytes()))
                mine, held = rank_layout(0, *DECODE, decode_order, decode_node)
                keep.append(held)
                started = time.perf_counter()
                plan = decode_node.plan_transfer(mine, peers)
                planned = time.perf_counter() - started
                descs = plan.descriptor_count(TOKENS, ours, theirs)
                request = median(lambda: plan.request(TOKENS, ours, theirs), args.repeat)
                count = median(lambda: plan.descriptor_count(TOKENS, ours, theirs), args.repeat)
                nixl = ferry.nixl_plan(mine, peers)
                rows = len(nixl.local_descs())
                indices = median(lambda: nixl.indices(TOKENS, ours, theirs), args.repeat)
                pairs = sum(len(li) for li, _ in nixl.indices(TOKENS, ours, theirs).values())
                print(
                    f"prefill {prefill_order} -> decode {decode_order}: plan {plan.segments} segments "
                    f"in {planned * 1e3:.1f} ms (with preparing {len(plan.remote_ranks)} peers); "
                    f"a {TOKENS}-token request: {descs} descriptors, plan.request {request * 1e3:.2f} ms "
                    f"({request / descs * 1e9:.0f} ns/descriptor), descriptor_count {count * 1e3:.2f} ms; "
                    f"NIXL: {rows} local rows, indices {indices * 1e3:.2f} ms for {pairs} pairs"
                )
            finally:
                for node in prefill_nodes:
                    node.close()


if __name__ == "__main__":
    main()
