#!/usr/bin/env python3
"""The performance page's rows and renderer, for scripts/perf-page.sh.

perf-page.sh runs the benchmarks; this file turns what each tool printed into
rows of one JSON-lines file per run (RUN_DIR/rows.jsonl, beside
RUN_DIR/meta.json), and turns that file into docs/performance.md, the plots
in docs/perf/*.svg and the README's headline table. Rendering never measures:
every number on the page comes from the rows, so an old run re-renders with

    python3 scripts/perf_page.py render target/perf-page/RUN [--out DIR] [--readme README.md]

Subcommands (Python 3 standard library only; tool output becomes rows in
perf_ingest.py, figures and SVG plots are drawn by perf_svg.py):

    meta RUN_DIR KEY=VALUE...           meta.json: commit, date, machine, options
    ingest KIND ROWS KEY=VALUE...       tool output on stdin -> rows (tagged KEY=VALUE)
    render RUN_DIR [--out DIR] [--readme PATH] [--headline FILE]
    check DIR                           the page and its plots are well formed

Row fields: suite (which table), system, variant, transport, op, block,
batch, round, cmd (the command, as run), and the measurements: gbps (1e9 B/s),
mops, lat_p50_us, lat_p99_us, and for perftest's latency tools lat_rtt_us.
System nixl is bench/peers/nixl_bench.py on NIXL's UCX backend; nixl-ferry
the same program with --backend FERRY (ferry's NIXL plugin), in the same
suites; mooncake is bench/peers/mooncake_bench.py. The physical references
over TCP are system tcp-mover (scripts/tcp-mover.c: variant 4x1M in suite
tcp-bw, one figure for both ops; variants spin and blocking in suite lat);
iperf3 and sockperf are context beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from perf_ingest import PAGE, PLOTS, REPO, cmd_ingest, cmd_meta
from perf_svg import PALETTE, Stat, latency_plot, line_plot, num, size

PERF_BEGIN = "<!-- perf:begin -->"
PERF_END = "<!-- perf:end -->"
# Plots every page has (the RDMA one only when the run had --rdma).
REQUIRED_PLOTS = ("bandwidth-write.svg", "bandwidth-read.svg", "latency.svg")


# ---------------------------------------------------------------- rows


# The system of bench/peers/nixl_bench.py run with --backend FERRY (ferry's
# NIXL plugin); "nixl" is the same program on NIXL's UCX backend.
NIXL_FERRY = "nixl-ferry"


class Rows:
    def __init__(self, rows: List[dict], rounds: int):
        self.rows = [r for r in rows if not r.get("failed") and not r.get("note")]
        self.failed = [r for r in rows if r.get("failed")]
        self.notes = [r for r in rows if r.get("note")]
        self.all = rows
        self.rounds = rounds

    def select(self, **want) -> List[dict]:
        return [r for r in self.rows if all(r.get(k) == v for k, v in want.items())]

    def stat(self, metric: str, **want) -> Stat:
        return Stat([float(r[metric]) for r in self.select(**want) if r.get(metric) is not None])

    def cell(self, st: Stat) -> str:
        if not st:
            return "—"
        n = len(st.values)
        if n == 1 and self.rounds <= 1:
            return num(st.median)
        spread = f"{num(st.lo)}–{num(st.hi)}"
        return f"{num(st.median)} ({spread}{'' if n >= self.rounds else f', n={n}'})"

    def commands(self, suite: str, exclude: Sequence[str] = (NIXL_FERRY,)) -> List[str]:
        return self.commands_where(lambda r: r.get("suite") == suite and r.get("system") not in exclude)

    def commands_where(self, pick, seen: Optional[List[str]] = None) -> List[str]:
        """The commands of the rows `pick` takes, in the order they ran, each
        once (notes as comments), appended to `seen`."""
        seen = [] if seen is None else seen
        for r in self.all:
            if r.get("cmd") and pick(r):
                line = ("# " if r.get("note") else "") + r["cmd"]
                if line not in seen:
                    seen.append(line)
        return seen

    def first(self, field: str, **want) -> Optional[str]:
        for r in self.select(**want):
            if r.get(field):
                return str(r[field])
        return None


def labelled(value: str, label: str) -> str:
    return value if value == "—" else f"{value} ({label})"


def ratio(a: Stat, b: Stat, time: bool = False) -> str:
    """a over b (medians), or b over a for times: above 1, ferry is ahead."""
    if not a or not b or a.median <= 0 or b.median <= 0:
        return "—"
    value = b.median / a.median if time else a.median / b.median
    return f"{value:.2f}"


def best(stats: Sequence[Stat], lower: bool = False) -> Stat:
    present = [s for s in stats if s]
    if not present:
        return Stat([])
    return (min if lower else max)(present, key=lambda s: s.median)


def table(header: Sequence[str], rows: List[List[str]], align: Sequence[str]) -> List[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


# ---------------------------------------------------------------- tables
#
# Each table: a heading, a header row (the check looks for both), and the
# rows of the cells that this run measured.

TCP_BW = "TCP loopback bandwidth"
LAT = "Small-op latency"
MEM_BW = "Same-host bandwidth: prepared requests"
MEM_UCX = "Same-host bandwidth against UCX"
NIXL_API = "Through NIXL's API"
RDMA = "RDMA on soft-RoCE against perftest"

HEADERS = {
    TCP_BW: ["op", "block × ops", "ferry submit", "ferry prepared", "NIXL", "Mooncake", "physical: tcp-mover",
             "context: iperf3", "submit ÷ best peer", "prepared ÷ best peer", "submit ÷ physical",
             "prepared ÷ physical"],
    LAT: ["transport", "8-byte write", "ferry", "NIXL", "Mooncake", "physical: tcp-mover, polling",
          "tcp-mover, blocking", "context: sockperf", "ferry vs best peer (time)", "ferry vs physical (time)"],
    MEM_BW: ["op", "block × ops", "ferry memory", "NIXL shm", "memcpy", "ferry ÷ NIXL", "ferry ÷ memcpy"],
    MEM_UCX: ["block", "ferry, one-block region", "ferry, 256 MiB region", "UCX posix,cma", "UCX tcp",
              "memcpy, one block", "memcpy, 256 MiB", "one-block ÷ best UCX", "one-block ÷ memcpy",
              "256 MiB ÷ best UCX", "256 MiB ÷ memcpy"],
    NIXL_API: ["transport", "cell", "FERRY (through NIXL)", "UCX (through NIXL)", "FERRY ÷ UCX",
               "ferry's own API", "FERRY ÷ ferry's own", "physical", "FERRY ÷ physical"],
    RDMA: ["cell", "unit", "ferry", "perftest", "ferry vs perftest"],
}


def shapes(rows: Rows, suite: str, system: str = "ferry") -> List[Tuple[str, int, int]]:
    found = {(r.get("op"), r.get("block"), r.get("batch")) for r in rows.select(suite=suite, system=system)
             if r.get("gbps") is not None}
    return sorted(found, key=lambda s: (s[0] != "write", s[1], s[2] or 0))


def tcp_bw_table(rows: Rows) -> List[List[str]]:
    out = []
    for op, block, batch in shapes(rows, "tcp-bw"):
        sub = rows.stat("gbps", suite="tcp-bw", system="ferry", variant="submit", op=op, block=block)
        prep = rows.stat("gbps", suite="tcp-bw", system="ferry", variant="prepared", op=op, block=block)
        nixl = rows.stat("gbps", suite="tcp-bw", system="nixl", op=op, block=block)
        moon = rows.stat("gbps", suite="tcp-bw", system="mooncake", op=op, block=block)
        ref = mover(rows)
        peer = best([nixl, moon])
        out.append([op, f"{size(block)} × {batch:,}", rows.cell(sub), rows.cell(prep), rows.cell(nixl),
                    rows.cell(moon), rows.cell(ref), rows.cell(iperf3(rows, op)), ratio(sub, peer), ratio(prep, peer),
                    ratio(sub, ref), ratio(prep, ref)])
    return out


def mover(rows: Rows) -> Stat:
    """The physical reference of every TCP bandwidth cell, writes and reads:
    tcp-mover's process pairs sweeping 256 MiB in 1 MiB calls (one way)."""
    return rows.stat("gbps", suite="tcp-bw", system="tcp-mover")


def mover_rtt(rows: Rows, variant: str = "spin", metric: str = "lat_p50_us") -> Stat:
    """tcp-mover's 8-byte round trip over TCP: polling ("spin") or blocking."""
    return rows.stat(metric, suite="lat", transport="tcp", system="tcp-mover", variant=variant)


def iperf3(rows: Rows, op: str) -> Stat:
    """The faster iperf3 variant's figures for OP (write: client to server;
    read: -R): context beside the physical reference, not the bound: iperf3
    sends one cache-hot buffer again and again."""
    variants = {r.get("variant") for r in rows.select(suite="tcp-bw", system="iperf3", op=op)}
    return best([rows.stat("gbps", suite="tcp-bw", system="iperf3", op=op, variant=v) for v in variants])


def latency_cells(rows: Rows) -> List[Tuple[str, str, Stat, Stat, Stat, Stat, Stat, Stat]]:
    """(transport, percentile, ferry, nixl, mooncake, physical, blocking,
    sockperf) per line; physical is tcp-mover's polling round trip, blocking
    its blocking one (both medians only: no p99)."""
    out = []
    for transport in ("tcp", "memory"):
        if not rows.select(suite="lat", transport=transport):
            continue
        for metric, name in (("lat_p50_us", "p50 µs"), ("lat_p99_us", "p99 µs")):
            get = lambda system, **more: rows.stat(metric, suite="lat", transport=transport, system=system, **more)
            out.append((transport, name, get("ferry"), get("nixl"), get("mooncake"),
                        get("tcp-mover", variant="spin"), get("tcp-mover", variant="blocking"), get("sockperf")))
    return out


def lat_table(rows: Rows) -> List[List[str]]:
    out = []
    for transport, name, ferry, nixl, moon, phys, blocking, sockperf in latency_cells(rows):
        out.append([transport, name, rows.cell(ferry), rows.cell(nixl), rows.cell(moon), rows.cell(phys),
                    rows.cell(blocking), rows.cell(sockperf), ratio(ferry, best([nixl, moon], lower=True), time=True),
                    ratio(ferry, phys, time=True)])
    return out


def mem_bw_table(rows: Rows) -> List[List[str]]:
    out = []
    for op, block, batch in shapes(rows, "mem-bw"):
        ferry = rows.stat("gbps", suite="mem-bw", system="ferry", op=op, block=block)
        nixl = rows.stat("gbps", suite="mem-bw", system="nixl", op=op, block=block)
        cpy = rows.stat("gbps", suite="memcpy", system="memcpy", variant="256M", block=block)
        out.append([op, f"{size(block)} × {batch:,}", rows.cell(ferry), rows.cell(nixl), rows.cell(cpy),
                    ratio(ferry, nixl), ratio(ferry, cpy)])
    return out


def mem_ucx_table(rows: Rows) -> List[List[str]]:
    out = []
    blocks = sorted({r["block"] for r in rows.select(suite="mem-ucx") if r.get("gbps") is not None})
    for block in blocks:
        one = rows.stat("gbps", suite="mem-ucx", system="ferry", variant="one-block", block=block)
        big = rows.stat("gbps", suite="mem-ucx", system="ferry", variant="256M", block=block)
        posix = rows.stat("gbps", suite="mem-ucx", system="ucx", variant="posix,cma", block=block)
        tcp = rows.stat("gbps", suite="mem-ucx", system="ucx", variant="tcp", block=block)
        cpy1 = rows.stat("gbps", suite="memcpy", system="memcpy", variant="one-block", block=block)
        cpy = rows.stat("gbps", suite="memcpy", system="memcpy", variant="256M", block=block)
        ucx = best([posix, tcp])
        out.append([size(block), rows.cell(one), rows.cell(big), rows.cell(posix), rows.cell(tcp), rows.cell(cpy1),
                    rows.cell(cpy), ratio(one, ucx), ratio(one, cpy1), ratio(big, ucx), ratio(big, cpy)])
    return out


def nixl_api_cells(rows: Rows) -> List[Tuple[str, str, str, Stat, Stat, Stat, Stat, str]]:
    """The rows of the NIXL table: (transport, cell, kind, FERRY, UCX,
    ferry's own, physical, physical's name); kind is "bw" or "lat"."""
    out = []
    nixl = (NIXL_FERRY, "nixl")
    for transport, bw_suite, lat_transport in (("TCP", "tcp-bw", "tcp"), ("same host", "mem-bw", "memory")):
        found = {(r.get("op"), r.get("block"), r.get("batch")) for r in rows.rows
                 if r.get("suite") == bw_suite and r.get("system") in nixl and r.get("gbps") is not None}
        for op, block, batch in sorted(found, key=lambda s: (s[0] != "write", s[1] or 0, s[2] or 0)):
            want = dict(suite=bw_suite, op=op, block=block)
            ferry = rows.stat("gbps", system=NIXL_FERRY, **want)
            ucx = rows.stat("gbps", system="nixl", **want)
            if bw_suite == "tcp-bw":
                own = rows.stat("gbps", system="ferry", variant="prepared", **want)
                phys, phys_name = mover(rows), "tcp-mover"
            else:
                own = rows.stat("gbps", system="ferry", **want)
                phys = rows.stat("gbps", suite="memcpy", system="memcpy", variant="256M", block=block)
                phys_name = "memcpy"
            out.append((transport, f"{op} {size(block)} × {batch or 0:,}, GB/s", "bw", ferry, ucx, own, phys,
                        phys_name))
        want = dict(suite="lat", transport=lat_transport)
        if any(rows.select(system=system, **want) for system in nixl):
            ferry = rows.stat("lat_p50_us", system=NIXL_FERRY, **want)
            ucx = rows.stat("lat_p50_us", system="nixl", **want)
            own = rows.stat("lat_p50_us", system="ferry", **want)
            phys = rows.stat("lat_p50_us", system="tcp-mover", variant="spin", **want)
            out.append((transport, "8-byte write p50, µs", "lat", ferry, ucx, own, phys,
                        "tcp-mover, polling" if lat_transport == "tcp" else ""))
    return out


def nixl_api_table(rows: Rows) -> List[List[str]]:
    out = []
    for transport, cell, kind, ferry, ucx, own, phys, _ in nixl_api_cells(rows):
        time = kind == "lat"
        mark = (lambda r: labelled(r, "time")) if time else (lambda r: r)
        out.append([transport, cell, rows.cell(ferry), rows.cell(ucx), mark(ratio(ferry, ucx, time)),
                    rows.cell(own), mark(ratio(ferry, own, time)), rows.cell(phys), mark(ratio(ferry, phys, time))])
    return out


def nixl_api_commands(rows: Rows) -> List[str]:
    """The commands of the rows the NIXL table uses, in the order they ran:
    nixl_bench.py on both backends first, then ferry's own and the physical
    references (the same commands as in the tables above)."""
    seen: List[str] = []

    def add(pick) -> None:
        rows.commands_where(pick, seen)

    nixl_suites = ("tcp-bw", "lat", "mem-bw", NIXL_FERRY)
    add(lambda r: r.get("suite") == NIXL_FERRY)
    add(lambda r: r.get("suite") in nixl_suites and r.get("system") in (NIXL_FERRY, "nixl"))
    if len(seen) == 0:
        return seen
    seen.append("# ferry's own API and the physical references (the commands of the tables above):")
    add(lambda r: r.get("note") and r.get("suite") in ("tcp-bw", "memcpy"))
    add(lambda r: r.get("suite") == "tcp-bw" and r.get("system") == "ferry" and r.get("variant") == "prepared")
    add(lambda r: r.get("suite") == "lat" and (r.get("system") == "ferry" or
                                               (r.get("system") == "tcp-mover" and r.get("variant") == "spin")))
    add(lambda r: r.get("suite") == "mem-bw" and r.get("system") == "ferry")
    add(lambda r: r.get("suite") == "tcp-bw" and r.get("system") == "tcp-mover")
    add(lambda r: r.get("suite") == "memcpy" and r.get("system") == "memcpy" and r.get("variant") == "256M")
    return seen


def rdma_table(rows: Rows) -> List[List[str]]:
    out = []
    mib = lambda st: Stat([v * 1e9 / 2**20 for v in st.values])
    for op, block, _ in shapes(rows, "rdma"):
        if block == 8:
            continue
        ferry = mib(rows.stat("gbps", suite="rdma", system="ferry", op=op, block=block))
        ref = mib(rows.stat("gbps", suite="rdma", system="perftest", op=op, block=block))
        out.append([f"{op} {size(block)}", "MiB/s", rows.cell(ferry), rows.cell(ref), ratio(ferry, ref)])
    for op in ("write", "read"):
        ferry = rows.stat("lat_p50_us", suite="rdma", system="ferry", op=op, block=8)
        ref = rows.stat("lat_rtt_us", suite="rdma", system="perftest", op=op, block=8)
        if ferry or ref:
            out.append([f"8-byte {op}, p50 against perftest's round trip", "µs", rows.cell(ferry), rows.cell(ref),
                        ratio(ferry, ref, time=True)])
    return out


# ---------------------------------------------------------------- plots

def bandwidth_series(rows: Rows, op: str) -> Tuple[Dict[str, List[Tuple[int, Stat]]], Dict[str, Stat]]:
    def pts(**want) -> List[Tuple[int, Stat]]:
        blocks = sorted({r["block"] for r in rows.select(**want) if r.get("gbps") is not None})
        return [(b, rows.stat("gbps", block=b, **want)) for b in blocks]

    series = {
        "ferry TCP, submit": pts(suite="tcp-bw", system="ferry", variant="submit", op=op),
        "ferry TCP, prepared": pts(suite="tcp-bw", system="ferry", variant="prepared", op=op),
        "NIXL TCP": pts(suite="tcp-bw", system="nixl", op=op),
        "Mooncake TCP": pts(suite="tcp-bw", system="mooncake", op=op),
        "ferry memory, prepared": pts(suite="mem-bw", system="ferry", op=op),
        "NIXL shm": pts(suite="mem-bw", system="nixl", op=op),
        "memcpy (physical)": pts(suite="memcpy", system="memcpy", variant="256M"),
    }
    return series, {"tcp-mover (physical)": mover(rows), "iperf3 (context)": iperf3(rows, op)}


def latency_bars(rows: Rows) -> List[Tuple[str, Stat, Stat]]:
    bars = []
    names = {("ferry", None): "ferry", ("nixl", None): "NIXL", ("mooncake", None): "Mooncake",
             ("tcp-mover", "spin"): "tcp-mover RTT, polling", ("tcp-mover", "blocking"): "tcp-mover RTT, blocking",
             ("sockperf", None): "sockperf RTT (context)"}
    for transport in ("tcp", "memory"):
        for (system, variant), name in names.items():
            want = dict(suite="lat", transport=transport, system=system)
            if variant:
                want["variant"] = variant
            if rows.select(**want):
                bars.append((f"{transport} · {name}", rows.stat("lat_p50_us", **want), rows.stat("lat_p99_us", **want)))
    for op in ("write", "read"):
        f = dict(suite="rdma", system="ferry", op=op, block=8)
        p = dict(suite="rdma", system="perftest", op=op, block=8)
        if rows.select(**f):
            bars.append((f"soft-RoCE {op} · ferry", rows.stat("lat_p50_us", **f), rows.stat("lat_p99_us", **f)))
        if rows.select(**p):
            bars.append((f"soft-RoCE {op} · perftest RTT", rows.stat("lat_rtt_us", **p),
                         rows.stat("lat_rtt_p99_us", **p)))
    return bars


def rdma_series(rows: Rows) -> Dict[str, List[Tuple[int, Stat]]]:
    out = {}
    for system, name in (("ferry", "ferry ibverbs"), ("perftest", "perftest (physical)")):
        for op in ("write", "read"):
            blocks = sorted({r["block"] for r in rows.select(suite="rdma", system=system, op=op)
                             if r.get("gbps") is not None})
            key = f"{name} {op}" if system == "ferry" else f"perftest {op} (physical)"
            PALETTE.setdefault(key, (("#1f5fbf" if op == "write" else "#4f9be8") if system == "ferry" else
                                     "#555555", "" if system == "ferry" else ("6,4" if op == "write" else "2,3")))
            out[key] = [(b, rows.stat("gbps", suite="rdma", system=system, op=op, block=b)) for b in blocks]
    return out


# ---------------------------------------------------------------- page


def versions(rows: Rows, meta: dict) -> str:
    parts = []
    nixl = rows.first("version", system="nixl")
    if nixl:
        ucx = rows.first("ucx", system="nixl")
        parts.append(f"NIXL {nixl} (PyPI `nixl`, its bundled UCX {ucx or '?'})")
    moon = rows.first("version", system="mooncake")
    if moon:
        parts.append(f"Mooncake Transfer Engine {moon}")
    for key, name in (("iperf3", "iperf3"), ("sockperf", "sockperf"), ("ucx_perftest", "ucx_perftest (Debian's UCX)")):
        if meta.get(f"version_{key}"):
            parts.append(f"{name} {meta[f'version_{key}']}")
    if meta.get("version_rustc"):
        parts.append(meta["version_rustc"])
    return "; ".join(parts) or "—"


def duration(meta: dict) -> str:
    try:
        seconds = int(meta["finished"]) - int(meta["started"])
    except (KeyError, ValueError):
        return "unknown"
    return f"{seconds // 60} min {seconds % 60} s" if seconds >= 60 else f"{seconds} s"


def section(lines: List[str], title: str, intro: str, rows: Rows, body: List[List[str]], suites: Sequence[str],
            align: Sequence[str], missing: str, cmds: Optional[List[str]] = None) -> None:
    lines += [f"## {title}", "", intro, ""]
    header = HEADERS[title]
    if not body:
        body = [[f"not measured in this run: {missing}"] + ["—"] * (len(header) - 1)]
    lines += table(header, body, align)
    if cmds is None:
        cmds = [c for s in suites for c in rows.commands(s)]
    if cmds:
        lines += ["", "Commands, each run once a round:", "", "```sh", *cmds, "```"]
    lines.append("")


def render_page(rows: Rows, meta: dict, run_dir: Path, plots: List[str]) -> str:
    m = meta.get("machine", {})
    rounds = rows.rounds
    smoke = meta.get("smoke") == "1"
    run_rel = os.path.relpath(run_dir, REPO) if str(run_dir).startswith(str(REPO)) else str(run_dir)
    lines = [
        "# Performance",
        "",
        "<!-- Generated by scripts/perf-page.sh (rendered by scripts/perf_page.py): do not edit by hand. -->",
        "",
        "What ferry's transfers cost on one machine, side by side with NIXL and Mooncake and with what the",
        "hardware and kernel do alone when they do ferry's work (`scripts/tcp-mover.c` over loopback TCP, a",
        "one-thread `memcpy`, UCX's `ucx_perftest`, perftest on soft-RoCE; iperf3 and sockperf as context),",
        "every system measured in the same run, in interleaved rounds. Every number here comes from that run:",
        "to regenerate this page, the plots in `docs/perf/` and the README's headline table, run",
        "`scripts/perf-page.sh` (add `--rdma` for the soft-RoCE VM) on an idle machine;",
        "`python3 scripts/perf_page.py render RUN_DIR` re-renders a run's rows without measuring. NIXL and",
        "Mooncake are measured by this repository's own programs, `bench/peers/nixl_bench.py` and",
        "`bench/peers/mooncake_bench.py` (the workloads and row fields of `ferry bench`), in venvs that",
        "`bench/peers/setup.sh` makes from PyPI (under `~/.cache/ferry-peers`); a full run makes them when",
        "they are missing, and `--smoke` skips a peer whose venv is missing.",
        "",
        "## This run",
        "",
    ]
    if smoke:
        lines += ["**Smoke run**: one short round of a subset of the cells, to check the script; "
                  "these numbers are not measurements.", ""]
    lines += [
        f"- commit: `{meta.get('commit', 'unknown')}`",
        f"- date: {meta.get('date', 'unknown')}; the run took {duration(meta)}",
        f"- machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('memory', '?')} memory, "
        f"Linux {m.get('kernel', '?')}; load average at the start {m.get('load', '?')}",
        f"- command: `{meta.get('command', 'scripts/perf-page.sh')}`: {rounds} round{'s' if rounds != 1 else ''}, "
        f"{meta.get('seconds', '?')} s per measurement",
        f"- versions: {versions(rows, meta)}",
        f"- rows: `{run_rel}/rows.jsonl` ({len(rows.rows)} measurements)",
        "",
        "Each cell is the median over the rounds, with the lowest and highest round in brackets. Ratios are",
        "of medians and read the same way everywhere: above 1, ferry is ahead. For GB/s that is ferry's",
        "figure over the other's; for times (marked \"time\") the other's over ferry's. The best peer is the",
        "faster of NIXL and Mooncake in that cell; \"physical\" is the reference named in the column, which",
        "does ferry's work with no protocol: the bound to hold ferry to. \"context\" columns (iperf3,",
        "sockperf) are what those tools report; they do other work and bound nothing. GB/s is 10⁹ bytes per",
        "second. \"—\": not measured in this run.",
        "",
        "## Plots",
        "",
    ]
    for name in plots:
        lines += [f"![{name[:-4]}]({PLOTS}/{name})", ""]

    section(lines, TCP_BW,
            "One request in flight against a 256 MiB region over 127.0.0.1: ferry's one-shot submits and its "
            "transfer requests on prepared lists (`--prepared --strided`), against one long-lived `ferry serve` "
            "with the same-host path off; NIXL with UCX's tcp transport; Mooncake's TCP transport. Physical: "
            "`tcp-mover bw`, four sender processes (ferry's four connections), each with a receiver process of "
            "its own, sweeping its share of 256 MiB in 1 MiB `send()` and `recv()` calls: the work ferry's "
            "connections do, with no protocol. 1 MiB in every cell because ferry's TCP moves any request in "
            "pieces of at most its chunk size, 1 MiB: runs of adjacent 4 or 64 KiB ops are gathered into one, "
            "16 MiB ops cut into 16. The mover moves bytes one way, so its figure stands for writes and reads "
            "alike. Context: iperf3 with as many TCP connections (the faster of one `iperf3 -P 4` and four "
            "single-stream processes; `read` beside `iperf3 -R`), which sends one cache-hot buffer again and "
            "again and so moves more than a sweep of 256 MiB can. GB/s.",
            rows, tcp_bw_table(rows), ["tcp-bw"], ["---", "---"] + ["---:"] * 10,
            "the TCP suite did not run")
    section(lines, LAT,
            "One 8-byte write per request, µs. TCP: against the same `ferry serve`. Physical: `tcp-mover "
            "pingpong 8`, one process per side sending 8 bytes and answering them over one connection "
            "(`TCP_NODELAY`), the median round trip (a write completes when the target acknowledges it): "
            "polling, receiving in a `MSG_DONTWAIT` loop as ferry's TCP connections busy-poll, which is the "
            "bound; and blocking in `recv()`, which pays a thread wake-up per message (the mover reports "
            "medians only: no p99). Context: sockperf's ping-pong round trip (`--full-rtt`) with its "
            "smallest message, 14 bytes. memory: ferry's same-host transport and NIXL over shared memory; "
            "no physical reference.",
            rows, lat_table(rows), ["lat"], ["---", "---"] + ["---:"] * 8, "the latency suite did not run")
    section(lines, MEM_BW,
            "Same host, two processes, the bandwidth workload of the TCP table: ferry's memory transport "
            "(`--loopback --transport memory --prepared --strided`) against NIXL over shared memory (UCX "
            "posix and cma), and a one-thread `memcpy` of the same block size sweeping a 256 MiB buffer. "
            "Mooncake has no same-host transport here. GB/s.",
            rows, mem_bw_table(rows), ["mem-bw", "memcpy"], ["---", "---"] + ["---:"] * 5,
            "the same-host suite did not run")
    section(lines, MEM_UCX,
            "`ucx_perftest -t ucp_put_bw` (UCX as Debian ships it, the engine under NIXL) puts one buffer of "
            "the block size again and again, which stays in cache at 1 MiB; ferry is measured both that way "
            "(a region of one block, beside a `memcpy` within one block) and sweeping a 256 MiB region, beside "
            "a `memcpy` sweeping 256 MiB. Writes, GB/s.",
            rows, mem_ucx_table(rows), ["mem-ucx", "memcpy"], ["---"] + ["---:"] * 10, "the same-host suite did not run")
    section(lines, NIXL_API,
            "ferry as a NIXL backend (`--backend FERRY`: its plugin, `libplugin_FERRY.so`, installed into "
            "NIXL's venv) against NIXL's own UCX backend, measured by the same program, "
            "`bench/peers/nixl_bench.py`, on the same workloads in the same run: one request in flight, each "
            "made per iteration from descriptor lists prepared once (`make_prepped_xfer`, as vLLM makes "
            "them). TCP: UCX's tcp transport against ferry's TCP (the plugin's `transports=tcp`); same host: "
            "UCX's posix and cma against ferry's memory transport (`transports=memory`). NIXL's memory is the "
            "caller's, not allocated by ferry, so ferry copies it with `process_vm_writev`, not through a "
            "shared mapping as with its own API. ferry's own API: its prepared requests in the tables above "
            "(`ferry prepared` over TCP, ferry memory on the same host, ferry's lines of the latency table); "
            "physical: `tcp-mover` (TCP bandwidth: four process pairs in 1 MiB calls; TCP latency: the "
            "polling 8-byte round trip), a one-thread `memcpy` sweeping 256 MiB (same host). GB/s; latency "
            "in µs, its ratios of times (\"(time)\").",
            rows, nixl_api_table(rows), [], ["---", "---"] + ["---:"] * 7,
            "needs NIXL's venv (`bench/peers/setup.sh nixl`)", nixl_api_commands(rows))
    section(lines, RDMA,
            "ferry over ibverbs (`ferry bench --loopback --transport ibverbs`, two processes) against "
            "perftest's `ib_write_bw`, `ib_read_bw`, `ib_write_lat` and `ib_read_lat` in the same boot of the "
            "soft-RoCE VM (tests/rxe/run.sh), which runs under emulation: absolute figures mean little, the "
            "ratios are the result. NIXL and Mooncake do not run in the VM. A submit completes when the "
            "target acknowledges it, so its p50 is set against perftest's round trip (twice `ib_write_lat`'s "
            "one-way figure; `ib_read_lat`'s own).",
            rows, rdma_table(rows), ["rdma"], ["---", "---", "---:", "---:", "---:"],
            "run `scripts/perf-page.sh --rdma`")

    if rows.failed:
        lines += ["## Failures", "", "These commands failed in this run; their cells are missing above.", "",
                  "```text"]
        for r in rows.failed:
            lines.append(f"round {r.get('round', '?')}: {r.get('cmd', r.get('system', '?'))}")
        lines += ["```", ""]
    skipped = [v for k, v in sorted(meta.items()) if k.startswith("skipped_")]
    if skipped:
        lines += ["## Skipped", ""] + [f"- {s}" for s in skipped] + [""]
    return "\n".join(lines).rstrip() + "\n"


def headline(rows: Rows, meta: dict) -> List[str]:
    """The README's rows: a handful of cells, each with its ratios."""
    nixl_v = rows.first("version", system="nixl")
    moon_v = rows.first("version", system="mooncake")
    ucx_v = (meta.get("version_ucx_perftest") or "").split("-")[0]  # no Debian revision
    header = ["workload", "ferry", f"NIXL {nixl_v}" if nixl_v else "NIXL",
              f"Mooncake TE {moon_v}" if moon_v else "Mooncake TE", f"UCX {ucx_v}" if ucx_v else "UCX",
              "ferry ÷ best other", "ferry ÷ physical"]
    med = lambda st: num(st.median) if st else "—"
    body = []
    for op, block, batch, plural in (("write", 1 << 20, 64, "writes"), ("read", 1 << 20, 64, "reads"),
                                     ("write", 4096, 1024, "writes")):
        want = dict(suite="tcp-bw", op=op, block=block)
        ferry = rows.stat("gbps", system="ferry", variant="prepared", **want)
        nixl = rows.stat("gbps", system="nixl", **want)
        moon = rows.stat("gbps", system="mooncake", **want)
        ref = mover(rows)
        if ferry:
            body.append([f"TCP, {size(block)} × {batch:,} {plural}, prepared, GB/s", med(ferry), med(nixl), med(moon),
                         "—", ratio(ferry, best([nixl, moon])), labelled(ratio(ferry, ref), "tcp-mover")])
    for transport, name, ferry, nixl, moon, phys, _, _ in latency_cells(rows):
        if transport == "tcp" and name.startswith("p50") and ferry:
            body.append(["TCP, 8-byte write p50, µs", med(ferry), med(nixl), med(moon), "—",
                         labelled(ratio(ferry, best([nixl, moon], lower=True), time=True), "time"),
                         labelled(ratio(ferry, phys, time=True), "time, tcp-mover")])
    want = dict(suite="mem-bw", op="write", block=4096)
    ferry = rows.stat("gbps", system="ferry", **want)
    if ferry:
        nixl = rows.stat("gbps", system="nixl", **want)
        cpy = rows.stat("gbps", suite="memcpy", system="memcpy", variant="256M", block=4096)
        body.append(["same host, 4 KiB × 1,024 prepared writes, GB/s", med(ferry), med(nixl), "—", "—",
                     ratio(ferry, nixl), labelled(ratio(ferry, cpy), "memcpy")])
    blocks = sorted({r["block"] for r in rows.select(suite="mem-ucx", system="ferry")})
    if blocks:
        block = blocks[-1]
        ferry = rows.stat("gbps", suite="mem-ucx", system="ferry", variant="one-block", block=block)
        ucx = rows.stat("gbps", suite="mem-ucx", system="ucx", variant="posix,cma", block=block)
        cpy = rows.stat("gbps", suite="memcpy", system="memcpy", variant="one-block", block=block)
        body.append([f"same host, {size(block)} puts (one-block region), GB/s", med(ferry), "—", "—", med(ucx),
                     ratio(ferry, ucx), labelled(ratio(ferry, cpy), "memcpy")])
    # Through NIXL's API: ferry's plugin in the ferry column, NIXL's UCX
    # backend in NIXL's, both driven by bench/peers/nixl_bench.py.
    for suite, where, block, batch in (("tcp-bw", "TCP", 1 << 20, 64), ("mem-bw", "same host", 4096, 1024)):
        want = dict(suite=suite, op="write", block=block)
        ferry = rows.stat("gbps", system=NIXL_FERRY, **want)
        if not ferry:
            continue
        nixl = rows.stat("gbps", system="nixl", **want)
        if suite == "tcp-bw":
            phys = labelled(ratio(ferry, mover(rows)), "tcp-mover")
        else:
            cpy = rows.stat("gbps", suite="memcpy", system="memcpy", variant="256M", block=block)
            phys = labelled(ratio(ferry, cpy), "memcpy")
        body.append([f"through NIXL, {where}, {size(block)} × {batch:,} writes, GB/s",
                     med(ferry), med(nixl), "—", "—", ratio(ferry, nixl), phys])
    n = rows.rounds
    caption = (f"Loopback and same host, one request in flight: medians of {n} round{'s' if n != 1 else ''} of "
               f"`{meta.get('command', '?')}` at commit `{meta.get('commit', '?')}`, {meta.get('date', '?')}; "
               "every row's systems were measured in the same run.")
    note = ("Above 1, ferry is ahead (\"(time)\": the other's time over ferry's); \"physical\": ferry's work "
            "done with no protocol: loopback TCP by scripts/tcp-mover.c (process pairs sweeping 256 MiB in 1 MiB "
            "calls; an 8-byte ping-pong, polling), or a one-thread memcpy; \"—\": not measured.")
    if any(r[0].startswith("through NIXL") for r in body):
        note += (" \"Through NIXL\": the NIXL benchmark on ferry's NIXL backend (in the ferry column) and "
                 "on NIXL's UCX backend (in NIXL's).")
    return (textwrap.wrap(caption, 76, break_on_hyphens=False) + [""]
            + table(header, body, ["---"] + ["---:"] * 6) + [""]
            + textwrap.wrap(note, 76, break_on_hyphens=False))


def update_readme(readme: Path, block: List[str]) -> bool:
    """Rewrites only the lines between the markers; False when they are missing."""
    text = readme.read_text(encoding="utf-8")
    lines = text.split("\n")
    begins = [i for i, line in enumerate(lines) if line.strip() == PERF_BEGIN]
    ends = [i for i, line in enumerate(lines) if line.strip() == PERF_END]
    if len(begins) != 1 or len(ends) != 1 or begins[0] > ends[0]:
        return False
    new = lines[: begins[0] + 1] + block + lines[ends[0]:]
    if new != lines:
        readme.write_text("\n".join(new), encoding="utf-8")
    return True


def cmd_render(run_dir: Path, out_dir: Path, readme: Optional[Path], headline_file: Optional[Path]) -> int:
    meta = json.loads((run_dir / "meta.json").read_text())
    all_rows = [json.loads(line) for line in (run_dir / "rows.jsonl").read_text().splitlines() if line.strip()]
    rows = Rows(all_rows, int(meta.get("rounds", 1)))
    plot_dir = out_dir / PLOTS
    plot_dir.mkdir(parents=True, exist_ok=True)
    plots: Dict[str, str] = {}
    for op in ("write", "read"):
        series, flat = bandwidth_series(rows, op)
        plots[f"bandwidth-{op}.svg"] = line_plot(f"{op.capitalize()}s: GB/s against block size, one request in flight",
                                                 series, flat, "GB/s (10⁹ B/s)")
    plots["latency.svg"] = latency_plot("8-byte write latency (read too on soft-RoCE)", latency_bars(rows))
    if rows.select(suite="rdma"):
        plots["rdma.svg"] = line_plot("soft-RoCE (emulated): MiB/s against block size", rdma_series(rows), {},
                                      "MiB/s (2²⁰ B/s)", scale=1e9 / 2**20)
    for stale in plot_dir.glob("*.svg"):
        if stale.name not in plots:
            stale.unlink()
    for name, svg in plots.items():
        (plot_dir / name).write_text(svg, encoding="utf-8")
    (out_dir / PAGE).write_text(render_page(rows, meta, run_dir, list(plots)), encoding="utf-8")
    block = headline(rows, meta)
    if headline_file:
        headline_file.write_text("\n".join([PERF_BEGIN] + block + [PERF_END]) + "\n", encoding="utf-8")
    if readme:
        if update_readme(readme, block):
            print(f"perf_page: README headline table rewritten in {readme}", file=sys.stderr)
        else:
            print(f"perf_page: note: {readme} has no single {PERF_BEGIN} ... {PERF_END} pair; left it alone",
                  file=sys.stderr)
    print(f"perf_page: wrote {out_dir / PAGE} and {len(plots)} plot(s) in {plot_dir}", file=sys.stderr)
    return cmd_check(out_dir)


# ---------------------------------------------------------------- check


def cmd_check(out_dir: Path) -> int:
    problems = []
    page = out_dir / PAGE
    text = page.read_text(encoding="utf-8") if page.is_file() else ""
    if not text:
        problems.append(f"{page}: missing or empty")
    for title, header in HEADERS.items():
        if f"\n## {title}\n" not in text:
            problems.append(f"{page}: no heading '## {title}'")
        if "| " + " | ".join(header) + " |" not in text:
            problems.append(f"{page}: no header row for '{title}'")
    linked = re.findall(r"!\[[^\]]*\]\(([^)]+\.svg)\)", text)
    for name in REQUIRED_PLOTS:
        if f"{PLOTS}/{name}" not in linked:
            problems.append(f"{page}: does not show {PLOTS}/{name}")
    for target in linked:
        path = out_dir / target
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as e:
            problems.append(f"{path}: {e}")
            continue
        if root.tag != "{http://www.w3.org/2000/svg}svg" or not root.get("viewBox"):
            problems.append(f"{path}: not an <svg> with a viewBox")
        if not any(el.get("class") == "series" for el in root.iter()):
            problems.append(f"{path}: no measurement drawn")
    if re.search(r"\bnan\b|\binf\b", text, re.I):
        problems.append(f"{page}: a NaN or infinity in the page")
    for p in problems:
        print(f"perf_page check: {p}", file=sys.stderr)
    if not problems:
        print(f"perf_page check: ok: {page}, {len(linked)} plot(s), {len(HEADERS)} tables", file=sys.stderr)
    return 1 if problems else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("meta")
    p.add_argument("run_dir", type=Path)
    p.add_argument("pairs", nargs="*")
    p = sub.add_parser("set")
    p.add_argument("run_dir", type=Path)
    p.add_argument("pairs", nargs="*")
    p = sub.add_parser("ingest")
    p.add_argument("kind", choices=["json", "gbps", "p50", "sockperf", "ucx", "rxe", "failed", "note"])
    p.add_argument("rows", type=Path)
    p.add_argument("pairs", nargs="*")
    p = sub.add_parser("render")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--out", type=Path, default=REPO / "docs")
    p.add_argument("--readme", type=Path, help="rewrite the table between the perf markers of this file")
    p.add_argument("--headline", type=Path, help="write the README's table (with its markers) to this file")
    p = sub.add_parser("check")
    p.add_argument("out", type=Path)
    a = ap.parse_args()
    if a.what == "meta":
        cmd_meta(a.run_dir, a.pairs)
        return 0
    if a.what == "set":
        path = a.run_dir / "meta.json"
        meta = json.loads(path.read_text())
        meta.update(p.partition("=")[::2] for p in a.pairs)
        path.write_text(json.dumps(meta, indent=1) + "\n")
        return 0
    if a.what == "ingest":
        return cmd_ingest(a.kind, a.rows, a.pairs)
    if a.what == "render":
        return cmd_render(a.run_dir, a.out, a.readme, a.headline)
    return cmd_check(a.out)


if __name__ == "__main__":
    sys.exit(main())
