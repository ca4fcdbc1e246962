"""KV-cache hand-off between a prefill and a decode process, as a
disaggregated inference server does it.

Each side registers its KV cache once: a numpy array of ``LAYERS × BLOCKS ×
BLOCK_BYTES`` bytes, one descriptor per (layer, block). The prefill side
publishes its cache by name and keeps a free list of its blocks. Per request
it "computes" the KV blocks of every layer into blocks it takes from its
free list and tells the decode side which blocks hold the request (a
message). The decode side takes blocks from its own free list, computes the
index arrays in numpy (every layer's blocks, in one request), and READs the
prefill's blocks into its own with one transfer request carrying the
notification ``b"req-<n>"``. When that notification arrives, the prefill
side knows its blocks were read and frees them. The prefill cache holds
fewer blocks than the requests need in all, so blocks are freed and reused
again and again; the decode side checks every byte it read.

Run the whole demo (the decode side is started as a subprocess)::

    python kv_handoff.py            # same-host shared memory, else TCP
    python kv_handoff.py --tcp      # TCP only

or the two sides by hand::

    python kv_handoff.py --role prefill          # prints its address
    python kv_handoff.py --role decode --prefill 127.0.0.1:PORT/ID
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Dict, List, Optional

import numpy as np
import numpy.typing as npt

import ferry

LAYERS = 4
PREFILL_BLOCKS = 48
DECODE_BLOCKS = 64
BLOCK_BYTES = 16 << 10
REQUESTS = 40
BLOCKS_PER_REQUEST = (3, 6, 9, 12)  # a request's length in blocks, cycled
TIMEOUT = 10.0

Blocks = npt.NDArray[np.int64]
KvCache = npt.NDArray[np.uint8]


def kv_bytes(request: int, blocks: int) -> KvCache:
    """What the prefill "computes" for ``request``: ``LAYERS × blocks ×
    BLOCK_BYTES`` bytes that depend on the request, layer, block and byte."""
    layer = np.arange(LAYERS, dtype=np.uint32).reshape(LAYERS, 1, 1)
    block = np.arange(blocks, dtype=np.uint32).reshape(1, blocks, 1)
    byte = np.arange(BLOCK_BYTES, dtype=np.uint32).reshape(1, 1, BLOCK_BYTES)
    mixed = byte * 31 + np.uint32(request * 7919) + layer * 104729 + block * 1299709
    return (mixed ^ (mixed >> 8)).astype(np.uint8)


def descriptors_of(blocks_per_layer: int) -> ferry.Strided:
    """One descriptor per (layer, block) of a cache: descriptor ``layer *
    blocks_per_layer + block``. The strided form: five numbers for all."""
    return ferry.Strided(0, 0, BLOCK_BYTES, BLOCK_BYTES, LAYERS * blocks_per_layer)


def indices(blocks: Blocks, blocks_per_layer: int) -> npt.NDArray[np.uint32]:
    """The descriptor indices of ``blocks`` in every layer, layer by layer."""
    layers = np.arange(LAYERS, dtype=np.int64).reshape(LAYERS, 1) * blocks_per_layer
    return (layers + blocks.reshape(1, -1)).reshape(-1).astype(np.uint32)


# -- the prefill side ------------------------------------------------------------


class FreeList:
    """Block numbers not in use."""

    def __init__(self, count: int) -> None:
        self.free: List[int] = list(range(count))

    def take(self, n: int) -> Blocks:
        taken, self.free = self.free[:n], self.free[n:]
        return np.array(taken, dtype=np.int64)

    def give_back(self, blocks: Blocks) -> None:
        self.free.extend(int(b) for b in blocks)

    def __len__(self) -> int:
        return len(self.free)


def prefill(node: ferry.Node, decode: Optional["subprocess.Popen[bytes]"]) -> int:
    kv: KvCache = np.zeros((LAYERS, PREFILL_BLOCKS, BLOCK_BYTES), dtype=np.uint8)
    region = node.register(kv)  # once; the region holds the array
    node.publish("kv-cache", region)
    free = FreeList(PREFILL_BLOCKS)
    in_use: Dict[bytes, Blocks] = {}
    started = time.monotonic()

    # The decode side says hello: that is its address.
    hello = node.next_notification(timeout=60.0)
    if hello is None or hello.body != b"hello":
        raise RuntimeError(f"no hello from the decode side: {hello}")
    peer = hello.sender

    def settle(delivery: ferry.Delivery) -> None:
        """A notification names a request whose blocks were read: free them."""
        if delivery.kind != "notification":
            raise RuntimeError(f"unexpected {delivery.kind}: {delivery.body!r}")
        blocks = in_use.pop(delivery.body)  # a KeyError here: notified twice
        free.give_back(blocks)

    waits = 0
    handed_out = 0
    for request in range(REQUESTS):
        need = BLOCKS_PER_REQUEST[request % len(BLOCKS_PER_REQUEST)]
        while len(free) < need:  # the cache is full: wait for the decode side
            delivery = node.next_notification(timeout=TIMEOUT)
            if delivery is None:
                raise RuntimeError("the decode side read nothing in time")
            settle(delivery)
            waits += 1
        for delivery in node.notifications():
            settle(delivery)
        blocks = free.take(need)
        handed_out += need
        kv[:, blocks] = kv_bytes(request, need)  # "compute" every layer
        in_use[f"req-{request}".encode()] = blocks
        order = {"request": request, "blocks": blocks.tolist()}
        node.send_message(peer, json.dumps(order).encode(), timeout=TIMEOUT)

    deadline = time.monotonic() + TIMEOUT
    while in_use and time.monotonic() < deadline:
        delivery = node.next_notification(timeout=max(0.0, deadline - time.monotonic()))
        if delivery is not None:
            settle(delivery)
    if in_use:
        raise RuntimeError(f"requests never read: {sorted(in_use)}")
    assert len(free) == PREFILL_BLOCKS
    assert handed_out > PREFILL_BLOCKS  # so blocks were freed and reused
    # Done: the decode side answers with what it read (a message).
    node.send_message(peer, b"done", timeout=TIMEOUT)
    report = node.next_notification(timeout=TIMEOUT)
    if report is None or report.kind != "message":
        raise RuntimeError(f"no summary from the decode side: {report}")
    summary = json.loads(report.body)
    if decode is not None:
        code = decode.wait(timeout=30.0)
        if code != 0:
            raise RuntimeError(f"the decode process exited with {code}")
    seconds = time.monotonic() - started
    moved = summary["bytes"]
    print(
        f"kv_handoff: {REQUESTS} requests, {summary['blocks']} KV blocks "
        f"({LAYERS} layers x {BLOCK_BYTES >> 10} KiB each, {moved / (1 << 20):.1f} MiB) read "
        f"by the decode side over {summary['transport']} and checked byte for byte; "
        f"the prefill's {PREFILL_BLOCKS} blocks were freed on each notification and handed "
        f"out {handed_out} times (the prefill waited for the decode side {waits} times); "
        f"{seconds:.2f} s"
    )
    # Teardown: withdraw the name (it holds the region), then deregister.
    node.unpublish("kv-cache")
    if not region.close(timeout=TIMEOUT):
        raise RuntimeError("the prefill cache was still in use")
    return 0


# -- the decode side --------------------------------------------------------------


class Totals:
    """What the decode side read, for the prefill's summary."""

    def __init__(self, transport: str) -> None:
        self.blocks = 0
        self.bytes = 0
        self.transport = transport


def decode(node: ferry.Node, prefill_addr: ferry.NodeAddr) -> int:
    kv: KvCache = np.zeros((LAYERS, DECODE_BLOCKS, BLOCK_BYTES), dtype=np.uint8)
    region = node.register(kv)
    local = ferry.LocalDescs([region], strided=descriptors_of(DECODE_BLOCKS))

    # The prefill's cache, by name, and its descriptor list, prepared once.
    peer_key = node.fetch_metadata(prefill_addr.endpoint, timeout=TIMEOUT)
    theirs = node.remote_region(peer_key, "kv-cache")
    remote = node.prepare_remote(
        ferry.RemoteDescs([theirs], strided=descriptors_of(PREFILL_BLOCKS)), timeout=TIMEOUT
    )
    totals = Totals(transport=remote.transports()[0])
    node.send_message(prefill_addr, b"hello", timeout=TIMEOUT)

    free = FreeList(DECODE_BLOCKS)
    while True:
        delivery = node.next_notification(timeout=60.0)
        if delivery is None:
            raise RuntimeError("the prefill side went quiet")
        if delivery.body == b"done":
            node.send_message(prefill_addr, json.dumps(vars(totals)).encode(), timeout=TIMEOUT)
            break
        order = json.loads(delivery.body)
        request = int(order["request"])
        theirs_blocks = np.array(order["blocks"], dtype=np.int64)
        mine = free.take(len(theirs_blocks))
        xfer = node.make_xfer(
            "READ",
            local,
            indices(mine, DECODE_BLOCKS),
            remote,
            indices(theirs_blocks, PREFILL_BLOCKS),
            notification=f"req-{request}".encode(),
        )
        xfer.post(timeout=TIMEOUT)
        xfer.wait()  # raises if it failed
        got = kv[:, mine]
        assert np.array_equal(got, kv_bytes(request, len(mine))), f"request {request}: wrong bytes"
        totals.blocks += LAYERS * len(mine)
        totals.bytes += xfer.nbytes
        kv[:, mine] = 0  # "decoded": the blocks go back to the free list
        free.give_back(mine)
        del xfer
    # Teardown: the descriptor list holds the region; then deregister.
    del local
    if not region.close(timeout=TIMEOUT):
        raise RuntimeError("the decode cache was still in use")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--role", choices=["both", "prefill", "decode"], default="both")
    parser.add_argument("--prefill", help="the prefill node's address (--role decode)")
    parser.add_argument("--tcp", action="store_true", help="TCP only, no same-host memory")
    args = parser.parse_args(argv)

    with ferry.Node(memory=not args.tcp) as node:
        if args.role == "decode":
            if not args.prefill:
                parser.error("--role decode needs --prefill ADDRESS")
            return decode(node, ferry.NodeAddr.parse(args.prefill))
        child: Optional["subprocess.Popen[bytes]"] = None
        if args.role == "both":
            command = [sys.executable, __file__, "--role", "decode", "--prefill", str(node.addr)]
            if args.tcp:
                command.append("--tcp")
            child = subprocess.Popen(command)
        else:
            print(f"prefill node at {node.addr}: start the decode side with "
                  f"--role decode --prefill {node.addr}", flush=True)
        try:
            return prefill(node, child)
        finally:
            if child is not None and child.poll() is None:
                child.kill()
                child.wait(timeout=10.0)


if __name__ == "__main__":
    sys.exit(main())
