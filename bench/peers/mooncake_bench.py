#!/usr/bin/env python3
"""`ferry bench`'s workloads through Mooncake's Transfer Engine (Python
module ``mooncake.engine``, PyPI ``mooncake-transfer-engine-non-cuda``),
two processes on one host, host memory, over loopback TCP. The harness
(processes, buffers, timing, checks, rows) is harness.py's; this file is
the Mooncake calls:

- each side: ``TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE",
  "tcp", "")``: no metadata service, the two engines ask each other for
  their segments; a side's session id is ``127.0.0.1:<get_rpc_port()>``;
  ``register_memory(addr, length)`` of its buffer;
- a bandwidth request: ``batch_transfer_sync_write`` (or ``_read``) of the
  slot's lists of local addresses, remote addresses and lengths, which
  submits the batch and returns when it is complete (it polls in C++,
  with Python's lock released);
- an 8-byte op: ``transfer_sync_write`` (or ``_read``).

The engine picks its transport by looking for RDMA devices, whatever
``initialize``'s protocol argument says: on a host with an RDMA NIC,
"tcp" would run over RDMA. ``--transport tcp`` therefore sets
MC_FORCE_TCP=1 (for both processes). Mooncake's wheels have no same-host
shared-memory transport (their TENT backend, which has one, is not built
in), so there is no shm run. MC_LOG_LEVEL=WARNING unless set: at INFO it
logs every batch.

    bench/peers/setup.sh mooncake
    ~/.cache/ferry-peers/mooncake/bin/python bench/peers/mooncake_bench.py \\
        --transport tcp --workload bw|lat|all --op write|read|both
"""

from __future__ import annotations

import os
from typing import Any, Dict

import harness

PACKAGES = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")


def version() -> Dict[str, Any]:
    from importlib import metadata

    for package in PACKAGES:
        try:
            return {"version": metadata.version(package), "package": package}
        except metadata.PackageNotFoundError:
            pass
    return {"version": "unknown"}


class Mooncake(harness.Engine):
    system = "mooncake"

    def __init__(self, args, role: str):
        super().__init__(args, role)
        from mooncake.engine import TransferEngine

        self.fixed = version()
        self.engine = TransferEngine()
        rc = self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", args.transport, "")
        if rc != 0:
            raise RuntimeError(f"TransferEngine.initialize failed: {rc}")
        self.session = f"127.0.0.1:{self.engine.get_rpc_port()}"
        self.peer = None
        self.peer_addr = 0
        self.registered = 0

    def register(self, buffer: harness.Buffer) -> Dict[str, Any]:
        self.buffer = buffer
        rc = self.engine.register_memory(buffer.addr, buffer.nbytes)
        if rc != 0:
            raise RuntimeError(f"register_memory failed: {rc}")
        self.registered = buffer.addr
        return {"session": self.session, "addr": buffer.addr}

    def connect(self, peer: Dict[str, Any]) -> None:
        # P2P handshake: the first transfer to a session opens it.
        self.peer = peer["session"]
        self.peer_addr = peer["addr"]

    def bw_request(self, op: str, block: int, batch: int, slots: int):
        call = self.engine.batch_transfer_sync_write if op == "write" else self.engine.batch_transfer_sync_read
        span = batch * block
        lists = []
        for s in range(slots):
            offsets = [s * span + i * block for i in range(batch)]
            lists.append(([self.buffer.addr + o for o in offsets], [self.peer_addr + o for o in offsets]))
        lengths = [block] * batch
        peer = self.peer

        def post(slot: int) -> None:
            local, remote = lists[slot]
            rc = call(peer, local, remote, lengths)
            if rc != 0:
                raise RuntimeError(f"Mooncake batch {op} failed: {rc}")

        return post, lambda: None

    def lat_request(self, op: str):
        call = self.engine.transfer_sync_write if op == "write" else self.engine.transfer_sync_read
        peer, local, remote = self.peer, self.buffer.addr, self.peer_addr

        def post() -> None:
            rc = call(peer, local, remote, harness.LAT_BLOCK)
            if rc != 0:
                raise RuntimeError(f"Mooncake {op} failed: {rc}")

        return post, lambda: None

    def fields(self) -> Dict[str, Any]:
        return dict(system=self.system, **self.fixed)

    def close(self) -> None:
        if self.registered:
            self.engine.unregister_memory(self.registered)
            self.registered = 0


def main() -> None:
    p = harness.arguments(__doc__, ["tcp"])
    args, _ = p.parse_known_args()
    if args.transport == "tcp":
        os.environ["MC_FORCE_TCP"] = "1"
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    harness.main(Mooncake, p)


if __name__ == "__main__":
    main()
