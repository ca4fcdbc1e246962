"""The two-process harness shared by nixl_bench.py and mooncake_bench.py.

It runs `ferry bench`'s workloads on another transfer library, and prints
rows with `ferry bench --json`'s fields, so that scripts/perf-page.sh and
the comparison scripts read every system's rows the same way. A program
(nixl_bench.py, mooncake_bench.py) supplies an *engine*: the few calls that
differ from library to library (register memory, connect, one bandwidth
request, one 8-byte op). Everything else is here, once: the processes,
the buffers and their byte patterns, the timing, the checks and the rows.

Processes. The process started by the user is the *initiator*: it moves
the bytes and measures. It starts this same program again as the *target*
(``--role target``), which owns the memory the initiator writes to and
reads from. The two talk over a socket pair that carries only control
messages (each side's connection details, "check these bytes", "quit");
the data goes through the library measured. The target asks the kernel to
kill it when the initiator dies (PR_SET_PDEATHSIG), so that no target
outlives an interrupted run.

Memory. Each side maps its own 256 MiB (``--buffer-mib``) of anonymous,
page-aligned memory, touched before it is registered (so that no page
fault is measured), and fills it with a byte pattern of its own: the
initiator with pattern 1, the target with pattern 2. A byte's value depends
on its offset, so a block that lands at the wrong offset is caught, not
only one that does not arrive.

Workloads, as `ferry bench` runs them (see bench/peers/README.md):

  bw   one request of ``batch`` ops of ``block`` bytes in flight at a time,
       batch = min(1024, 64 MiB / block): 4K x1024, 64K x1024, 1M x64,
       16M x4. Requests go round the buffer in slots of batch*block bytes,
       op i of a request at the same offset on both sides. A warm-up pass
       over the slots (at most 0.5 s), then ``--duration`` seconds.
  lat  one 8-byte op per request, at offset 0: ``--warmup`` requests, then
       at least ``--duration`` seconds and ``--lat-iters`` requests (at
       most ``--max-seconds``).

Checks (the ``verified`` field): after a write run, the target compares
every byte the run wrote with the initiator's pattern, then puts its own
back; after a read run, the initiator compares what it read with the
target's pattern, then puts its own back. A row that fails its check is
printed with ``verified: false`` and the program exits 1.

Output: one JSON object per line on stdout, nothing else: the libraries'
own output (C code that prints to file descriptor 1 included) goes to
stderr. Python standard library and numpy only.
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
import struct
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

MiB = 1 << 20
# The seeds of the two sides' patterns.
INITIATOR, TARGET = 1, 2
# The largest request of the bandwidth workload, and the most ops in one.
REQUEST_BYTES = 64 * MiB
MAX_BATCH = 1024
LAT_BLOCK = 8


# ------------------------------------------------------------------ sizes


def parse_size(text: str) -> int:
    """"4K", "64K", "1M", "16M", "8" (binary units) -> bytes."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


def batch_for(block: int, buffer: int) -> int:
    """Ops per bandwidth request for BLOCK: as `ferry bench` and the page's cells."""
    return max(1, min(MAX_BATCH, REQUEST_BYTES // block, buffer // block))


# ------------------------------------------------------------------ memory


class Pattern:
    """The bytes a side fills its buffer with: 64-bit word w (counted from
    the start of the buffer) holds (w + 1) * 0xD1B54A32D192ED03 xor
    seed * 0x8CB92BA72F3D8DD7, little-endian. Made a chunk at a time in
    one scratch array, so filling or checking 256 MiB allocates nothing."""

    CHUNK = 8 * MiB
    MUL = np.uint64(0xD1B54A32D192ED03)

    def __init__(self, seed: int):
        self.key = np.uint64((seed * 0x8CB92BA72F3D8DD7) % (1 << 64))
        self.words = np.arange(1, self.CHUNK // 8 + 1, dtype=np.uint64)
        self.scratch = np.empty(self.CHUNK // 8, dtype=np.uint64)

    def pieces(self, start: int, length: int):
        """(offset, bytes) of the pattern over [start, start+length), both multiples of 8."""
        end = start + length
        while start < end:
            n = min(self.CHUNK, end - start)
            w = self.scratch[: n // 8]
            np.add(self.words[: n // 8], np.uint64(start // 8), out=w)
            np.multiply(w, self.MUL, out=w)
            np.bitwise_xor(w, self.key, out=w)
            yield start, w.view(np.uint8)
            start += n

    def fill(self, buf: np.ndarray, start: int, length: int) -> None:
        for at, piece in self.pieces(start, length):
            buf[at : at + len(piece)] = piece

    def holds(self, buf: np.ndarray, start: int, length: int) -> bool:
        return all(np.array_equal(buf[at : at + len(piece)], piece) for at, piece in self.pieces(start, length))


class Buffer:
    """NBYTES of anonymous, page-aligned memory, every page touched, filled
    with the pattern of SEED; ``addr`` is its address, ``view`` a numpy
    array over it."""

    def __init__(self, nbytes: int, seed: int):
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self.map = mmap.mmap(-1, nbytes, flags=flags)
        self.view = np.frombuffer(self.map, dtype=np.uint8)
        self.addr = self.view.ctypes.data
        self.nbytes = nbytes
        self.own = Pattern(seed)
        self.own.fill(self.view, 0, nbytes)

    def holds(self, pattern: Pattern, ranges: List[Tuple[int, int]]) -> bool:
        return all(pattern.holds(self.view, start, length) for start, length in ranges)

    def restore(self, ranges: List[Tuple[int, int]]) -> None:
        for start, length in ranges:
            self.own.fill(self.view, start, length)


# ------------------------------------------------------------------ control channel


class Control:
    """Length-prefixed JSON messages over one end of the socket pair."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def send(self, **message: Any) -> None:
        data = json.dumps(message).encode()
        self.sock.sendall(struct.pack("!I", len(data)) + data)

    def _exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            more = self.sock.recv(n - len(data))
            if not more:
                raise EOFError("the other process closed the control channel")
            data += more
        return data

    def recv(self) -> Dict[str, Any]:
        (n,) = struct.unpack("!I", self._exactly(4))
        return json.loads(self._exactly(n))

    def waiting(self) -> bool:
        """Whether a message has (begun to) arrive, without blocking."""
        return bool(select.select([self.sock], [], [], 0)[0])

    def call(self, **message: Any) -> Dict[str, Any]:
        self.send(**message)
        return self.recv()


# ------------------------------------------------------------------ the engine interface


class Engine:
    """What a program supplies for its library. The harness calls, on
    both sides: ``register(buffer)`` (returns what the other side needs to
    reach it, JSON-able), then ``connect(peer)`` with the other side's.
    On the initiator: ``bw_request`` and ``lat_request``. On the target,
    while it waits for the next control message: ``progress()`` in a loop
    if ``target_progress`` is true (a library whose target moves no bytes
    unless its caller polls it), else it sleeps in recv."""

    system = "?"
    target_progress = False

    def __init__(self, args: argparse.Namespace, role: str):
        self.args, self.role = args, role

    def register(self, buffer: Buffer) -> Dict[str, Any]:
        raise NotImplementedError

    def connect(self, peer: Dict[str, Any]) -> None:
        raise NotImplementedError

    def bw_request(self, op: str, block: int, batch: int, slots: int) -> Tuple[Callable[[int], None], Callable[[], None]]:
        """(post(slot), release()): post(slot) moves slot SLOT's batch ops
        (op i at offset slot*batch*block + i*block on both sides) and
        returns once they are complete, raising on a failure."""
        raise NotImplementedError

    def lat_request(self, op: str) -> Tuple[Callable[[], None], Callable[[], None]]:
        """(post(), release()): post() moves the 8 bytes at offset 0."""
        raise NotImplementedError

    def progress(self) -> None:
        pass

    def fields(self) -> Dict[str, Any]:
        """Fields every row of this engine carries (system, version, ...)."""
        return {"system": self.system}

    def close(self) -> None:
        pass


# ------------------------------------------------------------------ arguments


def arguments(description: str, transports: List[str]) -> argparse.ArgumentParser:
    """The options both programs share; a program adds its own."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", choices=transports, default=transports[0])
    p.add_argument("--workload", choices=["bw", "lat", "all"], default="all")
    p.add_argument("--op", choices=["write", "read", "both"], default="both")
    p.add_argument("--blocks", default="4K,64K,1M,16M", help="bw block sizes, comma separated [%(default)s]")
    p.add_argument("--duration", type=float, default=3.0, help="seconds per measurement [%(default)s]")
    p.add_argument("--warmup", type=int, default=200, help="lat: unmeasured requests first [%(default)s]")
    p.add_argument("--lat-iters", type=int, default=2000, help="lat: at least this many measured [%(default)s]")
    p.add_argument("--max-seconds", type=float, default=60.0,
                   help="lat: stop here even short of --lat-iters [%(default)s]")
    p.add_argument("--buffer-mib", type=int, default=256, help="each side's buffer [%(default)s]")
    p.add_argument("--role", choices=["initiator", "target"], default="initiator", help=argparse.SUPPRESS)
    p.add_argument("--control-fd", type=int, help=argparse.SUPPRESS)
    return p


# ------------------------------------------------------------------ measuring


def cpu_seconds(pid: Optional[int] = None) -> float:
    """User + system CPU seconds of a whole process, every thread: this
    one, or (by pid) the target."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(sorted_values: List[float], p: float) -> float:
    """As `ferry bench` takes them: the value at round((n - 1) * p)."""
    return sorted_values[min(len(sorted_values) - 1, round((len(sorted_values) - 1) * p))]


class Initiator:
    def __init__(self, args: argparse.Namespace, engine: Engine, buffer: Buffer, control: Control, target: int):
        self.args, self.engine, self.buffer, self.control, self.target = args, engine, buffer, control, target
        self.theirs = Pattern(TARGET)
        self.failed = False

    def emit(self, workload: str, op: str, block: int, batch: int, lat_ns: List[int], seconds: float,
             verified: bool, cpu: Tuple[float, float, float]) -> None:
        lat_us = sorted(x / 1000 for x in lat_ns)
        n = len(lat_us)
        wall = time.perf_counter() - cpu[2]
        row = dict(self.engine.fields())
        row.update(
            transport=self.args.transport, workload=workload, op=op, block=block, batch=batch,
            submits=n, bytes=n * batch * block, seconds=round(seconds, 4),
            gbps=n * batch * block / seconds / 1e9, mops=n * batch / seconds / 1e6,
            lat_avg_us=sum(lat_us) / n, lat_p50_us=percentile(lat_us, 0.5), lat_p99_us=percentile(lat_us, 0.99),
            verified=verified,
            # CPU per wall second over the measured loop, every thread of
            # the process (1.0: one core), and the load when it ended: how
            # much of the machine the pair had.
            cpu_initiator=round((cpu_seconds() - cpu[0]) / wall, 2),
            cpu_target=round((cpu_seconds(self.target) - cpu[1]) / wall, 2),
            load1=os.getloadavg()[0],
        )
        if not verified:
            self.failed = True
            print(f"{self.engine.system}: the {workload} {op} run of {block}-byte blocks moved wrong bytes",
                  file=sys.stderr)
        os.write(ROWS_FD, (json.dumps(row) + "\n").encode())

    def check(self, op: str, ranges: List[Tuple[int, int]]) -> bool:
        """The run's bytes where they should be; then each side's own back."""
        if op == "write":
            return bool(self.control.call(cmd="check", ranges=ranges)["ok"])
        ok = self.buffer.holds(self.theirs, ranges)
        self.buffer.restore(ranges)
        return ok

    def bw(self, op: str, block: int) -> None:
        nbytes = self.buffer.nbytes
        batch = batch_for(block, nbytes)
        span = batch * block
        slots = nbytes // span
        post, release = self.engine.bw_request(op, block, batch, slots)
        pc = time.perf_counter_ns
        k = 0
        # Warm-up: one pass over the slots, at most 0.5 s (connections,
        # the library's caches of the registration).
        until = pc() + 500_000_000
        while k < slots:
            post(k)
            k += 1
            if pc() > until:
                break
        lat: List[int] = []
        cpu = (cpu_seconds(), cpu_seconds(self.target), time.perf_counter())
        start = pc()
        deadline = start + int(self.args.duration * 1e9)
        while True:
            t0 = pc()
            post(k % slots)
            t1 = pc()
            lat.append(t1 - t0)
            k += 1
            if t1 >= deadline:
                break
        seconds = (t1 - start) / 1e9
        release()
        # Slots go round from 0: the first min(k, slots) were moved.
        verified = self.check(op, [(0, min(k, slots) * span)])
        self.emit("bw", op, block, batch, lat, seconds, verified, cpu)

    def lat(self, op: str) -> None:
        post, release = self.engine.lat_request(op)
        args = self.args
        pc = time.perf_counter_ns
        for _ in range(args.warmup):
            post()
        lat: List[int] = []
        cpu = (cpu_seconds(), cpu_seconds(self.target), time.perf_counter())
        start = pc()
        deadline = start + int(args.duration * 1e9)
        cap = start + int(args.max_seconds * 1e9)
        while True:
            t0 = pc()
            post()
            t1 = pc()
            lat.append(t1 - t0)
            if t1 >= cap or (t1 >= deadline and len(lat) >= args.lat_iters):
                break
        seconds = (t1 - start) / 1e9
        release()
        verified = self.check(op, [(0, LAT_BLOCK)])
        self.emit("lat", op, LAT_BLOCK, 1, lat, seconds, verified, cpu)


def run_target(args: argparse.Namespace, engine: Engine, buffer: Buffer, control: Control) -> int:
    initiator = Pattern(INITIATOR)
    while True:
        if engine.target_progress:
            while not control.waiting():
                engine.progress()
        message = control.recv()
        if message["cmd"] == "check":
            ranges = [tuple(r) for r in message["ranges"]]
            ok = buffer.holds(initiator, ranges)
            buffer.restore(ranges)
            control.send(ok=ok)
        elif message["cmd"] == "quit":
            engine.close()
            control.send(ok=True)
            return 0


def main(make_engine: Callable[[argparse.Namespace, str], Engine], parser: argparse.ArgumentParser) -> None:
    """Parses the options, runs the side --role names, and exits without
    the libraries' destructors (see below)."""
    global ROWS_FD
    args = parser.parse_args()
    # Rows go to the real stdout, through a descriptor of our own; fd 1
    # becomes stderr, so that what the libraries print never mixes in.
    ROWS_FD = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    code = 1
    try:
        code = run(args, make_engine)
    except Exception:  # noqa: BLE001 - said on stderr, and the exit code
        import traceback

        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.CDLL(None).fflush(None)
    # Everything the library holds was released above; its destructors at
    # interpreter exit are skipped (NIXL's bundled UCX crashes in one).
    os._exit(code)


ROWS_FD = 1


def run(args: argparse.Namespace, make_engine: Callable[[argparse.Namespace, str], Engine]) -> int:
    buffer_bytes = args.buffer_mib * MiB
    if args.role == "target":
        # PR_SET_PDEATHSIG (1): SIGKILL when the initiator goes.
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
        if os.getppid() == 1:
            return 1
        control = Control(socket.socket(fileno=args.control_fd))
        buffer = Buffer(buffer_bytes, TARGET)
        engine = make_engine(args, "target")
        control.send(hello=engine.register(buffer))
        engine.connect(control.recv()["hello"])
        control.send(ok=True)
        return run_target(args, engine, buffer, control)

    blocks = [parse_size(b) for b in args.blocks.split(",") if b]
    ours, theirs = socket.socketpair()
    argv = [a for a in sys.argv[1:]]
    target = subprocess.Popen([sys.executable, os.path.abspath(sys.argv[0]), *argv, "--role", "target",
                               "--control-fd", str(theirs.fileno())], pass_fds=[theirs.fileno()],
                              stdout=sys.stderr)
    theirs.close()
    ours.settimeout(600)
    control = Control(ours)
    try:
        buffer = Buffer(buffer_bytes, INITIATOR)
        engine = make_engine(args, "initiator")
        hello = engine.register(buffer)
        peer = control.recv()["hello"]
        control.send(hello=hello)
        control.recv()  # the target has connected to us
        engine.connect(peer)
        bench = Initiator(args, engine, buffer, control, target.pid)
        ops = ["write", "read"] if args.op == "both" else [args.op]
        if args.workload in ("bw", "all"):
            for block in blocks:
                for op in ops:
                    bench.bw(op, block)
        if args.workload in ("lat", "all"):
            for op in ops:
                bench.lat(op)
        control.call(cmd="quit")
        target.wait(timeout=60)
        engine.close()
        return 1 if bench.failed or target.returncode else 0
    finally:
        if target.poll() is None:
            target.kill()  # our own child, on a failure above
            target.wait()
