#!/usr/bin/env python3
"""Checks the user documentation: README.md, CONTRIBUTING.md, CHANGELOG.md
and docs/*.md. Exits 1, listing every problem, when

  - README.md is longer than 200 lines (the guide in docs/ takes the rest);
  - README.md lacks one `<!-- perf:begin -->` before one `<!-- perf:end -->`
    (scripts/perf-page.sh rewrites the table between them);
  - a relative link points at a file or directory that does not exist, or at
    a `#anchor` that no heading of the target page makes (GitHub's slugs);
  - a page of docs/ is not linked from the guide's index, docs/README.md;
  - a page with ```rust blocks is not compiled by src/doctests.rs, or a page
    that is has a code fence without a language (rustdoc would take it for
    Rust);
  - a guide page other than the generated docs/performance.md has a table
    of measurements (GB/s, MiB/s, Mops, p50/p99 in a table row) or a
    per-boot or per-run log ("this boot", "run 2:").

Python 3 standard library only; run from anywhere:
    python3 scripts/check-docs.py
"""

from __future__ import annotations

import re
import sys
import unicodedata
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

REPO = Path(__file__).resolve().parent.parent
README_MAX_LINES = 200
PERF_BEGIN = "<!-- perf:begin -->"
PERF_END = "<!-- perf:end -->"

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$")
HTML_ANCHOR = re.compile(r"""<a\s[^>]*\b(?:id|name)\s*=\s*["']([^"']+)["']""", re.I)
# An inline link or image: [text](target "title"). Nested brackets in the
# text are rare in these pages; the target is what matters.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
INCLUDE = re.compile(r'include_str!\(\s*"\.\./([^"]+)"\s*\)')


def pages() -> List[Path]:
    """Every page whose links are checked."""
    found = [REPO / name for name in ("README.md", "CONTRIBUTING.md", "CHANGELOG.md")]
    found += sorted((REPO / "docs").glob("*.md"))
    return [p for p in found if p.is_file()]


def rel(path: Path) -> str:
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def prose_lines(text: str) -> Iterator[Tuple[int, str]]:
    """(line number, line) for every line outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence is None:
            if match:
                fence = match.group(1)
                continue
            yield number, line
        elif match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) \
                and not match.group(2).strip():
            fence = None


def fences(text: str) -> Iterator[Tuple[int, str]]:
    """(line number, info string) of every opening code fence."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if not match:
            continue
        if fence is None:
            fence = match.group(1)
            yield number, match.group(2).strip()
        elif match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) \
                and not match.group(2).strip():
            fence = None


def plain(heading: str) -> str:
    """A heading's text as GitHub renders it, markup removed."""
    text = CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"(\*\*|__|\*|_)(?=\S)(.+?)(?<=\S)\1", r"\2", text)  # emphasis
    return text


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case; every character that is
    not a letter, mark, number, connector (`_`), space or hyphen dropped;
    spaces turned into hyphens."""
    kept = []
    for char in plain(heading).strip().lower():
        category = unicodedata.category(char)
        if char in " -" or category[0] in "LMN" or category == "Pc":
            kept.append("-" if char == " " else char)
    return "".join(kept)


def anchors(path: Path, cache: Dict[Path, Set[str]]) -> Set[str]:
    """Every anchor a page defines: its headings' slugs (repeats numbered
    as GitHub numbers them) and explicit <a id/name> anchors."""
    if path not in cache:
        found: Set[str] = set()
        seen: Dict[str, int] = {}
        text = path.read_text(encoding="utf-8")
        for _, line in prose_lines(text):
            match = HEADING.match(line)
            if match:
                base = slug(match.group(2))
                count = seen.get(base, 0)
                seen[base] = count + 1
                found.add(base if count == 0 else f"{base}-{count}")
            found.update(HTML_ANCHOR.findall(line))
        cache[path] = found
    return cache[path]


def links(text: str) -> Iterator[Tuple[int, str]]:
    """(line number, target) of every inline link outside code."""
    for number, line in prose_lines(text):
        for match in LINK.finditer(CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)):
            yield number, match.group(1)


def check_links(problems: List[str]) -> int:
    cache: Dict[Path, Set[str]] = {}
    checked = 0
    for page in pages():
        text = page.read_text(encoding="utf-8")
        for number, target in links(text):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
                continue  # a URL with a scheme: not checked here
            checked += 1
            where = f"{rel(page)}:{number}"
            path_part, _, anchor = target.partition("#")
            destination = (page.parent / path_part).resolve() if path_part else page
            if path_part and not destination.exists():
                problems.append(f"{where}: link to {target}: {rel(destination)} does not exist")
                continue
            if not anchor:
                continue
            if destination.is_dir() or destination.suffix.lower() != ".md":
                continue  # anchors into source files (#L10) are not headings
            if anchor not in anchors(destination, cache):
                problems.append(
                    f"{where}: link to {target}: no heading in {rel(destination)} makes #{anchor}"
                )
    return checked


def check_readme(problems: List[str]) -> None:
    readme = REPO / "README.md"
    lines = readme.read_text(encoding="utf-8").splitlines()
    if len(lines) > README_MAX_LINES:
        problems.append(
            f"README.md: {len(lines)} lines, over {README_MAX_LINES}: move detail into docs/"
        )
    begins = [n for n, line in enumerate(lines, 1) if line.strip() == PERF_BEGIN]
    ends = [n for n, line in enumerate(lines, 1) if line.strip() == PERF_END]
    if len(begins) != 1 or len(ends) != 1 or begins[0] > ends[0]:
        problems.append(
            f"README.md: want one {PERF_BEGIN} line before one {PERF_END} line "
            f"(found begin at {begins or 'none'}, end at {ends or 'none'})"
        )


def check_index(problems: List[str]) -> None:
    index = REPO / "docs" / "README.md"
    if not index.is_file():
        problems.append("docs/README.md: missing (the guide's index)")
        return
    linked = {
        (index.parent / target.partition("#")[0]).resolve()
        for _, target in links(index.read_text(encoding="utf-8"))
        if target.partition("#")[0]
    }
    for page in sorted((REPO / "docs").glob("*.md")):
        if page.name != "README.md" and page.resolve() not in linked:
            problems.append(f"docs/README.md: does not link {rel(page)}")


def check_doctests(problems: List[str]) -> None:
    doctests = REPO / "src" / "doctests.rs"
    included = set()
    if doctests.is_file():
        included = {
            (REPO / name).resolve() for name in INCLUDE.findall(doctests.read_text(encoding="utf-8"))
        }
    for path in sorted(included):
        if not path.is_file():
            problems.append(f"src/doctests.rs: includes {rel(path)}, which does not exist")
    for page in pages():
        text = page.read_text(encoding="utf-8")
        infos = list(fences(text))
        has_rust = any(info.split(",")[0].strip() == "rust" for _, info in infos)
        if has_rust and page.resolve() not in included:
            problems.append(
                f"{rel(page)}: has ```rust blocks but src/doctests.rs does not include it"
            )
        if page.resolve() in included:
            for number, info in infos:
                if not info:
                    problems.append(
                        f"{rel(page)}:{number}: a code fence without a language "
                        "(rustdoc compiles it as Rust): say ```text, ```sh, ..."
                    )


# A measurement in a table row: a figure with a throughput or latency
# unit, or a percentile. Tables of measurements belong on the generated
# performance page (and the README's generated block), not in the guide.
MEASURED = re.compile(r"\d\s*(GB/s|MB/s|MiB/s|Gbit/s|Mops)|\bp(50|99)\b")
# Words of a lab notebook: figures tied to one boot or one run.
LOGBOOK = re.compile(r"\b(this|that|one|per|each) boot\b|\b(run|round) \d+\b:", re.I)


def check_measurement_logs(problems: List[str]) -> None:
    """No guide page holds per-run measurement tables or per-boot logs."""
    for page in sorted((REPO / "docs").glob("*.md")):
        if page.name == "performance.md":
            continue
        for number, line in prose_lines(page.read_text()):
            where = f"{rel(page)}:{number}"
            if line.lstrip().startswith("|") and MEASURED.search(line):
                problems.append(
                    f"{where}: a table of measurements: it belongs on the generated "
                    "docs/performance.md (scripts/perf-page.sh)"
                )
            elif LOGBOOK.search(line):
                problems.append(f"{where}: a per-boot or per-run log: keep the conclusion only")


def main() -> int:
    problems: List[str] = []
    check_readme(problems)
    checked = check_links(problems)
    check_index(problems)
    check_doctests(problems)
    check_measurement_logs(problems)
    if problems:
        for problem in problems:
            print(problem)
        print(f"check-docs: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"check-docs: ok ({len(pages())} pages, {checked} relative links)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
