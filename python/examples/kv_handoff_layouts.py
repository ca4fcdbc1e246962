"""KV-cache hand-off with layouts: prefill ranks of tensor-parallel degree 4
hand each request's KV cache to decode ranks of degree 2, which page it in
blocks of another size and another axis order, one process per rank.

Every rank declares once how its KV cache lies in memory, from the numpy
array it already has (``ferry.TensorLayout.from_array``): a pool of
``(layers, blocks, block_tokens, heads, head_dim)`` (NHD) on the prefill
side, ``(layers, blocks, heads, block_tokens, head_dim)`` (HND) on the
decode side, K and V apart, each rank holding its share of the 8 KV heads.
The prefill ranks send their layouts (with their regions' handles); each
decode rank plans once (``Node.plan_transfer``): it learns that its heads
lie on two prefill ranks, and how the blocks and axes map. Per request the
decode rank names only the token count and both sides' block tables
(``TransferPlan.request``); one transfer request reads from both prefill
ranks, and each gets a notification once its bytes were read, after which
the scheduler frees the request's prefill blocks.

The scheduler (this script without ``--role``) starts the six processes and
hands out blocks from each side's free list, as an inference server's
scheduler does; ranks of one side share block ids. Each decode rank checks
every byte it read against what the prefill "computed" (a function of the
request, layer, token, head and element), then frees its blocks.

    python kv_handoff_layouts.py          # same-host shared memory, else TCP
    python kv_handoff_layouts.py --tcp    # TCP only
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import IO, Any, Dict, List, Optional

import numpy as np
import numpy.typing as npt

import ferry

LAYERS = 4
HEADS = 8  # KV heads
HEAD_DIM = 64
MAX_TOKENS = 4096  # the token axis: the longest sequence a request may name
PREFILL_TP, PREFILL_BLOCK, PREFILL_BLOCKS = 4, 16, 160
DECODE_TP, DECODE_BLOCK, DECODE_BLOCKS = 2, 32, 96
REQUESTS = (200, 1000, 47, 513, 1500, 333, 64, 2048, 9, 700)  # tokens each
TIMEOUT = 30.0

Pool = npt.NDArray[np.uint16]
Blocks = npt.NDArray[np.int64]


def heads_of(rank: int, tp: int) -> range:
    share = HEADS // tp
    return range(rank * share, (rank + 1) * share)


def kv_values(request: int, tokens: int, heads: range) -> Pool:
    """What the prefill computes for ``request``: K and V, ``[2, layers,
    tokens, heads, dim]`` for ``heads``, each element its own value."""
    kv, layer, token, head, dim = np.ix_(
        np.arange(2), np.arange(LAYERS), np.arange(tokens),
        np.arange(heads.start, heads.stop), np.arange(HEAD_DIM),
    )
    index = (((kv * LAYERS + layer) * MAX_TOKENS + token) * HEADS + head) * HEAD_DIM + dim
    mixed = index.astype(np.uint64) * np.uint64(2654435761) + np.uint64(request * 40503 + 1)
    return ((mixed ^ (mixed >> np.uint64(17))) & np.uint64(0xFFFF)).astype(np.uint16)


def tokens_view(pool: Pool, order: str) -> Pool:
    """A K or V pool viewed as ``(layers, blocks, block_tokens, heads,
    dim)`` whatever its order in memory."""
    return pool if order == "NHD" else pool.swapaxes(2, 3)


def through(blocks: Blocks, block: int, tokens: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Each token's physical block and position within it."""
    t = np.arange(tokens)
    return blocks[t // block], t % block


class Rank:
    """One rank: its node, its K and V pools, its layout."""

    def __init__(self, node: ferry.Node, rank: int, tp: int, block: int, blocks: int, order: str) -> None:
        self.node, self.rank, self.block, self.order = node, rank, block, order
        self.heads = heads_of(rank, tp)
        inner = (block, len(self.heads)) if order == "NHD" else (len(self.heads), block)
        # K and V: one array, one registration.
        self.kv: Pool = np.zeros((2, LAYERS, blocks, *inner, HEAD_DIM), dtype=np.uint16)
        self.region = node.register(self.kv)
        names = ("token", "head") if order == "NHD" else ("head", "token")
        self.layout = ferry.RankLayout(rank, [
            ferry.TensorLayout.from_array(
                name, self.kv[i], self.region,
                axes=("layer", "block", *names, "dim"),
                paged=("token", "block"),      # "block" indexes physical blocks of "token"
                table="kv",
                global_sizes={"token": MAX_TOKENS},
                parts={"head": (rank, tp)},    # this rank's share of the heads
            )
            for i, name in enumerate(("k", "v"))
        ])

    def scatter(self, values: Pool, blocks: Blocks) -> None:
        which, where = through(blocks, self.block, values.shape[2])
        for i in range(2):
            tokens_view(self.kv[i], self.order)[:, which, where] = values[i]

    def gather(self, blocks: Blocks, tokens: int) -> Pool:
        which, where = through(blocks, self.block, tokens)
        return np.stack([tokens_view(self.kv[i], self.order)[:, which, where] for i in range(2)])


# -- the ranks ------------------------------------------------------------------------


def say(answer: Dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


def prefill_rank(node: ferry.Node, rank: int) -> int:
    me = Rank(node, rank, PREFILL_TP, PREFILL_BLOCK, PREFILL_BLOCKS, "NHD")
    say({"layout": me.layout.to_bytes().hex()})
    for line in sys.stdin:
        order = json.loads(line)
        if order["op"] == "compute":
            blocks = np.array(order["blocks"], dtype=np.int64)
            me.scatter(kv_values(order["request"], order["tokens"], me.heads), blocks)
            say({})
        elif order["op"] == "release":
            # The request's readers notify once their bytes are read: then
            # its blocks may be given to another request.
            want = f"req-{order['request']}".encode()
            for _ in range(order["readers"]):
                note = node.next_notification(timeout=TIMEOUT)
                if note is None or note.body != want:
                    raise RuntimeError(f"prefill rank {rank}: expected {want!r}, got {note}")
            say({})
    return 0


def decode_rank(node: ferry.Node, rank: int) -> int:
    me = Rank(node, rank, DECODE_TP, DECODE_BLOCK, DECODE_BLOCKS, "HND")
    say({"ready": True})
    plan: Optional[ferry.TransferPlan] = None
    for line in sys.stdin:
        order = json.loads(line)
        if order["op"] == "plan":
            peers = [ferry.RankLayout.from_bytes(bytes.fromhex(h)) for h in order["peers"]]
            started = time.perf_counter()
            plan = node.plan_transfer(me.layout, peers, direction="pull", timeout=TIMEOUT)
            seconds = time.perf_counter() - started
            say({"ranks": plan.remote_ranks, "segments": plan.segments, "seconds": seconds})
        elif order["op"] == "pull":
            assert plan is not None, "a request before the plan"
            request, tokens = int(order["request"]), int(order["tokens"])
            mine = np.array(order["mine"], dtype=np.int64)
            theirs = np.array(order["theirs"], dtype=np.int64)
            xfer = plan.request(tokens, mine, theirs, notification=f"req-{request}".encode())
            xfer.post(timeout=TIMEOUT)
            xfer.wait()
            got = me.gather(mine, tokens)
            if not np.array_equal(got, kv_values(request, tokens, me.heads)):
                raise RuntimeError(f"decode rank {rank}, request {request}: wrong bytes")
            me.scatter(np.zeros_like(got), mine)  # "decoded": the blocks are free again
            say({"bytes": xfer.nbytes, "descriptors": len(xfer), "transport": xfer.estimate().transport})
    return 0


# -- the scheduler -------------------------------------------------------------------


class Child:
    """A rank's process, spoken to one JSON line each way."""

    def __init__(self, role: str, rank: int, tcp: bool) -> None:
        command = [sys.executable, __file__, "--role", role, "--rank", str(rank)]
        if tcp:
            command.append("--tcp")
        self.name = f"{role} rank {rank}"
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.first = self.read()

    def read(self) -> Dict[str, Any]:
        out: Optional[IO[str]] = self.proc.stdout
        assert out is not None
        line = out.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited ({self.proc.wait()})")
        answer: Dict[str, Any] = json.loads(line)
        return answer

    def send(self, **order: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(order) + "\n")
        self.proc.stdin.flush()

    def close(self) -> int:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            return self.proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class FreeList:
    def __init__(self, count: int) -> None:
        self.free: List[int] = list(range(count))[::-1]  # handed out from the top: not in order

    def take(self, n: int) -> List[int]:
        if n > len(self.free):
            raise RuntimeError("out of blocks")
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def give_back(self, blocks: List[int]) -> None:
        self.free.extend(blocks)


def scheduler(tcp: bool) -> int:
    started = time.monotonic()
    children: List[Child] = []
    try:
        prefill = [Child("prefill", r, tcp) for r in range(PREFILL_TP)]
        children += prefill
        decode = [Child("decode", r, tcp) for r in range(DECODE_TP)]
        children += decode
        layouts = [p.first["layout"] for p in prefill]
        readers = {r: 0 for r in range(PREFILL_TP)}
        plans = []
        for d in decode:
            d.send(op="plan", peers=layouts)
            plans.append(d.read())
            for r in plans[-1]["ranks"]:
                readers[r] += 1
        prefill_free, decode_free = FreeList(PREFILL_BLOCKS), FreeList(DECODE_BLOCKS)
        moved = descriptors = 0
        transport = ""
        for request, tokens in enumerate(REQUESTS):
            theirs = prefill_free.take(-(-tokens // PREFILL_BLOCK))
            mine = decode_free.take(-(-tokens // DECODE_BLOCK))
            for p in prefill:
                p.send(op="compute", request=request, tokens=tokens, blocks=theirs)
            for p in prefill:
                p.read()
            for d in decode:
                d.send(op="pull", request=request, tokens=tokens, mine=mine, theirs=theirs)
            for d in decode:
                done = d.read()
                moved += done["bytes"]
                descriptors += done["descriptors"]
                transport = done["transport"]
            for r, p in enumerate(prefill):
                p.send(op="release", request=request, readers=readers[r])
            for p in prefill:
                p.read()
            prefill_free.give_back(theirs)
            decode_free.give_back(mine)
        for child in children:
            if child.close() != 0:
                raise RuntimeError(f"{child.name} failed")
        children = []
        print(
            f"kv_handoff_layouts: prefill TP {PREFILL_TP} (blocks of {PREFILL_BLOCK} tokens, NHD) -> "
            f"decode TP {DECODE_TP} (blocks of {DECODE_BLOCK} tokens, HND), a process per rank: "
            f"{len(REQUESTS)} requests, {sum(REQUESTS)} tokens, {moved / (1 << 20):.1f} MiB read over "
            f"{transport} and checked byte for byte. Each decode rank planned and connected once "
            f"({plans[0]['segments']} segments, {max(p['seconds'] for p in plans) * 1e3:.1f} ms; "
            f"reading from prefill ranks {' and '.join(str(p['ranks']) for p in plans)}); each request "
            f"named only its tokens and both sides' block tables, and moved "
            f"{descriptors // len(REQUESTS)} descriptors of {moved // max(descriptors, 1)} bytes on "
            f"average (one per token and head: NHD against HND); the prefill blocks were freed on "
            f"the readers' notifications; {time.monotonic() - started:.2f} s"
        )
        return 0
    finally:
        for child in children:
            child.proc.kill()
            child.proc.wait()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--role", choices=["prefill", "decode"])
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--tcp", action="store_true", help="TCP only, no same-host memory")
    args = parser.parse_args(argv)
    if args.role is None:
        return scheduler(args.tcp)
    with ferry.Node(memory=not args.tcp) as node:
        if args.role == "prefill":
            return prefill_rank(node, args.rank)
        return decode_rank(node, args.rank)


if __name__ == "__main__":
    sys.exit(main())
