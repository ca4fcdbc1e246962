"""A NIXL agent in a process of its own, for the FERRY backend's tests: the
other side of every transfer, driven one JSON command per line on stdin,
one JSON answer per line on stdout.

    python nixl_peer.py NAME BACKENDS_JSON PARAMS_JSON [LISTEN_PORT]

It creates its agent with only the named backends (each with its params),
listening for NIXL's metadata exchange on LISTEN_PORT if one is given,
prints ``{"metadata": <base64>}``, then answers commands until stdin closes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
import time

import numpy as np
from nixl._api import nixl_agent, nixl_agent_config


def pattern(length: int, seed: int) -> np.ndarray:
    """Bytes that differ per position and seed, the same in every process."""
    i = np.arange(length, dtype=np.uint64)
    return ((i * np.uint64(2654435761) + np.uint64(seed * 97 + 13)) >> np.uint64(7)).astype(np.uint8)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def timed(call) -> float:
    """Seconds `call` took; an exception it raised is part of the answer."""
    started = time.perf_counter()
    try:
        call()
    except Exception:  # noqa: BLE001 - the time is what is measured
        pass
    return time.perf_counter() - started


def timed_calls(agent: nixl_agent, cmd: dict, held: dict) -> dict:
    """Every NIXL call that reaches the backend, each timed, against the
    agent whose metadata `cmd` carries (never reached before): its memory at
    cmd["addr"] loaded, a prepared WRITE of `len` bytes of
    ``pattern(len, seed)`` made and posted with notification b"prepped", a
    second request made, posted and released, a notification on its own,
    the notifications polled, and a connection asked for. The prepared
    request stays in `held` for ``timed_wait``."""
    src = pattern(cmd["len"], cmd["seed"])
    held["src"] = src
    agent.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    times = {}
    names = []
    times["loadRemoteMD"] = timed(
        lambda: names.append(agent.add_remote_agent(base64.b64decode(cmd["metadata"])).decode())
    )
    peer = names[0]
    mine = [(src.ctypes.data, src.nbytes, 0)]
    theirs = [(cmd["addr"], src.nbytes, 0)]
    local_side = agent.prep_xfer_dlist("NIXL_INIT_AGENT", mine, "DRAM")
    remote_side = agent.prep_xfer_dlist(peer, theirs, "DRAM")
    made = {}

    def prepped() -> None:
        made["xfer"] = agent.make_prepped_xfer("WRITE", local_side, [0], remote_side, [0], notif_msg=b"prepped")

    times["prepXfer"] = timed(prepped)
    held["xfer"] = made["xfer"]
    states = []
    times["postXfer"] = timed(lambda: states.append(agent.transfer(made["xfer"])))
    times["checkXfer"] = timed(lambda: states.append(agent.check_xfer_state(made["xfer"])))

    def other() -> None:
        made["other"] = agent.initialize_xfer(
            "WRITE",
            agent.get_xfer_descs(mine, "DRAM"),
            agent.get_xfer_descs(theirs, "DRAM"),
            peer,
            b"released",
        )

    times["makeXferReq"] = timed(other)
    agent.transfer(made["other"])
    times["releaseReqH"] = timed(lambda: agent.release_xfer_handle(made["other"]))
    times["genNotif"] = timed(lambda: agent.send_notif(peer, b"alone"))
    times["getNotifs"] = timed(agent.get_new_notifs)
    times["connect"] = timed(lambda: agent.make_connection(peer))
    return {"times": times, "states": states}


def main() -> int:
    name, backends, params = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    listen = {"enable_listen_thread": True, "listen_port": int(sys.argv[4])} if len(sys.argv) > 4 else {}
    agent = nixl_agent(name, nixl_agent_config(backends=[], capture_telemetry=True, **listen))
    for backend in backends:
        agent.create_backend(backend, params.get(backend, {}))
    buf = None
    reg = None
    #: What the timed calls made, kept alive between commands.
    held: dict = {}

    def say(answer: dict) -> None:
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()

    say({"metadata": b64(agent.get_agent_metadata())})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "alloc":
                buf = pattern(cmd["len"], cmd["seed"])
                reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
                # The agent's metadata now names this memory too.
                say({"addr": buf.ctypes.data, "len": buf.nbytes, "metadata": b64(agent.get_agent_metadata())})
            elif op == "add_remote":
                say({"name": agent.add_remote_agent(base64.b64decode(cmd["metadata"])).decode()})
            elif op == "has_remote":
                say({"has": agent.check_remote_metadata(cmd["agent"])})
            elif op == "notifs":
                # Waits for `count` messages in all, up to `timeout` seconds,
                # then a little longer to catch any extra one.
                got: dict = {}
                deadline = time.monotonic() + cmd["timeout"]
                settle = None
                while time.monotonic() < deadline:
                    for sender, msgs in agent.get_new_notifs().items():
                        got.setdefault(sender, []).extend(b64(m) for m in msgs)
                    if settle is None and sum(len(v) for v in got.values()) >= cmd["count"]:
                        settle = time.monotonic() + 0.2
                    if settle is not None and time.monotonic() > settle:
                        break
                    time.sleep(0.002)
                say({"notifs": got})
            elif op == "digest":
                say({"digest": hashlib.sha256(buf.tobytes()).hexdigest()})
            elif op == "fill":
                buf[:] = pattern(buf.nbytes, cmd["seed"])
                say({})
            elif op == "send_notif":
                agent.send_notif(cmd["agent"], base64.b64decode(cmd["msg"]))
                say({})
            elif op == "deregister":
                agent.deregister_memory(reg)
                say({})
            elif op == "timed_calls":
                say(timed_calls(agent, cmd, held))
            elif op == "timed_wait":
                # The request timed_calls posted, until it leaves PROC.
                started = time.monotonic()
                state = "PROC"
                while state == "PROC" and time.monotonic() - started < cmd["timeout"]:
                    try:
                        state = agent.check_xfer_state(held["xfer"])
                    except Exception as error:  # noqa: BLE001 - NIXL raises its errors
                        state = f"ERR: {type(error).__name__}"
                    time.sleep(0.001)
                elapsed = time.monotonic() - started
                release = timed(lambda: agent.release_xfer_handle(held["xfer"]))
                say({"state": state, "elapsed": elapsed, "releaseReqH": release})
            else:
                say({"error": f"unknown op {op!r}"})
        except Exception as error:  # noqa: BLE001 - reported to the test
            say({"error": f"{type(error).__name__}: {error}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
