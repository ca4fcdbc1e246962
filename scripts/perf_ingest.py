"""Rows for the performance page, from what each benchmark printed.

scripts/perf-page.sh pipes every tool's output through `perf_page.py
ingest`, which lands here: one JSON object per row in RUN_DIR/rows.jsonl,
tagged with the suite, system, round and command; and `perf_page.py meta`,
which writes RUN_DIR/meta.json (commit, date, machine, options). See
perf_page.py for the row fields.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Sequence

REPO = Path(__file__).resolve().parent.parent
# The page and its plots, under docs/: a run's tree counts as clean without them.
PAGE = "performance.md"
PLOTS = "perf"


# ---------------------------------------------------------------- meta


def sh(*args: str) -> str:
    try:
        return subprocess.run(args, cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def machine() -> Dict[str, str]:
    """The machine, from /proc."""
    info: Dict[str, str] = {}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        models = re.findall(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
        info["cpu"] = models[0].strip() if models else platform.processor() or "unknown"
        info["cores"] = str(len(re.findall(r"^processor\s*:", cpuinfo, re.M)) or os.cpu_count())
    except OSError:
        info["cpu"], info["cores"] = "unknown", str(os.cpu_count())
    try:
        kib = int(re.search(r"^MemTotal:\s*(\d+)", Path("/proc/meminfo").read_text(), re.M).group(1))
        info["memory"] = f"{kib / 2**20:.1f} GiB"
    except (OSError, AttributeError):
        info["memory"] = "unknown"
    try:
        info["kernel"] = Path("/proc/sys/kernel/osrelease").read_text().strip()
    except OSError:
        info["kernel"] = platform.release()
    try:
        info["load"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        info["load"] = "unknown"
    return info


def cmd_meta(run_dir: Path, pairs: Sequence[str]) -> None:
    # The script's own outputs do not make the tree dirty: a rerun rewrites them.
    status = sh("git", "status", "--porcelain", "--", ".", f":!docs/{PAGE}", f":!docs/{PLOTS}",
                ":!README.md")
    commit = sh("git", "rev-parse", "--short", "HEAD") or "unknown"
    meta = {
        "commit": commit + ("+dirty" if status else ""),
        "date": sh("date", "-u", "+%Y-%m-%d %H:%M UTC"),
        "started": sh("date", "+%s"),
        "machine": machine(),
    }
    for pair in pairs:
        key, _, value = pair.partition("=")
        meta[key] = value
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


# ---------------------------------------------------------------- ingest

NUMERIC = ("block", "batch", "round")


def tags(pairs: Sequence[str]) -> Dict[str, object]:
    out: Dict[str, object] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        out[key] = int(value) if key in NUMERIC and value else value
    return out


def from_json_rows(text: str) -> Iterable[dict]:
    """Rows of `ferry bench --json` and of the peers' bench.py (same fields)."""
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        raw = json.loads(line)
        if "gbps" not in raw:
            continue
        row = {k: raw[k] for k in ("gbps", "mops", "lat_p50_us", "lat_p99_us", "block", "batch", "op",
                                   "workload", "version", "ucx", "verified", "streams")
               if k in raw}
        row["raw_transport"] = raw.get("transport")
        yield row


def from_numbers(text: str) -> Iterable[dict]:
    """A bare GB/s figure per line (memcpy, tcp-mover bw, the summed iperf3 runs)."""
    for line in text.split():
        yield {"gbps": float(line)}


def from_median_us(text: str) -> Iterable[dict]:
    """A bare median in µs per line (tcp-mover pingpong's round trip)."""
    for line in text.split():
        yield {"lat_p50_us": float(line)}


def from_sockperf(text: str) -> Iterable[dict]:
    p50 = re.search(r"percentile 50\.000 =\s*([0-9.]+)", text)
    p99 = re.search(r"percentile 99\.000 =\s*([0-9.]+)", text)
    if p50 and p99:
        yield {"lat_p50_us": float(p50.group(1)), "lat_p99_us": float(p99.group(1))}


def from_ucx_perftest(text: str) -> Iterable[dict]:
    # "Final: iters p50 avg overall bw_avg bw_overall rate_avg rate_overall";
    # its MB/s are 2^20 B/s. The overall bandwidth, as bench-memory-vs-ucx.sh.
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["Final:"] and len(words) >= 7:
            yield {"gbps": float(words[6]) * 2**20 / 1e9}


def from_rxe_console(text: str, base: dict) -> Iterable[dict]:
    """The soft-RoCE VM's console: PERFPAGE-ROUND/-CMD markers, `ferry bench
    --json` rows and rxe-pair's PERF lines, in the order they ran."""
    current = dict(base)
    for line in text.splitlines():
        if line.startswith("PERFPAGE-ROUND "):
            current["round"] = int(line.split()[1])
        elif line.startswith("PERFPAGE-CMD "):
            current["cmd"] = line[len("PERFPAGE-CMD "):].strip()
        elif line.startswith("PERFPAGE-FAILED "):
            yield dict(current, failed=True, system=line.split()[1] if len(line.split()) > 1 else "?")
        elif line.startswith("PERF "):
            kv = dict(w.split("=", 1) for w in line.split()[1:] if "=" in w)
            tool = kv.get("tool", "")
            row = dict(current, system="perftest", variant=tool, block=int(kv.get("bytes", 0)),
                       op="read" if "_read_" in tool else "write")
            if tool.endswith("_bw"):
                row["gbps"] = float(kv["bw_avg_MiBps"]) * 2**20 / 1e9
                row["mops"] = float(kv["msg_rate_Mpps"])
            else:
                typical = float(kv["t_typical_us"])
                row["lat_p50_us"] = typical
                row["lat_p99_us"] = float(kv["p99_us"])
                # ib_write_lat reports one way (half its ping-pong); a ferry
                # submit completes when acknowledged, one round trip.
                # ib_read_lat's figure is the read's round trip.
                row["lat_rtt_us"] = 2 * typical if tool == "ib_write_lat" else typical
                row["lat_rtt_p99_us"] = 2 * row["lat_p99_us"] if tool == "ib_write_lat" else row["lat_p99_us"]
            yield row
        elif line.startswith("{"):
            try:
                found = list(from_json_rows(line))
            except json.JSONDecodeError:
                continue
            for row in found:
                yield dict(current, system="ferry", variant="submit", **row)


def cmd_ingest(kind: str, rows_path: Path, pairs: Sequence[str]) -> int:
    base = tags(pairs)
    text = sys.stdin.read()
    if kind == "failed":
        found: List[dict] = [dict(base, failed=True)]
    elif kind == "note":
        found = [dict(base, note=True)]
    elif kind == "rxe":
        found = list(from_rxe_console(text, base))
    else:
        parse = {"json": from_json_rows, "gbps": from_numbers, "p50": from_median_us, "sockperf": from_sockperf,
                 "ucx": from_ucx_perftest}[kind]
        # What the tool printed (block, batch, op) wins over a tag's guess.
        found = [{**base, **parsed} for parsed in parse(text)]
    with open(rows_path, "a") as out:
        for row in found:
            out.write(json.dumps(row, sort_keys=True) + "\n")
    if kind not in ("failed", "note") and not any("failed" not in r for r in found):
        print(f"perf_page: no {kind} row in the output", file=sys.stderr)
        return 1
    return 0
