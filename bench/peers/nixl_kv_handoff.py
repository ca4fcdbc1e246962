#!/usr/bin/env python3
"""A KV-cache hand-off through NVIDIA NIXL, driven as vLLM's NixlConnector
drives it: what a decode rank's caller spends per request (issue 56's
"Performance": caller CPU against a NIXL connector today).

The workload (examples/kv_handoff_bench/ runs the same one through
ferry's layout planner):

  model    32 layers, 8 KV heads of head_dim 128, 2-byte elements, blocks
           of 16 tokens, HND (a block is [heads][16 tokens][128]), K and V
           separate tensors: one region per layer and tensor, 64 per rank,
           as vLLM registers them (K and V in different regions).
  pools    320 blocks per region. Prefill TP 4: 2 heads per rank, an 8 KiB
           block. Decode TP 2: 4 heads per rank, a 16 KiB block.
  request  4,096 tokens = 256 blocks; a decode (local) and a prefill
           (remote) block table, 256 distinct ids of 0..320 each, drawn
           afresh for every request (seeded). Decode rank 0 READs (pulls)
           from prefill ranks 0 and 1, which hold its heads 0-1 and 2-3:
           prefill rank r's block lands in the decode block at r x 8 KiB.
           32 layers x 2 (K, V) x 256 blocks x 2 ranks = 32,768 READs of
           8 KiB = 256 MiB.

Processes: this one is decode rank 0 (one NIXL agent). It starts this
program again as the prefill process (``--role prefill``), which holds
prefill ranks 0 and 1, one NIXL agent each (as two vLLM workers would),
and polls both for notifications. Prefill ranks 2 and 3 serve decode rank
1 and are not run. A socket pair carries the control messages (agent
metadata, "count your notifications", "quit"); the bytes go through NIXL.

What is mirrored from vLLM (vllm/distributed/kv_transfer/kv_connector/v1/
nixl/, worker.py and transfer_plan.py at the time of writing):

- registration (``NixlConnectorWorker.register_kv_caches``): every
  region in one ``register_memory`` call, "DRAM" (vLLM's CPU KV buffers).
- the descriptor lists, prepared once (``prep_xfer_dlist``), region-major
  then block: remote, per prefill rank, each region's blocks whole
  (``build_remote_descs_from_plan``, called from ``add_remote_agent``);
  local, per prefill rank, a list of the decode blocks' slices that rank
  fills, rank r at r x 8 KiB (``build_local_splits_from_plan``: vLLM
  prepares one local list per source rank when P TP > D TP,
  ``src_xfer_handles_by_tp_ratio``).
- a request (``_read_blocks_for_req`` then ``_read_blocks``), per prefill
  rank in turn: the local and remote index arrays from the Python block
  tables with numpy, ``region x num_blocks + block``
  (``compute_desc_ids_from_plan``, formerly ``_get_block_descs_ids``);
  ``make_prepped_xfer("READ", ..., notif_msg=b"<request id>:<decode TP>")``
  with NIXL's descriptor merging left on (vLLM does not pass
  ``skip_desc_merge``; ``--skip-desc-merge`` turns it off); ``transfer``.
- the wait (``_pop_done_transfers``): ``check_xfer_state`` of each handle
  until DONE, then ``get_xfer_telemetry`` (vLLM creates its agent with
  ``capture_telemetry=True``; ``--no-telemetry`` turns it off) and
  ``release_xfer_handle``. vLLM polls once per engine step; here the caller
  polls until the request is done, with a deadline (``--timeout``): a
  stuck transfer ends the run with an error.
- the prefill side (``_get_new_notifs``): ``get_new_notifs``; each prefill
  rank must see exactly one "<request id>:2" per request.
- the agents' UCX backend with ``num_threads=4`` (``--num-threads``):
  vLLM's ``nixl_agent_config(num_threads=4, ...)`` when UCX is its only
  backend (``kv_connector_extra_config`` "num_threads", default 4). NIXL's
  UCX backend then runs a pool of worker threads that post and progress a
  request's descriptors: ``transfer`` returns at once and the work is done
  off the caller's thread (it shows in the process's CPU, not the
  caller's). ``--num-threads 0`` is NIXL's plain UCX engine
  (nixl_bench.py's), where ``transfer`` posts every descriptor on the
  caller's thread (over ``shm``, UCX's cma copies the bytes right there).
  Other backends get no num_threads, as in vLLM.

Not mirrored: vLLM's handshake (ZMQ, msgspec) is replaced by the control
socket; it adds no per-request cost. The unused local list of whole decode
blocks (``src_xfer_handles_by_block_size``) is not prepared. vLLM keeps
NIXL's progress thread on; see ``--no-prog-thread`` below.

Measured per request (``--warmup`` unmeasured, then ``--requests``): the
caller thread's CPU time (time.thread_time) for posting (index arrays +
make_prepped_xfer + transfer, for both ranks), its split into the three,
and in the wait loop; the whole process's CPU time (every thread, NIXL's
and UCX's included); the wall time from the first index array to the last
handle released, and 256 MiB / wall in GB/s (10^9 B/s). Medians and
p90 (the value at round((n - 1) x 0.9) of the sorted requests).

Check: the prefill regions hold a pattern of (rank, region, block, byte);
the decode regions one of their own. After the first request the decode
process compares every byte of its 64 regions with what they must hold
(the prefill blocks of the request's table at their slices, its own
pattern elsewhere), and after the last request the blocks of its table;
a mismatch fails the run (exit 1). At the end each prefill rank must have
received one notification per request.

Transports and the progress thread: as nixl_bench.py (``--transport tcp``:
UCX_TLS=tcp; ``shm``: UCX_TLS=posix,cma,self with
UCX_POSIX_ERROR_HANDLING=y; UCX_NET_DEVICES=lo; values already in the
environment win). ``--no-prog-thread``: no NIXL progress thread (on by
default, as in vLLM; it polls without sleeping, a core per agent, three
agents here); the decode caller's check_xfer_state progresses its side and
the prefill process calls get_new_notifs on its agents in a loop, which
UCX over TCP needs to move bytes on the target. On a 2-core host, use it:
three spinning progress threads beside the two callers oversubscribe the
CPU and the caller's figures then measure the scheduler. The prefill
process polls without pause unless ``--prefill-poll-us`` says how long to
sleep between polls (vLLM's prefill worker polls once per engine step).

Output: a table on stdout; with ``--json``, one JSON row on stdout (fields
of harness.py's rows where they apply) and the table on stderr. The
libraries' own output goes to stderr.

    ~/.cache/ferry-peers/nixl/bin/python bench/peers/nixl_kv_handoff.py \\
        --transport tcp|shm [--backend UCX|FERRY] [--requests 20] [--json] [--no-prog-thread]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

import harness
import nixl_bench

# ------------------------------------------------------------------ the workload

LAYERS = 32
KV_HEADS = 8
HEAD_DIM = 128
ELEM = 2
BLOCK_TOKENS = 16
POOL_BLOCKS = 320
TOKENS = 4096
PREFILL_TP = 4
DECODE_TP = 2
DECODE_RANK = 0

REGIONS = LAYERS * 2  # K and V of each layer, in that order (layer-major)
REQ_BLOCKS = TOKENS // BLOCK_TOKENS  # 256
P_HEADS = KV_HEADS // PREFILL_TP  # 2
D_HEADS = KV_HEADS // DECODE_TP  # 4
P_BLOCK = P_HEADS * BLOCK_TOKENS * HEAD_DIM * ELEM  # 8 KiB
D_BLOCK = D_HEADS * BLOCK_TOKENS * HEAD_DIM * ELEM  # 16 KiB
# The prefill ranks decode rank 0 reads, in vLLM's order (tp_mapping:
# P TP > D TP, one source per distinct head group), and the slot of each
# in a decode block.
SOURCES = list(range(DECODE_RANK * (PREFILL_TP // DECODE_TP), (DECODE_RANK + 1) * (PREFILL_TP // DECODE_TP)))
DESCS = REGIONS * REQ_BLOCKS * len(SOURCES)  # 32,768
REQ_BYTES = DESCS * P_BLOCK  # 256 MiB

LOCAL = "NIXL_INIT_AGENT"
# Seconds a control message (or the prefill process's exit) may take: the
# set-up fills and registers 320 MiB a side.
CONTROL_TIMEOUT = 120.0

# ------------------------------------------------------------------ the patterns

MUL = np.uint64(0xD1B54A32D192ED03)
KEY = np.uint64(0x8CB92BA72F3D8DD7)
# Decode's own pattern uses ranks from here on, so that it never equals a
# prefill rank's.
DECODE_SEED = 1000


def pattern(rank: int, region: int, nbytes: int, words: Optional[np.ndarray] = None) -> np.ndarray:
    """The NBYTES a (rank, region) holds, as 64-bit words: word w is
    (w + 1 + ((rank * 64 + region) << 40)) * MUL xor KEY. A word's value
    depends on the rank, the region and its offset (so on the block and the
    byte in it): a block at the wrong place or rank shows."""
    n = nbytes // 8
    w = np.arange(1, n + 1, dtype=np.uint64) if words is None else words[:n].copy()
    w += np.uint64((rank * REGIONS + region) << 40)
    w *= MUL
    w ^= KEY
    return w


class Regions:
    """COUNT regions of NBYTES each, one anonymous mapping per region (as
    separate tensors are separate allocations), every page touched."""

    def __init__(self, count: int, nbytes: int):
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self.maps = [mmap.mmap(-1, nbytes, flags=flags) for _ in range(count)]
        self.views = [np.frombuffer(m, dtype=np.uint64) for m in self.maps]
        self.addrs = [v.ctypes.data for v in self.views]
        self.nbytes = nbytes

    def fill(self, rank: int) -> None:
        words = np.arange(1, self.nbytes // 8 + 1, dtype=np.uint64)
        for g, view in enumerate(self.views):
            view[:] = pattern(rank, g, self.nbytes, words)

    def reg_list(self) -> List[Tuple[int, int, int, str]]:
        """register_memory's (addr, len, device, name) of every region."""
        return [(a, self.nbytes, 0, "") for a in self.addrs]


# ------------------------------------------------------------------ descriptors, as vLLM builds them


def remote_descs(bases: List[int]) -> List[Tuple[int, int, int]]:
    """One prefill rank's prepared list: per region, each of its blocks
    whole (build_remote_descs_from_plan: base + blk * page_stride +
    offset_in_page, offset 0 when P TP > D TP)."""
    return [(base + b * P_BLOCK, P_BLOCK, 0) for base in bases for b in range(POOL_BLOCKS)]


def local_descs(bases: List[int], slot: int) -> List[Tuple[int, int, int]]:
    """Decode rank 0's prepared list for the source in SLOT: per region,
    each decode block's slice that source fills (build_local_descs, then
    build_local_splits_from_plan: addr + slot * (block_len / reads))."""
    chunk = D_BLOCK // len(SOURCES)
    return [(base + b * D_BLOCK + slot * chunk, chunk, 0) for base in bases for b in range(POOL_BLOCKS)]


def desc_ids(block_ids: List[int], num_blocks: int) -> np.ndarray:
    """The descriptor indices of BLOCK_IDS in every region, region-major:
    region * num_blocks + block (compute_desc_ids_from_plan, for one
    attention group)."""
    group_arr = np.asarray(block_ids)
    region_ids = np.arange(REGIONS)[:, None]
    return (region_ids * num_blocks + group_arr[None, :]).flatten()


# ------------------------------------------------------------------ NIXL


def make_agent(args: argparse.Namespace, name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    config = nixl_agent_config(enable_prog_thread=args.prog_thread, backends=[],
                               capture_telemetry=args.telemetry)
    agent = nixl_agent(name, config)
    params: Dict[str, str] = {}
    if args.backend == "UCX" and args.num_threads > 0:
        # What nixl_agent_config(num_threads=N) passes to the UCX backend.
        params["num_threads"] = str(args.num_threads)
    if args.backend == "FERRY":
        params["transports"] = "tcp" if args.transport == "tcp" else "memory"
    agent.create_backend(args.backend, params)
    return agent


# ------------------------------------------------------------------ the prefill process


def run_prefill(args: argparse.Namespace) -> int:
    # PR_SET_PDEATHSIG (1): SIGKILL when the decode process goes.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    if os.getppid() == 1:
        return 1
    sock = socket.socket(fileno=args.control_fd)
    sock.settimeout(CONTROL_TIMEOUT)
    control = harness.Control(sock)
    ranks = []
    for r in SOURCES:
        regions = Regions(REGIONS, POOL_BLOCKS * P_BLOCK)
        regions.fill(r)
        agent = make_agent(args, f"prefill-r{r}-{os.getpid()}")
        reg = agent.register_memory(regions.reg_list(), "DRAM")
        ranks.append(dict(rank=r, regions=regions, agent=agent, reg=reg, notifs=[]))
    control.send(hello=[dict(rank=p["rank"], metadata=p["agent"].get_agent_metadata().hex(), bases=p["regions"].addrs)
                        for p in ranks])

    def poll() -> None:
        for p in ranks:
            for msgs in p["agent"].get_new_notifs().values():
                p["notifs"].extend(m.decode() for m in msgs)

    # Until the decode process says quit (or dies: PR_SET_PDEATHSIG), or
    # --max-seconds pass.
    deadline = time.monotonic() + args.max_seconds
    while True:
        if args.prog_thread:
            # The progress thread moves the bytes; notifications as vLLM
            # takes them, now and then.
            while not select.select([sock], [], [], 0.01)[0]:
                poll()
                if time.monotonic() > deadline:
                    raise RuntimeError("prefill: no word from the decode process before --max-seconds")
        else:
            n = 0
            pause = args.prefill_poll_us / 1e6
            while not control.waiting():
                poll()
                if pause:
                    time.sleep(pause)
                n += 1
                if n % 1024 == 0 and time.monotonic() > deadline:
                    raise RuntimeError("prefill: no word from the decode process before --max-seconds")
        message = control.recv()
        if message["cmd"] == "notifs":
            # Every rank's notifications, once each has as many as asked
            # for (a notification may trail its transfer's completion).
            until = time.monotonic() + max(args.timeout, 10.0)
            while any(len(p["notifs"]) < message["count"] for p in ranks) and time.monotonic() < until:
                poll()
            control.send(notifs={str(p["rank"]): p["notifs"] for p in ranks})
        elif message["cmd"] == "quit":
            for p in ranks:
                p["agent"].deregister_memory(p["reg"])
            control.send(ok=True)
            return 0


# ------------------------------------------------------------------ the decode process


class Decode:
    def __init__(self, args: argparse.Namespace, control: harness.Control):
        self.args, self.control = args, control
        self.regions = Regions(REGIONS, POOL_BLOCKS * D_BLOCK)
        self.regions.fill(DECODE_SEED + DECODE_RANK)
        self.agent = make_agent(args, f"decode-r{DECODE_RANK}-{os.getpid()}")
        self.reg = self.agent.register_memory(self.regions.reg_list(), "DRAM")
        self.remote: Dict[int, str] = {}
        self.remote_bases: Dict[int, List[int]] = {}
        self.local_handles = []
        self.remote_handles = []

    def connect(self, hello: List[Dict[str, Any]]) -> None:
        """add_remote_agent of each prefill rank, and the prepared lists
        (vLLM's add_remote_agent)."""
        a = self.agent
        for slot, peer in enumerate(hello):
            assert peer["rank"] == SOURCES[slot]
            name = a.add_remote_agent(bytes.fromhex(peer["metadata"]))
            name = name.decode() if isinstance(name, bytes) else name
            self.remote[peer["rank"]] = name
            self.remote_bases[peer["rank"]] = peer["bases"]
            a.make_connection(name)
            self.local_handles.append(a.prep_xfer_dlist(LOCAL, local_descs(self.regions.addrs, slot), "DRAM"))
            self.remote_handles.append(a.prep_xfer_dlist(name, remote_descs(peer["bases"]), "DRAM"))

    def request(self, req_id: str, local_ids: List[int], remote_ids: List[int]) -> Dict[str, Any]:
        """One request, timed: post to every source, then wait for all."""
        a = self.agent
        tt, pc = time.thread_time_ns, time.perf_counter_ns
        skip_merge = self.args.skip_desc_merge
        notif = f"{req_id}:{DECODE_TP}".encode()
        t_idx = t_make = t_post = 0
        handles = []
        p0 = time.process_time_ns()
        w0 = pc()
        c0 = tt()
        for slot, rank in enumerate(SOURCES):
            c = tt()
            remote_desc_ids = desc_ids(remote_ids, POOL_BLOCKS)
            local_desc_ids = desc_ids(local_ids, POOL_BLOCKS)
            c1 = tt()
            h = a.make_prepped_xfer("READ", self.local_handles[slot], local_desc_ids,
                                    self.remote_handles[slot], remote_desc_ids,
                                    notif_msg=notif, skip_desc_merge=skip_merge)
            c2 = tt()
            state = a.transfer(h)
            c3 = tt()
            if state == "ERR":
                a.release_xfer_handle(h)
                raise RuntimeError(f"NIXL READ from prefill rank {rank} failed to post")
            handles.append(h)
            t_idx += c1 - c
            t_make += c2 - c1
            t_post += c3 - c2
        c_posted = tt()
        # The wait: every handle until DONE, with a deadline.
        deadline = pc() + int(self.args.timeout * 1e9)
        merged = 0
        pending = list(handles)
        polls = 0
        while pending:
            still = []
            for h in pending:
                state = a.check_xfer_state(h)
                if state == "DONE":
                    if self.args.telemetry:
                        merged += a.get_xfer_telemetry(h).descCount
                    a.release_xfer_handle(h)
                elif state == "PROC":
                    still.append(h)
                else:
                    for x in pending:
                        a.release_xfer_handle(x)
                    raise RuntimeError(f"NIXL READ of request {req_id} ended {state}")
            pending = still
            polls += 1
            if pending and pc() > deadline:
                raise RuntimeError(f"NIXL READ of request {req_id} not done after {self.args.timeout} s "
                                   f"({len(pending)} of {len(handles)} transfers pending)")
        c_done = tt()
        w1 = pc()
        p1 = time.process_time_ns()
        return dict(
            post_cpu_ns=c_posted - c0, idx_cpu_ns=t_idx, make_cpu_ns=t_make, transfer_cpu_ns=t_post,
            wait_cpu_ns=c_done - c_posted, wall_ns=w1 - w0, polls=polls,
            process_cpu_ns=p1 - p0,
            descs_merged=merged if self.args.telemetry else None,
        )

    def expected_ok(self, local_ids: List[int], remote_ids: List[int], whole: bool) -> bool:
        """Whether the decode regions hold what they must after a request
        of these tables: every byte of every region (WHOLE), or only the
        request's blocks."""
        loc = np.asarray(local_ids)
        rem = np.asarray(remote_ids)
        words = np.arange(1, self.regions.nbytes // 8 + 1, dtype=np.uint64)
        pwords = P_BLOCK // 8
        for g, view in enumerate(self.regions.views):
            got = view.reshape(POOL_BLOCKS, len(SOURCES), pwords)
            if whole:
                want = pattern(DECODE_SEED + DECODE_RANK, g, self.regions.nbytes, words)
                want = want.reshape(POOL_BLOCKS, len(SOURCES), pwords)
            else:
                want = np.empty((len(loc), len(SOURCES), pwords), dtype=np.uint64)
            for slot, r in enumerate(SOURCES):
                theirs = pattern(r, g, POOL_BLOCKS * P_BLOCK, words).reshape(POOL_BLOCKS, pwords)
                if whole:
                    want[loc, slot] = theirs[rem]
                else:
                    want[:, slot] = theirs[rem]
            if not np.array_equal(got if whole else got[loc], want):
                bad = np.nonzero((got if whole else got[loc]) != want)
                where = f"block {bad[0][0]}" if whole else f"block {loc[bad[0][0]]} (table entry {bad[0][0]})"
                print(f"nixl_kv_handoff: decode region {g} (layer {g // 2} {'KV'[g % 2]}) holds wrong bytes: "
                      f"first at {where}, slice of prefill rank {SOURCES[bad[1][0]]}, word {bad[2][0]}",
                      file=sys.stderr)
                return False
        return True

    def close(self) -> None:
        a = self.agent
        for h in self.local_handles + self.remote_handles:
            a.release_dlist_handle(h)
        for name in self.remote.values():
            a.remove_remote_agent(name)
        a.deregister_memory(self.reg)


def tables(rng: np.random.Generator) -> Tuple[List[int], List[int]]:
    """A request's decode and prefill block tables: 256 distinct ids of the
    pool each, as the scheduler hands them over (Python lists)."""
    local = rng.permutation(POOL_BLOCKS)[:REQ_BLOCKS].tolist()
    remote = rng.permutation(POOL_BLOCKS)[:REQ_BLOCKS].tolist()
    return local, remote


def stats(values: List[float]) -> Tuple[float, float]:
    s = sorted(values)
    return harness.percentile(s, 0.5), harness.percentile(s, 0.9)


def run_decode(args: argparse.Namespace, out) -> int:
    ours, theirs = socket.socketpair()
    target = subprocess.Popen([sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:], "--role", "prefill",
                               "--control-fd", str(theirs.fileno())], pass_fds=[theirs.fileno()], stdout=sys.stderr)
    theirs.close()
    ours.settimeout(CONTROL_TIMEOUT)
    control = harness.Control(ours)
    try:
        fixed = nixl_bench.versions()
        decode = Decode(args, control)
        decode.connect(control.recv()["hello"])
        rng = np.random.default_rng(args.seed)
        verified = True
        rows: List[Dict[str, Any]] = []
        total = args.warmup + args.requests
        cpu = None
        last = None
        issued = 0
        for i in range(total):
            if i == args.warmup:
                cpu = (harness.cpu_seconds(), harness.cpu_seconds(target.pid), time.perf_counter())
            local, remote = tables(rng)
            row = decode.request(f"req-{i}", local, remote)
            issued += 1
            if i == 0:
                verified = decode.expected_ok(local, remote, whole=True)
                if not verified:
                    break
            if i >= args.warmup:
                rows.append(row)
            last = (local, remote)
        wall = time.perf_counter() - cpu[2] if cpu else 0.0
        cpu_initiator = (harness.cpu_seconds() - cpu[0]) / wall if cpu else None
        cpu_target = (harness.cpu_seconds(target.pid) - cpu[1]) / wall if cpu else None
        if verified and last is not None:
            verified = decode.expected_ok(*last, whole=False)
        notifs = control.call(cmd="notifs", count=issued)["notifs"]
        want = sorted(f"req-{i}:{DECODE_TP}" for i in range(issued))
        for r in SOURCES:
            got = sorted(notifs[str(r)])
            if got != want:
                print(f"nixl_kv_handoff: prefill rank {r} got notifications {got[:4]}... ({len(got)}), "
                      f"expected {len(want)}", file=sys.stderr)
                verified = False
        control.call(cmd="quit")
        target.wait(timeout=CONTROL_TIMEOUT)
        decode.close()
        if not rows:
            print("nixl_kv_handoff: the first request moved wrong bytes", file=sys.stderr)
            return 1
        report(args, fixed, rows, verified, cpu_initiator, cpu_target, out)
        return 0 if verified and target.returncode == 0 else 1
    finally:
        if target.poll() is None:
            target.kill()  # our own child, on a failure above
            target.wait()


def report(args, fixed, rows, verified, cpu_initiator, cpu_target, out) -> None:
    us = lambda key: [r[key] / 1000 for r in rows]  # noqa: E731
    post, wait, idx, make, xfer = us("post_cpu_ns"), us("wait_cpu_ns"), us("idx_cpu_ns"), us("make_cpu_ns"), us("transfer_cpu_ns")
    caller = [p + w for p, w in zip(post, wait)]
    proc = us("process_cpu_ns")
    lat = us("wall_ns")
    n = len(rows)
    seconds = sum(lat) / 1e6
    merged = [r["descs_merged"] for r in rows if r["descs_merged"] is not None]
    lat_sorted = sorted(lat)
    row: Dict[str, Any] = dict(
        system="nixl", backend=args.backend, **fixed, ucx_tls=os.environ.get("UCX_TLS"),
        prog_thread=args.prog_thread, num_threads=args.num_threads, telemetry=args.telemetry,
        skip_desc_merge=args.skip_desc_merge,
        transport=args.transport, workload="kv_handoff", op="read", block=P_BLOCK, batch=DESCS,
        submits=n, bytes=n * REQ_BYTES, seconds=round(seconds, 4),
        gbps=n * REQ_BYTES / seconds / 1e9, mops=n * DESCS / seconds / 1e6,
        lat_avg_us=sum(lat) / n, lat_p50_us=harness.percentile(lat_sorted, 0.5),
        lat_p99_us=harness.percentile(lat_sorted, 0.99), verified=verified,
        cpu_initiator=round(cpu_initiator, 2), cpu_target=round(cpu_target, 2), load1=os.getloadavg()[0],
        # The hand-off's own fields.
        warmup=args.warmup, seed=args.seed, layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, elem_size=ELEM,
        block_tokens=BLOCK_TOKENS, pool_blocks=POOL_BLOCKS, tokens=TOKENS, prefill_tp=PREFILL_TP,
        decode_tp=DECODE_TP, sources=SOURCES, regions=REGIONS, request_bytes=REQ_BYTES,
        descs_per_request=DESCS, xfers_per_request=len(SOURCES),
        descs_merged_p50=stats(merged)[0] if merged else None,
    )
    for key, vals in [("post_cpu_us", post), ("idx_cpu_us", idx), ("make_cpu_us", make), ("transfer_cpu_us", xfer),
                      ("wait_cpu_us", wait), ("caller_cpu_us", caller), ("process_cpu_us", proc), ("wall_us", lat)]:
        p50, p90 = stats(vals)
        row[f"{key}_p50"], row[f"{key}_p90"] = round(p50, 1), round(p90, 1)
    row["gbps_p50"] = REQ_BYTES / (row["wall_us_p50"] * 1e3)
    row["gbps_p90"] = REQ_BYTES / (row["wall_us_p90"] * 1e3)  # the slow tail: p90 of wall

    table = sys.stderr if args.json else out
    print(f"NIXL {fixed.get('version')} {args.backend} over {args.transport} (UCX_TLS={os.environ.get('UCX_TLS')}), "
          f"prog_thread={args.prog_thread}, num_threads={args.num_threads}, telemetry={args.telemetry}, "
          f"desc merge={'off' if args.skip_desc_merge else 'on'}", file=table)
    print(f"KV hand-off: prefill TP {PREFILL_TP} -> decode TP {DECODE_TP}, decode rank {DECODE_RANK} reads ranks "
          f"{SOURCES}; {LAYERS} layers x K,V x {REQ_BLOCKS} blocks x {len(SOURCES)} ranks = {DESCS} READs of "
          f"{P_BLOCK // 1024} KiB ({REQ_BYTES >> 20} MiB) per request, {len(SOURCES)} xfers; "
          f"{n} requests after {args.warmup} warm-up; verified={verified}", file=table)
    if merged:
        print(f"descriptors after NIXL's merge (telemetry): {row['descs_merged_p50']:.0f} per request", file=table)
    print(f"{'per request':<42}{'p50':>12}{'p90':>12}", file=table)
    for label, key, unit in [
        ("caller CPU, posting (idx+make+transfer)", "post_cpu_us", "us"),
        ("  index arrays (numpy)", "idx_cpu_us", "us"),
        ("  make_prepped_xfer", "make_cpu_us", "us"),
        ("  transfer", "transfer_cpu_us", "us"),
        ("caller CPU, wait loop", "wait_cpu_us", "us"),
        ("caller CPU, total", "caller_cpu_us", "us"),
        ("process CPU, all threads", "process_cpu_us", "us"),
        ("wall", "wall_us", "us"),
    ]:
        print(f"{label:<42}{row[key + '_p50']:>10.0f}{unit}{row[key + '_p90']:>10.0f}{unit}", file=table)
    print(f"{'GB/s (256 MiB / wall)':<42}{row['gbps_p50']:>12.2f}{row['gbps_p90']:>12.2f}", file=table)
    print(f"cpu_initiator {row['cpu_initiator']}, cpu_target {row['cpu_target']} (cores), load1 {row['load1']:.2f}",
          file=table)
    if args.json:
        out.write(json.dumps(row) + "\n")
    out.flush()


# ------------------------------------------------------------------ main


def arguments() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", choices=["tcp", "shm"], default="tcp")
    p.add_argument("--backend", default="UCX",
                   help="the NIXL backend plugin: UCX (NIXL's own) or FERRY (ferry's, installed with "
                        "`ferry nixl install`) [%(default)s]")
    p.add_argument("--requests", type=int, default=20, help="measured requests [%(default)s]")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured requests first (>= 1) [%(default)s]")
    p.add_argument("--seed", type=int, default=1, help="of the block tables [%(default)s]")
    p.add_argument("--json", action="store_true", help="one JSON row on stdout, the table on stderr")
    p.add_argument("--no-prog-thread", dest="prog_thread", action="store_false",
                   help="no NIXL progress thread: the callers' polls progress (see above)")
    p.add_argument("--num-threads", type=int, default=4,
                   help="the UCX backend's num_threads, as vLLM passes it (0: NIXL's plain UCX engine, "
                        "no thread pool) [%(default)s]")
    p.add_argument("--no-telemetry", dest="telemetry", action="store_false",
                   help="agents without capture_telemetry (vLLM turns it on)")
    p.add_argument("--skip-desc-merge", action="store_true",
                   help="make_prepped_xfer(skip_desc_merge=True) (vLLM leaves merging on)")
    p.add_argument("--prefill-poll-us", type=float, default=0.0,
                   help="with --no-prog-thread: the prefill process sleeps this long between polls "
                        "(0: it polls without pause) [%(default)s]")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds a request may take before the run fails [%(default)s]")
    p.add_argument("--max-seconds", type=float, default=600.0,
                   help="the prefill process gives up after this long without a control message [%(default)s]")
    p.add_argument("--role", choices=["decode", "prefill"], default="decode", help=argparse.SUPPRESS)
    p.add_argument("--control-fd", type=int, help=argparse.SUPPRESS)
    return p


def main() -> None:
    args = arguments().parse_args()
    if args.warmup < 1 or args.requests < 1:
        raise SystemExit("--warmup and --requests must be at least 1 (the first request is checked)")
    nixl_bench.set_environment(args)
    # Our output goes through a descriptor of our own; fd 1 becomes stderr,
    # so that what the libraries print never mixes in.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    code = 1
    try:
        code = run_prefill(args) if args.role == "prefill" else run_decode(args, out)
    except Exception:  # noqa: BLE001 - said on stderr, and the exit code
        import traceback

        traceback.print_exc()
    out.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.CDLL(None).fflush(None)
    # NIXL's bundled UCX crashes in a destructor at a normal exit: what we
    # hold was released above, and the interpreter's teardown is skipped.
    os._exit(code)


if __name__ == "__main__":
    main()
