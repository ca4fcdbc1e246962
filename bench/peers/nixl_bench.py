#!/usr/bin/env python3
"""`ferry bench`'s workloads through NVIDIA NIXL's Python API, two processes
on one host, host memory: over loopback TCP or same-host shared memory, on
NIXL's UCX backend or on any other (``--backend FERRY``: ferry's NIXL
plugin). The harness (processes, buffers, timing, checks, rows) is
harness.py's; this file is the NIXL calls, as vLLM's NixlConnector makes
them:

- each side: ``nixl_agent`` with no backend, then ``create_backend`` of
  the one measured; ``register_memory`` of its buffer ("DRAM");
  ``get_agent_metadata`` to the other side, which ``add_remote_agent``s
  it; the initiator then ``make_connection``s;
- a bandwidth request: both sides' buffers cut into BLOCK-byte
  descriptors, prepared once per block size (``prep_xfer_dlist``, local
  and remote); per request ``make_prepped_xfer`` of the slot's indices,
  with NIXL's merging of adjacent descriptors off (``skip_desc_merge``:
  a batch of 1,024 adjacent 4 KiB blocks is 1,024 ops, as ferry's is),
  ``transfer``, then ``check_xfer_state`` until DONE, and
  ``release_xfer_handle``;
- an 8-byte op: the same, with one-descriptor lists.

Transports (``--transport``), set through UCX's environment before NIXL
loads (values already in the environment win; UCX_NET_DEVICES=lo always):

  tcp  UCX_TLS=tcp. With --backend FERRY: the plugin's transports=tcp.
  shm  UCX_TLS=posix,cma,self and UCX_POSIX_ERROR_HANDLING=y: NIXL opens
       UCX endpoints that ask for peer-failure handling, which UCX's
       shared-memory transports offer only with that variable set;
       without it, creating the backend fails ("Destination is
       unreachable"). With --backend FERRY: transports=memory.

NIXL's progress thread (on by default, as in vLLM) polls without
sleeping, a core per agent; ``--no-prog-thread`` turns it off, and the
initiator's ``check_xfer_state`` drives progress, while the target calls
``get_new_notifs`` in a loop (over TCP, UCX moves no bytes on the target
unless something progresses it). The scripts run with --no-prog-thread:
on a 2-core host, two spinning progress threads beside the two callers
oversubscribe the CPU.

    bench/peers/setup.sh nixl
    ~/.cache/ferry-peers/nixl/bin/python bench/peers/nixl_bench.py --transport tcp|shm \\
        --backend UCX|FERRY --workload bw|lat|all --op write|read|both [--no-prog-thread]
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from typing import Any, Dict

import numpy as np

import harness

# The name NIXL gives the local side of a transfer in prep_xfer_dlist.
LOCAL = "NIXL_INIT_AGENT"


def set_environment(args) -> None:
    """UCX reads its variables when NIXL loads it: before `import nixl`."""
    env = os.environ
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    env.setdefault("UCX_NET_DEVICES", "lo")
    if args.transport == "tcp":
        env.setdefault("UCX_TLS", "tcp")
    else:
        env.setdefault("UCX_TLS", "posix,cma,self")
        env.setdefault("UCX_POSIX_ERROR_HANDLING", "y")


def versions() -> Dict[str, Any]:
    """NIXL's version, and the UCX bundled in the wheel `import nixl` chose."""
    from importlib import metadata

    import nixl._api  # noqa: F401 - loads the real wheel (nixl_cu12, nixl_cu13)

    module = getattr(sys.modules["nixl"], "_pkg", None)
    name = module.__name__ if module else "nixl"
    out: Dict[str, Any] = {"version": metadata.version("nixl"), "wheel": name}
    libs = os.path.join(os.path.dirname(sys.modules[name].__file__), os.pardir, name + ".libs")
    for lib in glob.glob(os.path.join(libs, "libucp*.so*")):
        try:
            ucp = ctypes.CDLL(lib)
            ucp.ucp_get_version_string.restype = ctypes.c_char_p
            out["ucx"] = ucp.ucp_get_version_string().decode()
        except (OSError, AttributeError):
            pass
    return out


class Nixl(harness.Engine):
    system = "nixl"

    def __init__(self, args, role: str):
        super().__init__(args, role)
        from nixl._api import nixl_agent, nixl_agent_config

        self.fixed = versions()
        self.agent = nixl_agent(f"ferry-peers-{role}-{os.getpid()}",
                                nixl_agent_config(enable_prog_thread=args.prog_thread, backends=[]))
        params: Dict[str, str] = {}
        if args.backend == "FERRY":
            # ferry's plugin picks its transport as ferry routes (same-host
            # memory first); name the one this run measures.
            params["transports"] = "tcp" if args.transport == "tcp" else "memory"
        self.agent.create_backend(args.backend, params)
        self.target_progress = role == "target" and not args.prog_thread
        self.remote = None
        self.remote_addr = 0
        self.registered = None

    def register(self, buffer: harness.Buffer) -> Dict[str, Any]:
        self.buffer = buffer
        self.registered = self.agent.register_memory([(buffer.addr, buffer.nbytes, 0, "")], "DRAM")
        return {"metadata": self.agent.get_agent_metadata().hex(), "addr": buffer.addr}

    def connect(self, peer: Dict[str, Any]) -> None:
        name = self.agent.add_remote_agent(bytes.fromhex(peer["metadata"]))
        self.remote = name.decode() if isinstance(name, bytes) else name
        self.remote_addr = peer["addr"]
        if self.role == "initiator":
            self.agent.make_connection(self.remote)

    def descs(self, base: int, length: int, block: int) -> np.ndarray:
        """[addr, len, device] of each BLOCK-byte piece of [base, base+length)."""
        n = length // block
        d = np.zeros((n, 3), dtype=np.uint64)
        d[:, 0] = base + np.arange(n, dtype=np.uint64) * np.uint64(block)
        d[:, 1] = block
        return d

    def request(self, op: str, length: int, block: int):
        """The local and remote prepared lists of [0, length) in BLOCKs,
        and a function that moves the ops of one index array."""
        a = self.agent
        local = a.prep_xfer_dlist(LOCAL, self.descs(self.buffer.addr, length, block), "DRAM")
        remote = a.prep_xfer_dlist(self.remote, self.descs(self.remote_addr, length, block), "DRAM")
        kind = op.upper()

        def move(indices: np.ndarray) -> None:
            h = a.make_prepped_xfer(kind, local, indices, remote, indices, skip_desc_merge=True)
            state = a.transfer(h)
            while state == "PROC":
                state = a.check_xfer_state(h)
            a.release_xfer_handle(h)
            if state != "DONE":
                raise RuntimeError(f"NIXL {kind} request ended {state}")

        def release() -> None:
            a.release_dlist_handle(local)
            a.release_dlist_handle(remote)

        return move, release

    def bw_request(self, op: str, block: int, batch: int, slots: int):
        move, release = self.request(op, self.buffer.nbytes, block)
        indices = [np.arange(s * batch, (s + 1) * batch, dtype=np.int32) for s in range(slots)]
        return (lambda slot: move(indices[slot])), release

    def lat_request(self, op: str):
        move, release = self.request(op, harness.LAT_BLOCK, harness.LAT_BLOCK)
        first = np.zeros(1, dtype=np.int32)
        return (lambda: move(first)), release

    def progress(self) -> None:
        self.agent.get_new_notifs()

    def fields(self) -> Dict[str, Any]:
        return dict(system=self.system, backend=self.args.backend, **self.fixed,
                    ucx_tls=os.environ.get("UCX_TLS"), prog_thread=self.args.prog_thread)

    def close(self) -> None:
        if self.remote is not None:
            self.agent.remove_remote_agent(self.remote)
            self.remote = None
        if self.registered is not None:
            self.agent.deregister_memory(self.registered)
            self.registered = None


def main() -> None:
    p = harness.arguments(__doc__, ["tcp", "shm"])
    p.add_argument("--backend", default="UCX",
                   help="the NIXL backend plugin measured: UCX (NIXL's own) or FERRY (ferry's, "
                        "installed with `ferry nixl install`) [%(default)s]")
    p.add_argument("--no-prog-thread", dest="prog_thread", action="store_false",
                   help="no NIXL progress thread: the callers' polls progress (see above)")
    args, _ = p.parse_known_args()
    set_environment(args)
    harness.main(Nixl, p)


if __name__ == "__main__":
    main()
