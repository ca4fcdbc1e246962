#!/usr/bin/env python3
"""What one postXfer costs per descriptor, through NIXL's Python API.

Two agents in this process, each with only BACKEND: the initiator's
prepared list of DESCS blocks of BLOCK bytes (adjacent, NIXL's merging off,
as bench.py does) is written to the target's, one request made once and
posted again and again (bench.py's `repost` mode). Per post it records the
calling thread's CPU time and the wall time inside `transfer()` (postXfer
and NIXL's own work around it), and the wall time until `check_xfer_state`
says DONE. Prints one JSON row per size: medians, in ns per descriptor.
The target's bytes are checked after the last post.

A post may start moving bytes (ferry sends the first frames, or copies a
small same-host request, inside it; UCX posts its sends), so post CPU is an
upper bound on what the plugin itself adds per descriptor: issue 38 asks
for at most 150 ns.

    ~/.cache/ferry-peers/nixl/bin/python scripts/bench-nixl-post.py \\
        [--backend FERRY|UCX] [--transport memory|tcp] [--descs 1024,16384] \\
        [--block 64] [--iters 300]

Needs a venv with `nixl` (bench/peers/setup.sh nixl makes one; for FERRY,
the plugin installed: `ferry nixl install --python PYTHON`).
scripts/bench-nixl-backend.sh runs it beside bench/peers/nixl_bench.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="FERRY")
    p.add_argument("--transport", choices=["memory", "tcp"], default="memory")
    p.add_argument("--descs", default="1024,16384")
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--deadline-s", type=float, default=10.0, help="most one request may take")
    return p.parse_args()


def main() -> int:
    args = parse()
    code = measure(args)
    if args.backend == "UCX":
        # NIXL 1.5.1's UCX backend, two agents in one process, crashes in
        # its teardown at interpreter exit (SIGSEGV, every run here;
        # FERRY's exit is clean). The rows are out: skip the teardown.
        sys.stdout.flush()
        os._exit(code)
    return code


def measure(args: argparse.Namespace) -> int:
    if args.backend == "UCX":
        # NIXL's UCX backend picks its transports from the environment,
        # as bench/peers/nixl_bench.py sets it: its shared-memory
        # transports need error handling on to serve NIXL's endpoints.
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        if args.transport == "tcp":
            os.environ.setdefault("UCX_TLS", "tcp")
        else:
            os.environ.setdefault("UCX_TLS", "posix,cma,self")
            os.environ.setdefault("UCX_POSIX_ERROR_HANDLING", "y")
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config

    params = {"FERRY": {"transports": "tcp"} if args.transport == "tcp" else {}}
    agents = []
    for name in ("initiator", "target"):
        agent = nixl_agent(name, nixl_agent_config(backends=[]))
        agent.create_backend(args.backend, params.get(args.backend, {}))
        agents.append(agent)
    init, target = agents
    for descs in (int(d) for d in args.descs.split(",")):
        size = descs * args.block
        src = (np.arange(size, dtype=np.uint64) * 2654435761 >> 7).astype(np.uint8)
        dst = np.zeros(size, dtype=np.uint8)
        regs = [
            init.register_memory([(src.ctypes.data, size, 0, "")], "DRAM"),
            target.register_memory([(dst.ctypes.data, size, 0, "")], "DRAM"),
        ]
        peer = init.add_remote_agent(target.get_agent_metadata())
        offsets = range(0, size, args.block)
        local = init.prep_xfer_dlist(
            "NIXL_INIT_AGENT", [(src.ctypes.data + o, args.block, 0) for o in offsets], "DRAM"
        )
        remote = init.prep_xfer_dlist(
            peer, [(dst.ctypes.data + o, args.block, 0) for o in offsets], "DRAM"
        )
        idx = np.arange(descs, dtype=np.int32)
        handle = init.make_prepped_xfer("WRITE", local, idx, remote, idx, skip_desc_merge=True)
        post_cpu, post_wall, whole = [], [], []
        for _ in range(args.iters):
            w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            state = init.transfer(handle)
            c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
            give_up = w0 + int(args.deadline_s * 1e9)
            while state == "PROC":
                state = init.check_xfer_state(handle)
                if time.perf_counter_ns() > give_up:
                    break
            w2 = time.perf_counter_ns()
            if state != "DONE":
                raise SystemExit(f"{args.backend}: request ended {state}")
            post_cpu.append(c1 - c0)
            post_wall.append(w1 - w0)
            whole.append(w2 - w0)
        verified = bool(np.array_equal(dst, src))
        per = lambda xs: round(statistics.median(xs) / descs, 1)  # noqa: E731
        print(
            json.dumps(
                {
                    "backend": args.backend,
                    "transport": args.transport,
                    "descs": descs,
                    "block": args.block,
                    "iters": args.iters,
                    "post_cpu_ns_per_desc": per(post_cpu),
                    "post_wall_ns_per_desc": per(post_wall),
                    "request_ns_per_desc": per(whole),
                    "verified": verified,
                }
            ),
            flush=True,
        )
        init.release_xfer_handle(handle)
        init.release_dlist_handle(local)
        init.release_dlist_handle(remote)
        init.remove_remote_agent(peer)
        init.deregister_memory(regs[0])
        target.deregister_memory(regs[1])
        if not verified:
            print(f"{args.backend}: the target's bytes differ", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
