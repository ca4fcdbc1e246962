"""A ferry peer process for the tests.

Starts a node, allocates (or registers numpy arrays as) regions of the given
sizes, prints one JSON line on stdout::

    {"addr": "ip:port/id", "pid": ..., "transports": [...],
     "handles": ["<hex of RemoteRegion.to_bytes()>", ...], "sizes": [...]}

and then serves RPCs, every body and answer JSON unless noted:

``sha256``        {"region", "offset"=0, "length"=rest} -> {"sha256"}
``verify``        {"region", "offset", "length", "seed"} -> {"equal", "first"}:
                  the owner's bytes against ``pattern(seed, length)``
``fill``          {"region", "offset", "length", "seed" (null: zeros)} -> {"sha256"}
``close-region``  {"region"} -> {"closed"}
``new-region``    {"size"} -> {"region", "handle"}
``handle``        {"region"} -> {"handle"}
``notifications`` {"count", "timeout"} -> {"got": [[kind, body hex, sender]...]}:
                  waits until ``count`` deliveries came or ``timeout`` passed
``notified-writes`` {"handle", "count", "length", "prefix"} -> {"done"}: writes
                  the first ``length`` bytes of region 0 into ``handle``
                  ``count`` times, notification ``prefix + str(i)``
``echo``          raw body -> raw body
``fail``          raises ValueError with the body's text
``async-echo``    an ``async def`` handler: {"body", "thread", "on_main_loop"}
``exit``          stops the node; the process exits 0

It stops on ``exit``, when stdin closes (the test died) or after
``--lifetime`` seconds, so a lost peer never outlives its test run for long.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from typing import Any, Dict, List, Optional

import numpy as np

import ferry
from patterns import pattern, sha256


class Peer:
    def __init__(self, node: ferry.Node, mode: str) -> None:
        self.node = node
        self.mode = mode
        self.regions: List[ferry.Region] = []
        self.views: List["np.ndarray[Any, np.dtype[np.uint8]]"] = []
        self.stop = threading.Event()
        self.main_loop: Optional[asyncio.AbstractEventLoop] = None
        self.main_thread = threading.current_thread().name

    def add_region(self, size: int) -> int:
        if self.mode == "register":
            array = np.zeros(size, dtype=np.uint8)
            region = self.node.register(array)
            view = array
        else:
            region = self.node.alloc(size)
            view = np.frombuffer(region, dtype=np.uint8)
        self.regions.append(region)
        self.views.append(view)
        return len(self.regions) - 1

    def window(self, request: Dict[str, Any]) -> "np.ndarray[Any, np.dtype[np.uint8]]":
        view = self.views[int(request.get("region", 0))]
        offset = int(request.get("offset", 0))
        length = request.get("length")
        end = view.size if length is None else offset + int(length)
        return view[offset:end]

    # -- handlers -------------------------------------------------------------

    def h_sha256(self, body: bytes) -> bytes:
        return _json({"sha256": sha256(self.window(json.loads(body)))})

    def h_verify(self, body: bytes) -> bytes:
        request = json.loads(body)
        window = self.window(request)
        expected = pattern(int(request["seed"]), window.size)
        equal = bool(np.array_equal(window, expected))
        first = -1
        if not equal:
            first = int(np.flatnonzero(window != expected)[0])
        return _json({"equal": equal, "first": first})

    def h_fill(self, body: bytes) -> bytes:
        request = json.loads(body)
        window = self.window(request)
        seed = request.get("seed")
        if seed is None:
            window[:] = 0
        else:
            window[:] = pattern(int(seed), window.size)
        return _json({"sha256": sha256(window)})

    def h_close_region(self, body: bytes) -> bytes:
        region = self.regions[int(json.loads(body)["region"])]
        return _json({"closed": region.close(timeout=5.0)})

    def h_new_region(self, body: bytes) -> bytes:
        index = self.add_region(int(json.loads(body)["size"]))
        return _json({"region": index, "handle": self.regions[index].remote().to_bytes().hex()})

    def h_handle(self, body: bytes) -> bytes:
        region = self.regions[int(json.loads(body)["region"])]
        return _json({"handle": region.remote().to_bytes().hex()})

    def h_notifications(self, body: bytes) -> bytes:
        request = json.loads(body)
        count = int(request["count"])
        deadline = time.monotonic() + float(request["timeout"])
        got: List[List[str]] = []
        while len(got) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            delivery = self.node.next_notification(timeout=left)
            if delivery is not None:
                got.append([delivery.kind, delivery.body.hex(), str(delivery.sender)])
        for delivery in self.node.notifications():  # anything beyond count
            got.append([delivery.kind, delivery.body.hex(), str(delivery.sender)])
        return _json({"got": got})

    def h_notified_writes(self, body: bytes) -> bytes:
        request = json.loads(body)
        target = ferry.RemoteRegion.from_bytes(bytes.fromhex(request["handle"]))
        prefix = str(request["prefix"])
        for i in range(int(request["count"])):
            self.node.write(
                self.regions[0],
                target,
                length=int(request["length"]),
                notification=f"{prefix}{i}".encode(),
            )
        return _json({"done": True})

    def h_echo(self, body: bytes) -> bytes:
        return body

    def h_fail(self, body: bytes) -> bytes:
        raise ValueError(f"handler failed on purpose: {body.decode()}")

    async def h_async_echo(self, body: bytes) -> bytes:
        await asyncio.sleep(0.01)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:  # pragma: no cover - an async handler runs in a loop
            running = None
        return _json(
            {
                "body": body.decode(),
                "thread": threading.current_thread().name,
                "on_main_loop": running is not None and running is self.main_loop,
            }
        )

    def h_exit(self, body: bytes) -> bytes:
        self.stop.set()
        return b"bye"

    def serve(self) -> None:
        handlers = {
            "sha256": self.h_sha256,
            "verify": self.h_verify,
            "fill": self.h_fill,
            "close-region": self.h_close_region,
            "new-region": self.h_new_region,
            "handle": self.h_handle,
            "notifications": self.h_notifications,
            "notified-writes": self.h_notified_writes,
            "echo": self.h_echo,
            "fail": self.h_fail,
            "async-echo": self.h_async_echo,
            "exit": self.h_exit,
        }
        for name, handler in handlers.items():
            self.node.serve_rpc(name, handler)  # type: ignore[arg-type]


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="4096", help="comma-separated region sizes")
    parser.add_argument("--mode", choices=["alloc", "register"], default="alloc")
    parser.add_argument("--loop", action="store_true", help="serve from a running asyncio loop")
    parser.add_argument("--lifetime", type=float, default=300.0)
    args = parser.parse_args()

    node = ferry.Node()
    peer = Peer(node, args.mode)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    for size in sizes:
        peer.add_region(size)

    def watch_stdin() -> None:
        try:
            sys.stdin.read()
        finally:
            peer.stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()

    def announce() -> None:
        line = {
            "addr": str(node.addr),
            "pid": os.getpid(),
            "transports": node.transports(),
            "handles": [r.remote().to_bytes().hex() for r in peer.regions],
            "sizes": sizes,
        }
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()

    if args.loop:

        async def run() -> None:
            peer.main_loop = asyncio.get_running_loop()
            peer.serve()  # inside the loop: async handlers run on it
            announce()
            deadline = time.monotonic() + args.lifetime
            while not peer.stop.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)

        asyncio.run(run())
    else:
        peer.serve()
        announce()
        peer.stop.wait(timeout=args.lifetime)
    time.sleep(0.1)  # lets the answer to "exit" go out
    node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
