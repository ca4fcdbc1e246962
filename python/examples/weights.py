"""Weight publication: a trainer of 2 ranks publishes 10 versions of a
model's weights to 4 inference processes that shard them another way, one
process per rank, every byte of every version checked.

The trainer's ranks split each weight matrix by rows; the inference ranks
split it by columns (tensor parallelism of another degree), each in two
buffers, so that its readers keep serving the previous version while the
next one arrives. Each trainer rank publishes its layout once
(``ferry.Publisher``); each inference rank plans once against both
(``ferry.Subscriber``): from then on, after each training step, a trainer
rank takes its memory (``publisher.write()``), writes the new weights and
publishes the version number, and each inference rank's
``subscriber.update()`` pulls its columns of the newest complete version
from both trainer ranks, with nothing planned, registered or exchanged but
a lease per rank.

Version ``v``'s bytes are a function of ``v``, the tensor and the element's
global index: each inference rank checks every byte it holds, under a read
guard (``subscriber.read()``), against what it computes on its own.

    python weights.py            # same-host shared memory, else TCP
    python weights.py --tcp      # TCP only
    python weights.py --mib 64   # 64 MiB per version (default 16)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import IO, Any, Dict, List, Optional

import numpy as np
import numpy.typing as npt

import ferry

TRAINER_RANKS, INFERENCE_RANKS, VERSIONS = 2, 4, 10
LAYERS = 4  # weight matrices, HIDDEN x HIDDEN float32 each
TIMEOUT = 30.0
SET = "policy"

Bits = npt.NDArray[np.uint32]
Weights = npt.NDArray[np.float32]


def hidden_for(mib: int) -> int:
    """The matrices' side for ``mib`` MiB per version: a multiple of both
    sides' rank counts."""
    side = int((mib * (1 << 20) / (LAYERS * 4)) ** 0.5)
    return max(16, side - side % 16)


def bits(version: int, layer: int, hidden: int, rows: slice, cols: slice) -> Bits:
    """The bits of version ``version`` of matrix ``layer``, for the rows
    and columns given: a mix of the version and each element's global
    index, every element and version its own."""
    r = np.arange(rows.start, rows.stop, dtype=np.uint64)[:, None]
    c = np.arange(cols.start, cols.stop, dtype=np.uint64)[None, :]
    index = (np.uint64(layer) * np.uint64(hidden) + r) * np.uint64(hidden) + c
    mixed = index * np.uint64(2654435761) + np.uint64(version * 40503 + 1)
    return ((mixed ^ (mixed >> np.uint64(17))) & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def say(answer: Dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


# -- the ranks ----------------------------------------------------------------------


def trainer_rank(node: ferry.Node, rank: int, hidden: int) -> int:
    """Holds its rows of every matrix, in one array (one registration)."""
    rows = hidden // TRAINER_RANKS
    mine = slice(rank * rows, (rank + 1) * rows)
    weights: Weights = np.zeros((LAYERS, rows, hidden), dtype=np.float32)
    region = node.register(weights)
    layout = ferry.RankLayout(rank, [
        ferry.TensorLayout.from_array(
            f"layers.{layer}.weight", weights[layer], region,
            axes=("out", "in"), parts={"out": (rank, TRAINER_RANKS)},
        )
        for layer in range(LAYERS)
    ])
    with ferry.Publisher(node, SET, layout) as publisher:
        say({"addr": str(node.addr)})
        for line in sys.stdin:
            version = int(json.loads(line)["version"])
            started = time.perf_counter()
            # The training step's optimizer would write here.
            with publisher.write(timeout=TIMEOUT) as write:
                for layer in range(LAYERS):
                    weights[layer].view(np.uint32)[:] = bits(version, layer, hidden, mine, slice(0, hidden))
                write.publish(version)
            say({"seconds": time.perf_counter() - started, "overrun": write.overrun})
    return 0


def inference_rank(node: ferry.Node, rank: int, hidden: int) -> int:
    """Holds its columns of every matrix, twice (two buffers)."""
    cols = hidden // INFERENCE_RANKS
    mine = slice(rank * cols, (rank + 1) * cols)
    buffers: List[Weights] = []
    layouts: List[ferry.RankLayout] = []
    for _ in range(2):
        weights: Weights = np.zeros((LAYERS, hidden, cols), dtype=np.float32)
        region = node.register(weights)
        buffers.append(weights)
        layouts.append(ferry.RankLayout(rank, [
            ferry.TensorLayout.from_array(
                f"layers.{layer}.weight", weights[layer], region,
                axes=("out", "in"), parts={"in": (rank, INFERENCE_RANKS)},
            )
            for layer in range(LAYERS)
        ]))
    say({"ready": True})
    subscriber: Optional[ferry.Subscriber] = None
    for line in sys.stdin:
        order = json.loads(line)
        if order["op"] == "subscribe":
            started = time.perf_counter()
            subscriber = ferry.Subscriber(node, SET, order["publishers"], layouts, timeout=TIMEOUT)
            say({"seconds": time.perf_counter() - started})
        elif order["op"] == "update":
            assert subscriber is not None, "an update before the subscription"
            started = time.perf_counter()
            update = subscriber.update(timeout=TIMEOUT)
            seconds = time.perf_counter() - started
            # Readers (the inference engine) hold the version they read.
            with subscriber.read(timeout=TIMEOUT) as b:
                ok = update.changed and all(
                    np.array_equal(
                        buffers[b][layer].view(np.uint32),
                        bits(update.version, layer, hidden, slice(0, hidden), mine),
                    )
                    for layer in range(LAYERS)
                )
            say({"version": update.version, "seconds": seconds, "ok": ok,
                 "bytes": buffers[b].nbytes})
    return 0


# -- the driver ---------------------------------------------------------------------


class Child:
    """A rank's process, spoken to one JSON line each way."""

    def __init__(self, role: str, rank: int, args: argparse.Namespace) -> None:
        command = [sys.executable, __file__, "--role", role, "--rank", str(rank), "--mib", str(args.mib)]
        if args.tcp:
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


def driver(args: argparse.Namespace) -> int:
    started = time.monotonic()
    hidden = hidden_for(args.mib)
    size = LAYERS * hidden * hidden * 4
    transport = "tcp" if args.tcp else "memory"
    children: List[Child] = []
    wrong: List[str] = []
    try:
        trainers = [Child("trainer", r, args) for r in range(TRAINER_RANKS)]
        children += trainers
        inference = [Child("inference", r, args) for r in range(INFERENCE_RANKS)]
        children += inference
        addresses = [t.first["addr"] for t in trainers]
        for i in inference:
            i.send(op="subscribe", publishers=addresses)
        planned = max(i.read()["seconds"] for i in inference)
        print(
            f"weights: {LAYERS} matrices of {hidden}x{hidden} float32 ({size / (1 << 20):.1f} MiB per "
            f"version), trainer TP {TRAINER_RANKS} (rows) -> inference TP {INFERENCE_RANKS} (columns, "
            f"two buffers each), over {transport}; subscribed and planned in {planned * 1e3:.1f} ms"
        )
        times: List[float] = []
        for version in range(1, VERSIONS + 1):
            for t in trainers:
                t.send(version=version)
            published = max(t.read()["seconds"] for t in trainers)
            for i in inference:
                i.send(op="update")
            answers = [i.read() for i in inference]
            for r, a in enumerate(answers):
                if not a["ok"] or a["version"] != version:
                    wrong.append(f"inference rank {r}, version {version}: {a}")
            slowest = max(a["seconds"] for a in answers)
            times.append(slowest)
            moved = sum(a["bytes"] for a in answers)
            print(
                f"version {version:2d}: written and published in {published * 1e3:6.1f} ms; "
                f"updates {min(a['seconds'] for a in answers) * 1e3:6.1f}-{slowest * 1e3:6.1f} ms "
                f"({moved / slowest / 1e9:5.2f} GB/s over the 4), "
                f"{'checked' if all(a['ok'] for a in answers) else 'WRONG BYTES'}"
            )
        for child in children:
            if child.close() != 0:
                wrong.append(f"{child.name} exited non-zero")
        children = []
        if wrong:
            print("weights: FAILED\n" + "\n".join(wrong), file=sys.stderr)
            return 1
        print(
            f"weights: {VERSIONS} versions, every byte checked by each of the {INFERENCE_RANKS} "
            f"subscribers; update median {statistics.median(times) * 1e3:.1f} ms, "
            f"max {max(times) * 1e3:.1f} ms; {time.monotonic() - started:.2f} s"
        )
        return 0
    finally:
        for child in children:
            child.proc.kill()
            child.proc.wait()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--role", choices=["trainer", "inference"])
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--mib", type=int, default=16, help="MiB per version (default 16)")
    parser.add_argument("--tcp", action="store_true", help="TCP only, no same-host memory")
    args = parser.parse_args(argv)
    if args.role is None:
        return driver(args)
    hidden = hidden_for(args.mib)
    with ferry.Node(memory=not args.tcp) as node:
        if args.role == "trainer":
            return trainer_rank(node, args.rank, hidden)
        return inference_rank(node, args.rank, hidden)


if __name__ == "__main__":
    sys.exit(main())
