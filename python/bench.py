"""ferry's Python benchmark: the workloads of `ferry bench` (and of the NIXL
and Mooncake peer benchmarks), driven from Python, two processes.

The process you start is the initiator; it starts a target process (this
script, ``--role target``) that allocates a region and prints its handle.
Rows are JSON lines with `ferry bench --json`'s fields, plus ``system`` and
``workload``:

- ``bw``: one request of ``--blocks`` (4K x1024, 64K x1024, 1M x64, 16M x4)
  in flight at a time against a 256 MiB region, writes and reads; as
  one-shot submits (``--mode submit``, `ferry bench`) or transfer requests
  on prepared strided lists (``--mode prepared``, `ferry bench --prepared
  --strided`, NIXL's prepped requests);
- ``descs``: a request of 1,024 x 4 KiB descriptors whose index array numpy
  computes per request, made, posted and waited;
- ``lat``: one 8-byte write per request;
- ``idle``: the CPU an idle node (connected to its peer) uses, in % of a core.

Both sides' memory is ferry's (``--memory alloc``, `Node.alloc`: shared
through a mapping on one host) or the process's own, registered
(``--memory registered``: page-aligned anonymous memory, as NIXL's benchmark
registers, which another process reaches with ``process_vm_writev``).

    python bench.py --transport memory|tcp --workload bw|descs|lat|idle|all
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import subprocess
import sys
import time
from typing import Any, Dict, List, Tuple

import numpy as np

import ferry

REGION = 256 << 20
SIZES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def size(text: str) -> int:
    text = text.strip().upper()
    if text[-1] in SIZES:
        return int(text[:-1]) * SIZES[text[-1]]
    return int(text)


def region_of(node: ferry.Node, memory: str) -> ferry.Region:
    """REGION bytes of ``memory``'s kind, registered with ``node``."""
    if memory == "alloc":
        return node.alloc(REGION)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return node.register(mmap.mmap(-1, REGION, flags=flags))


def target(memory: str) -> None:
    """The served side: a region, its handle on stdout, then wait for EOF."""
    with ferry.Node() as node:
        region = region_of(node, memory)
        np.frombuffer(region, dtype=np.uint8)[:] = 0x5A
        print(json.dumps({"handle": region.remote().to_bytes().hex()}), flush=True)
        sys.stdin.read()


def percentile(sorted_us: List[float], p: float) -> float:
    return sorted_us[min(len(sorted_us) - 1, round((len(sorted_us) - 1) * p))]


def row(transport: str, memory: str, workload: str, op: str, block: int, batch: int,
        prepared: bool, lat_ns: List[int], seconds: float, first_us: float,
        **extra: Any) -> Dict[str, Any]:
    lat_us = sorted(x / 1000 for x in lat_ns)
    n = len(lat_us)
    total = block * batch * n
    return dict(
        system="ferry-python", workload=workload, op=op, transport=transport, via="python",
        workers=1, streams=1, block=block, batch=batch, notify=0, submits=n, bytes=total,
        seconds=seconds, gbps=total / seconds / 1e9, mops=n * batch / seconds / 1e6,
        lat_avg_us=sum(lat_us) / n, lat_p50_us=percentile(lat_us, 0.5),
        lat_p99_us=percentile(lat_us, 0.99), verified=False, prepared=prepared,
        first_us=first_us, peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        registered=REGION, memory=memory, **extra,
    )


def timed(run: Any, duration: float, warmup: int) -> Tuple[List[int], float, float]:
    """Runs ``run()`` ``warmup`` times, then for ``duration`` seconds; the
    latencies (ns), the measured seconds, and the first call's µs."""
    t = time.perf_counter_ns()
    run()
    first_us = (time.perf_counter_ns() - t) / 1000
    for _ in range(warmup):
        run()
    lat: List[int] = []
    start = time.perf_counter_ns()
    end = start + int(duration * 1e9)
    now = start
    while now < end:
        t = time.perf_counter_ns()
        run()
        now = time.perf_counter_ns()
        lat.append(now - t)
    return lat, (now - start) / 1e9, first_us


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=["initiator", "target"], default="initiator")
    p.add_argument("--transport", choices=["memory", "tcp"], default="memory")
    p.add_argument("--workload", choices=["bw", "descs", "lat", "idle", "all"], default="all")
    p.add_argument("--mode", choices=["submit", "prepared"], default="submit")
    p.add_argument("--memory", choices=["alloc", "registered"], default="alloc",
                   help="ferry's memory (Node.alloc) or the process's, registered")
    p.add_argument("--blocks", default="4K:1024,64K:1024,1M:64,16M:4",
                   help="block:ops per request, comma separated")
    p.add_argument("--op", choices=["write", "read", "both"], default="both")
    p.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--idle-seconds", type=float, default=10.0)
    p.add_argument("--shuffle", action="store_true", help="descs: random blocks per request")
    args = p.parse_args()
    if args.role == "target":
        return target(args.memory)

    env = dict(os.environ)
    if args.transport == "tcp":
        env["FERRY_DISABLE_MEMORY"] = "1"
        os.environ["FERRY_DISABLE_MEMORY"] = "1"
    peer = subprocess.Popen([sys.executable, __file__, "--role", "target", "--memory", args.memory],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout is not None
        handle = ferry.RemoteRegion.from_bytes(bytes.fromhex(json.loads(peer.stdout.readline())["handle"]))
        with ferry.Node() as node:
            assert args.transport in node.transports(), node.transports()
            local = region_of(node, args.memory)
            np.frombuffer(local, dtype=np.uint8)[:] = 0xA5
            node.connect(handle.owner)
            workloads = ["bw", "descs", "lat", "idle"] if args.workload == "all" else [args.workload]
            ops = ["write", "read"] if args.op == "both" else [args.op]
            for workload in workloads:
                for r in run_workload(workload, args, node, local, handle, ops):
                    print(json.dumps(r), flush=True)
    finally:
        if peer.stdin is not None:
            peer.stdin.close()
        peer.wait(timeout=30)


def run_workload(workload: str, args: argparse.Namespace, node: ferry.Node, local: ferry.Region,
                 handle: ferry.RemoteRegion, ops: List[str]) -> List[Dict[str, Any]]:
    rows = []
    t = args.transport
    if workload == "bw":
        for spec in args.blocks.split(","):
            block_text, batch_text = spec.split(":")
            block, batch = size(block_text), int(batch_text)
            for op in ops:
                if args.mode == "submit":
                    make = ferry.Op.write if op == "write" else ferry.Op.read
                    batch_ops = [make(local, handle, local_offset=i * block, remote_offset=i * block,
                                      length=block) for i in range(batch)]

                    def run() -> None:
                        node.submit(batch_ops, 30.0)
                else:
                    n = REGION // block
                    ldescs = ferry.LocalDescs([local], strided=ferry.Strided(0, 0, block, block, n))
                    prepared = node.prepare_remote(
                        ferry.RemoteDescs([handle], strided=ferry.Strided(0, 0, block, block, n)))
                    xfer = node.make_xfer(op.upper(), ldescs, range(batch), prepared, range(batch))

                    def run() -> None:
                        xfer.post(30.0)
                        xfer.wait()
                lat, secs, first = timed(run, args.duration, args.warmup)
                rows.append(row(t, args.memory, "bw", op, block, batch, args.mode == "prepared", lat, secs, first))
    elif workload == "descs":
        block, batch = 4096, 1024
        n = REGION // block
        ldescs = ferry.LocalDescs([local], strided=ferry.Strided(0, 0, block, block, n))
        prepared = node.prepare_remote(
            ferry.RemoteDescs([handle], strided=ferry.Strided(0, 0, block, block, n)))
        # The blocks of a request: the same 1,024 every time unless
        # --shuffle, as `ferry bench --prepared` moves its share's blocks,
        # so that the bytes touched (and the caches) are the same and the
        # difference is Python's; numpy computes the index array anew per
        # request, as a connector computes its block table.
        rng = np.random.default_rng(7)
        for op in ops:
            kind = op.upper()
            # What the caller's thread spends per request before it goes
            # back to its own work (index array, make_xfer, post), as a
            # connector that polls status() once per step sees it.
            posting: List[int] = []

            def run() -> None:
                t0 = time.perf_counter_ns()
                if args.shuffle:
                    idx = rng.choice(n, batch, replace=False).astype(np.uint32)
                else:
                    idx = np.arange(batch, dtype=np.uint32)
                xfer = node.make_xfer(kind, ldescs, idx, prepared, idx)
                xfer.post(30.0)
                posting.append(time.perf_counter_ns() - t0)
                xfer.wait()
            lat, secs, first = timed(run, args.duration, args.warmup)
            post_us = sorted(posting)[len(posting) // 2] / 1000
            rows.append(row(t, args.memory, "descs", op, block, batch, True, lat, secs, first, post_us=post_us))
    elif workload == "lat":
        one = [ferry.Op.write(local, handle, length=8)]

        def run() -> None:
            node.submit(one, 5.0)
        lat, secs, first = timed(run, args.duration, args.warmup * 50)
        rows.append(row(t, args.memory, "lat", "write", 8, 1, False, lat, secs, first))
    elif workload == "idle":
        before = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.monotonic()
        time.sleep(args.idle_seconds)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        wall = time.monotonic() - t0
        rows.append(dict(system="ferry-python", workload="idle", transport=t,
                         seconds=wall, cpu_seconds=cpu, core_percent=100 * cpu / wall))
    return rows


if __name__ == "__main__":
    main()
