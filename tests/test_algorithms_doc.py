"""docs/algorithms.md is well formed, and every citation of it in the product code resolves.

The code cites the document in two forms, each on one line:

- ``docs/algorithms.md eq. 7`` or ``docs/algorithms.md eqs. 7, 8`` (also ``7 and 8``, ``7–9``);
- ``docs/algorithms.md "Heading text"``: the exact text of one of its headings, without the #'s.

The path may be wrapped in backticks (````docs/algorithms.md````) and followed by a comma. A
mention that looks like a citation but has neither form (``eq 7``, ``§3``, curly quotes) fails,
so that no citation goes unchecked. Plain text only: no torch, no package imports.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "algorithms.md"
DOC_NAME = "docs/algorithms.md"
#: Folders whose Python files may cite the document (and must not name the shared spec).
CODE_DIRS = ("agentenv", "agents", "sandboxes", "benchmarks")
README = ROOT / "README.md"
#: The shared specification the document replaces; product files must cite the document instead.
SHARED_SPEC = "ALGORITHMS.md"
#: Text files of the product folders searched for mentions of the shared spec (data files are not).
TEXT_SUFFIXES = (".py", ".md", ".rst", ".txt", ".toml", ".cfg", ".ini", ".yaml", ".yml")

EQUATION_LINE = re.compile(r"^\*\*\((\d+)\)\*\* `[^`]+`")
EQUATION_LABEL = re.compile(r"\*\*\((\d+)\)\*\*")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.*?)[ \t]*(?:[ \t]#+)?[ \t]*$")
FENCE = re.compile(r"^[ \t]*(```|~~~)")

_PATH = r"`{0,2}docs/algorithms\.md`{0,2},?[ \t]+"
_NUMBERS = r"\d+(?:[ \t]*(?:,|and|–|-)[ \t]*\d+)*"
EQ_CITATION = re.compile(_PATH + r"(eqs?)\.[ \t]*(" + _NUMBERS + r")")
HEADING_CITATION = re.compile(_PATH + r'"([^"\n]+)"')
#: What a citation attempt starts with; one that matches neither form above is malformed.
CITATION_ATTEMPT = re.compile(_PATH + r"(?:eqs?\b|equations?\b|§|sections?\b|[\"“”'‘’])", re.IGNORECASE)
#: Equation references inside the document itself ("eq. 12", "eqs. 3, 4").
INTERNAL_REFERENCE = re.compile(r"\beqs?\.[ \t]*(" + _NUMBERS + r")")


@dataclass(frozen=True)
class Doc:
    equations: list[tuple[int, int]]  # (equation number, line number), in document order
    malformed_equations: list[tuple[int, str]]  # (line number, line)
    headings: list[tuple[str, int]]  # (heading text, line number)
    prose: list[tuple[int, str]]  # (line number, line) outside code fences and equation lines


@dataclass(frozen=True)
class Citation:
    path: str
    line: int
    text: str  # the citation as written
    equations: tuple[int, ...] = ()
    heading: str | None = None

    def where(self) -> str:
        return f"{self.path}:{self.line}: {self.text!r}"


@functools.cache
def parse_doc() -> Doc:
    assert DOC.is_file(), f"{DOC.relative_to(ROOT)} is missing"
    equations, malformed, headings, prose = [], [], [], []
    in_fence = False
    for number, line in enumerate(DOC.read_text(encoding="utf-8").splitlines(), start=1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        heading = HEADING.match(line)
        if heading:
            headings.append((heading.group(2), number))
        equation = EQUATION_LINE.match(line)
        labels = EQUATION_LABEL.findall(line)
        if equation and len(labels) == 1:
            equations.append((int(equation.group(1)), number))
            continue
        if labels:
            malformed.append((number, line))
        prose.append((number, line))
    return Doc(equations, malformed, headings, prose)


def expand_numbers(text: str) -> tuple[int, ...]:
    """``"7, 8 and 10–12"`` -> ``(7, 8, 10, 11, 12)``."""
    numbers: list[int] = []
    for part in re.split(r"[ \t]*(?:,|and)[ \t]*", text.strip()):
        bounds = re.split(r"[ \t]*[–-][ \t]*", part)
        if len(bounds) == 2:
            low, high = int(bounds[0]), int(bounds[1])
            numbers += range(low, high + 1) if low <= high else [low, high]
        else:
            numbers.append(int(bounds[0]))
    return tuple(numbers)


def cited_files() -> list[Path]:
    """Every Python file of the product folders, and the README."""
    files = [
        path
        for folder in CODE_DIRS
        for path in sorted((ROOT / folder).rglob("*.py"))
        if "__pycache__" not in path.parts
    ]
    return files + ([README] if README.is_file() else [])


def product_text_files() -> list[Path]:
    files = [
        path
        for folder in CODE_DIRS
        for path in sorted((ROOT / folder).rglob("*"))
        if path.is_file() and path.suffix in TEXT_SUFFIXES and "__pycache__" not in path.parts
    ]
    return files + ([README] if README.is_file() else [])


def scan_citations(path: Path) -> tuple[list[Citation], list[str]]:
    """The citations in one file, and the malformed ones as error messages."""
    citations, errors = [], []
    relative = path.relative_to(ROOT).as_posix()
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if DOC_NAME not in line:
            continue
        found = {}
        for match in EQ_CITATION.finditer(line):
            found[match.start()] = Citation(relative, number, match.group(0), equations=expand_numbers(match.group(2)))
        for match in HEADING_CITATION.finditer(line):
            found[match.start()] = Citation(relative, number, match.group(0), heading=match.group(1))
        for match in CITATION_ATTEMPT.finditer(line):
            if match.start() not in found:
                tail = line[match.start() : match.start() + 60]
                errors.append(
                    f"{relative}:{number}: malformed citation {tail!r}; write "
                    f'{DOC_NAME} eq. N, {DOC_NAME} eqs. N, M or {DOC_NAME} "Heading text"'
                )
        citations += found.values()
    return citations, errors


def all_citations() -> tuple[list[Citation], list[str]]:
    citations, errors = [], []
    for path in cited_files():
        found, bad = scan_citations(path)
        citations += found
        errors += bad
    return citations, errors


def _file_and_line(problem: str) -> tuple[str, int]:
    path, line, _ = problem.split(":", 2)
    return path, int(line)


# ---- the document ---------------------------------------------------------------------------


def test_equations_are_numbered_one_to_n_in_order():
    doc = parse_doc()
    numbers = [number for number, _ in doc.equations]
    assert numbers, f"{DOC_NAME} has no equation line (**(1)** `formula`)"
    problems = []
    seen: dict[int, int] = {}
    for number, line in doc.equations:
        if number in seen:
            problems.append(f"{DOC_NAME}:{line}: equation ({number}) repeats the one on line {seen[number]}")
        seen.setdefault(number, line)
    # The first place where the numbering leaves 1, 2, 3, …; later ones follow from it.
    for position, (number, line) in enumerate(doc.equations, start=1):
        if number != position:
            previous = (
                f"after ({doc.equations[position - 2][0]}) on line {doc.equations[position - 2][1]}"
                if position > 1
                else "as the first equation"
            )
            problems.append(
                f"{DOC_NAME}:{line}: equation ({number}) {previous}; expected ({position}): numbers run "
                "1, 2, 3, … in document order without gaps or repeats (an equation line that does not "
                "start with **(N)** is not counted)"
            )
            break
    assert not problems, "\n".join(problems)


def test_equation_labels_only_start_equation_lines():
    doc = parse_doc()
    problems = [
        f"{DOC_NAME}:{line}: an equation label must start its line, followed by a space and the formula "
        f"in backticks, e.g. **(3)** `A_i = …`, alone on the line: {text!r}"
        for line, text in doc.malformed_equations
    ]
    assert not problems, "\n".join(problems)


def test_headings_are_unique():
    doc = parse_doc()
    assert doc.headings, f"{DOC_NAME} has no headings"
    first: dict[str, int] = {}
    problems = []
    for text, line in doc.headings:
        if not text:
            problems.append(f"{DOC_NAME}:{line}: empty heading")
        elif text in first:
            problems.append(f"{DOC_NAME}:{line}: heading {text!r} repeats the one on line {first[text]}")
        first.setdefault(text, line)
    assert not problems, "\n".join(problems)


def test_equation_references_inside_the_document_resolve():
    doc = parse_doc()
    numbers = {number for number, _ in doc.equations}
    last = max(numbers, default=0)
    problems = [
        f"{DOC_NAME}:{line}: {match.group(0)!r} refers to no equation (the document has 1..{last})"
        for line, text in doc.prose
        for match in INTERNAL_REFERENCE.finditer(text)
        if any(n not in numbers for n in expand_numbers(match.group(1)))
    ]
    assert not problems, "\n".join(problems)


# ---- citations in the product ---------------------------------------------------------------


def test_every_citation_in_the_code_resolves():
    doc = parse_doc()
    numbers = {number for number, _ in doc.equations}
    last = max(numbers, default=0)
    headings = {text for text, _ in doc.headings}
    citations, problems = all_citations()
    for citation in citations:
        for number in citation.equations:
            if number not in numbers:
                problems.append(f"{citation.where()}: no equation {number} (the document has 1..{last})")
        if citation.heading is not None and citation.heading not in headings:
            close = [h for h in headings if h.lower() == citation.heading.lower()]
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(f"{citation.where()}: no heading {citation.heading!r} in {DOC_NAME}{hint}")
    assert not problems, "\n".join(sorted(problems, key=_file_and_line))


def test_the_agents_package_cites_the_document():
    agents = [c for c in all_citations()[0] if c.path.startswith("agents/")]
    assert agents, (
        f'no file under agents/ cites {DOC_NAME} (eq. N or "Heading"), so the citation check above proves nothing'
    )


def test_no_product_file_names_the_shared_spec():
    problems = []
    for path in product_text_files():
        relative = path.relative_to(ROOT).as_posix()
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
            if SHARED_SPEC in line:
                problems.append(f"{relative}:{number}: names {SHARED_SPEC}; cite {DOC_NAME} instead: {line.strip()!r}")
    assert not problems, "\n".join(problems)
