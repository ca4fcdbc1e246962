"""Figures and SVG drawing for the performance page (scripts/perf_page.py).

A cell's figures over the rounds (Stat), how numbers and sizes are written,
and the two kinds of plot the page has: lines over block sizes with each
round's spread, and latency bars on a log scale. Python 3 standard library
only; knows nothing of rows or suites.
"""

from __future__ import annotations

import math
import statistics
from typing import Dict, List, Sequence, Tuple
from xml.sax.saxutils import escape


class Stat:
    """The figures of one cell over the rounds."""

    def __init__(self, values: Sequence[float]):
        self.values = sorted(values)

    def __bool__(self) -> bool:
        return bool(self.values)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def lo(self) -> float:
        return self.values[0]

    @property
    def hi(self) -> float:
        return self.values[-1]


def num(x: float) -> str:
    if x != x:
        return "—"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    if abs(x) >= 0.01:
        return f"{x:.3f}"
    return f"{x:.3g}"


def size(b: int) -> str:
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift} {unit}"
    return f"{b} B"


def short_size(b: float) -> str:
    b = int(round(b))
    for shift, unit in ((30, "G"), (20, "M"), (10, "K")):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift}{unit}"
    return f"{b}"


PALETTE = {
    "ferry TCP, submit": ("#1f5fbf", ""),
    "ferry TCP, prepared": ("#4f9be8", ""),
    "NIXL TCP": ("#e07b00", ""),
    "Mooncake TCP": ("#2a9d3a", ""),
    "tcp-mover (physical)": ("#555555", "6,4"),
    "iperf3 (context)": ("#aaaaaa", "2,4"),
    "ferry memory, prepared": ("#7b2fbf", ""),
    "NIXL shm": ("#c0392b", ""),
    "memcpy (physical)": ("#111111", "2,3"),
    "ferry ibverbs": ("#1f5fbf", ""),
    "perftest (physical)": ("#555555", "6,4"),
}
W, H = 820, 460
LEFT, RIGHT, TOP, BOTTOM = 72, 230, 48, 64


def svg_open(title: str, height: int = H) -> List[str]:
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" viewBox="0 0 {W} {height}" '
        'font-family="sans-serif" font-size="12">',
        f"<title>{escape(title)}</title>",
        f'<rect x="0" y="0" width="{W}" height="{height}" fill="white"/>',
        f'<text x="{W / 2:.0f}" y="24" text-anchor="middle" font-size="15" font-weight="bold">{escape(title)}</text>',
    ]


def nice_max(x: float) -> Tuple[float, float]:
    """An axis top at or above x and its tick step."""
    if x <= 0:
        return 1.0, 0.2
    exp = 10 ** math.floor(math.log10(x))
    for m in (1, 2, 2.5, 5, 10):
        if x <= m * exp:
            top = m * exp
            break
    step = top / 5
    return top, step


def line_plot(title: str, series: Dict[str, List[Tuple[int, Stat]]], flat: Dict[str, Stat],
              ylabel: str, scale: float = 1.0) -> str:
    """GB/s (or SCALE times it) against block size, log x: one line per
    series, each point the median with its min–max as an error bar; FLAT
    series (no block size: tcp-mover, iperf3) as dashed horizontal lines."""
    blocks = sorted({b for pts in series.values() for b, st in pts if st})
    out = svg_open(title)
    x0, x1, y0, y1 = LEFT, W - RIGHT, H - BOTTOM, TOP
    if not blocks:
        out.append(f'<text x="{(x0 + x1) / 2:.0f}" y="{H / 2:.0f}" text-anchor="middle">not measured in this run</text>')
        out.append("</svg>")
        return "\n".join(out) + "\n"
    lo, hi = math.log2(blocks[0]) - 1, math.log2(blocks[-1]) + 1
    ymax = max([st.hi * scale for pts in series.values() for _, st in pts if st] +
               [st.hi * scale for st in flat.values() if st] + [1e-9])
    top, step = nice_max(ymax * 1.05)
    fx = lambda b: x0 + (math.log2(b) - lo) / (hi - lo) * (x1 - x0)
    fy = lambda v: y0 - v / top * (y0 - y1)
    # Axes, grid and ticks.
    out.append(f'<rect x="{x0}" y="{y1}" width="{x1 - x0}" height="{y0 - y1}" fill="none" stroke="#999"/>')
    tick = 0.0
    decimals = max(0, -math.floor(math.log10(step) + 1e-9)) if step % 1 else 0
    while tick <= top + step / 2:
        y = fy(tick)
        out.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x1}" y2="{y:.1f}" stroke="#e4e4e4"/>')
        out.append(f'<text x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end">{tick:,.{decimals}f}</text>')
        tick += step
    for b in blocks:
        x = fx(b)
        out.append(f'<line x1="{x:.1f}" y1="{y0}" x2="{x:.1f}" y2="{y1}" stroke="#e4e4e4"/>')
        out.append(f'<text x="{x:.1f}" y="{y0 + 16}" text-anchor="middle">{short_size(b)}</text>')
    out.append(f'<text x="{(x0 + x1) / 2:.0f}" y="{H - 18}" text-anchor="middle">block size (bytes, log scale)</text>')
    out.append(f'<text x="18" y="{(y0 + y1) / 2:.0f}" text-anchor="middle" '
               f'transform="rotate(-90 18 {(y0 + y1) / 2:.0f})">{escape(ylabel)}</text>')
    legend: List[Tuple[str, str, str]] = []
    for name, st in flat.items():
        if not st:
            continue
        color, dash = PALETTE.get(name, ("#777", "6,4"))
        y = fy(st.median * scale)
        out.append(f'<line class="series" x1="{x0}" y1="{y:.1f}" x2="{x1}" y2="{y:.1f}" stroke="{color}" stroke-width="1.5" '
                   f'stroke-dasharray="{dash or "6,4"}"><title>{escape(name)}: {num(st.median * scale)}</title></line>')
        legend.append((name, color, dash or "6,4"))
    for name, pts in series.items():
        pts = [(b, st) for b, st in pts if st]
        if not pts:
            continue
        color, dash = PALETTE.get(name, ("#777", ""))
        coords = " ".join(f"{fx(b):.1f},{fy(st.median * scale):.1f}" for b, st in pts)
        dashed = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<polyline class="series" points="{coords}" fill="none" stroke="{color}" stroke-width="2"{dashed}/>')
        for b, st in pts:
            x, y = fx(b), fy(st.median * scale)
            ylo, yhi = fy(st.lo * scale), fy(st.hi * scale)
            if yhi < ylo - 0.5:
                out.append(f'<path d="M{x:.1f},{ylo:.1f}V{yhi:.1f}M{x - 3:.1f},{ylo:.1f}h6M{x - 3:.1f},{yhi:.1f}h6" '
                           f'stroke="{color}" fill="none"/>')
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{color}">'
                       f'<title>{escape(name)}, {short_size(b)}: {num(st.median * scale)} '
                       f'({num(st.lo * scale)}–{num(st.hi * scale)})</title></circle>')
        legend.append((name, color, dash))
    lx, ly = x1 + 16, y1 + 6
    for i, (name, color, dash) in enumerate(legend):
        y = ly + i * 20
        dashed = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<line x1="{lx}" y1="{y}" x2="{lx + 26}" y2="{y}" stroke="{color}" stroke-width="2"{dashed}/>')
        out.append(f'<text x="{lx + 32}" y="{y + 4}">{escape(name)}</text>')
    y = ly + len(legend) * 20 + 10
    out.append(f'<text x="{lx}" y="{y}" fill="#555" font-size="11">points: medians; bars: min–max</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def latency_plot(title: str, bars: List[Tuple[str, Stat, Stat]]) -> str:
    """Horizontal bars, log x in µs: each bar the p50 median with its
    min–max, a diamond at the p99 median."""
    bars = [b for b in bars if b[1]]
    height = TOP + 10 + 26 * len(bars) + 6 + 70
    out = svg_open(title, height)
    x0, x1 = 24 + 7 * max([len(name) for name, _, _ in bars] + [10]), W - 40
    y0 = TOP + 10
    if not bars:
        out.append(f'<text x="{W / 2:.0f}" y="{height / 2:.0f}" text-anchor="middle">not measured in this run</text>')
        out.append("</svg>")
        return "\n".join(out) + "\n"
    values = [v for _, p50, p99 in bars for v in (p50.values + p99.values)]
    lo = math.floor(math.log10(max(min(values), 1e-3)))
    hi = math.ceil(math.log10(max(values)))
    if hi <= lo:
        hi = lo + 1
    fx = lambda v: x0 + (math.log10(max(v, 10 ** lo)) - lo) / (hi - lo) * (x1 - x0)
    yb = y0 + 26 * len(bars) + 6
    out.append(f'<rect x="{x0}" y="{y0}" width="{x1 - x0}" height="{yb - y0}" fill="none" stroke="#999"/>')
    for e in range(lo, hi + 1):
        x = fx(10 ** e)
        out.append(f'<line x1="{x:.1f}" y1="{y0}" x2="{x:.1f}" y2="{yb}" stroke="#e4e4e4"/>')
        out.append(f'<text x="{x:.1f}" y="{yb + 16}" text-anchor="middle">{10.0 ** e:,.{max(0, -e)}f}</text>')
    out.append(f'<text x="{(x0 + x1) / 2:.0f}" y="{yb + 36}" text-anchor="middle">µs, log scale</text>')
    for i, (name, p50, p99) in enumerate(bars):
        y = y0 + 8 + 26 * i
        color = "#1f5fbf" if name.split(" · ")[-1].startswith("ferry") else \
            "#aaaaaa" if "(context)" in name else "#555555" if "RTT" in name else "#e07b00"
        out.append(f'<text x="{x0 - 8}" y="{y + 13}" text-anchor="end">{escape(name)}</text>')
        w = fx(p50.median) - x0
        out.append(f'<rect class="series" x="{x0}" y="{y + 2}" width="{max(w, 1):.1f}" height="14" fill="{color}" opacity="0.8">'
                   f'<title>{escape(name)}: p50 {num(p50.median)} µs ({num(p50.lo)}–{num(p50.hi)})</title></rect>')
        if p50.hi > p50.lo:
            out.append(f'<path d="M{fx(p50.lo):.1f},{y + 9}H{fx(p50.hi):.1f}M{fx(p50.lo):.1f},{y + 4}v10'
                       f'M{fx(p50.hi):.1f},{y + 4}v10" stroke="black" fill="none"/>')
        if p99:
            x = fx(p99.median)
            out.append(f'<path d="M{x:.1f},{y + 3}l6,6l-6,6l-6,-6z" fill="white" stroke="black">'
                       f'<title>{escape(name)}: p99 {num(p99.median)} µs</title></path>')
    y = yb + 56
    out.append(f'<text x="{x0}" y="{y}" fill="#555" font-size="11">bars: p50 median, whiskers: its min–max '
               'over the rounds; ◇: p99 median; grey: physical (round trips), light grey: context</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
