"""docs/algorithms/ is well formed, and every citation of its pages in the product code resolves.

The document is a folder of pages, one per part or group of parts: ``index.md`` (how to use it,
notation, vocabulary) holds a table of the pages in their reading order, and its equations are
numbered once across the pages, 1, 2, 3, … in that order, so that moving text between pages
renumbers nothing. No two headings of the pages share a title.

The code cites a page in two forms, each on one line:

- ``docs/algorithms/credit.md eq. 21`` or ``docs/algorithms/credit.md eqs. 19, 20`` (also
  ``19 and 20``, ``19–21``);
- ``docs/algorithms/training.md "Heading text"``: the exact text of one of that page's headings,
  without the #'s.

The path may be wrapped in backticks (````docs/algorithms/credit.md````) and followed by a comma.
The page must exist and hold every equation, or the heading, that the citation names: equations of
two pages take one citation each (``docs/algorithms/index.md eq. 1 and docs/algorithms/credit.md
eq. 24``). A mention that looks like a citation but has neither form (``eq 7``, ``§3``, curly
quotes) fails, and so does any mention of ``docs/algorithms.md``, the single page the folder
replaced, so that no citation goes unchecked.

Inside the pages, ``eq. N`` in the prose names an equation of the same page; one of another page is
a link to the section that holds it, ``[eq. N](credit.md#group-z-score)`` (for ``eqs. N, M`` the
section of N), and every link from one page to another or to an anchor resolves (the anchors are
MkDocs's, from Python-Markdown's own ``toc.slugify``, as the site makes them). Plain text only: no
torch and none of the product's packages.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from markdown.extensions import toc

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "docs" / "algorithms"
FOLDER_NAME = "docs/algorithms"
INDEX = "index.md"
#: The single page the folder replaced: naming it anywhere in the scanned files is an error.
OLD_DOC = "docs/algorithms.md"
MKDOCS = ROOT / "mkdocs.yml"
#: Folders whose Python files may cite the document (and must not name the shared spec).
CODE_DIRS = ("agentenv", "agents", "sandboxes", "benchmarks")
#: Folders whose text files are searched for citations: the product's, and the tests'.
CITING_DIRS = (*CODE_DIRS, "tests")
README = ROOT / "README.md"
#: This file holds planted bad citations; it is not scanned.
THIS_FILE = Path(__file__).resolve()
#: The shared specification the document replaces; product files must cite the document instead.
SHARED_SPEC = "ALGORITHMS.md"
#: Text files of the product folders searched for mentions of the shared spec (data files are not).
TEXT_SUFFIXES = (".py", ".md", ".rst", ".txt", ".toml", ".cfg", ".ini", ".yaml", ".yml")

EQUATION_LINE = re.compile(r"^\*\*\((\d+)\)\*\* `[^`]+`")
EQUATION_LABEL = re.compile(r"\*\*\((\d+)\)\*\*")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.*?)[ \t]*(?:[ \t]#+)?[ \t]*$")
FENCE = re.compile(r"^[ \t]*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`\n]*`")

#: ``docs/algorithms/PAGE.md`` (group "page": ``PAGE.md``) or the old ``docs/algorithms.md`` (no page).
_PATH = r"`{0,2}docs/algorithms(?:/(?P<page>[\w.-]+\.md)|\.md)`{0,2},?[ \t]+"
_NUMBERS = r"\d+(?:[ \t]*(?:,|and|–|-)[ \t]*\d+)*"
EQ_CITATION = re.compile(_PATH + r"(?P<word>eqs?)\.[ \t]*(?P<numbers>" + _NUMBERS + r")")
HEADING_CITATION = re.compile(_PATH + r'"(?P<heading>[^"\n]+)"')
#: What a citation attempt starts with; one that matches neither form above is malformed.
CITATION_ATTEMPT = re.compile(_PATH + r"(?:eqs?\b|equations?\b|§|sections?\b|[\"“”'‘’])", re.IGNORECASE)
#: Any mention of a page of the folder, cited or not: the page must exist.
PAGE_MENTION = re.compile(r"docs/algorithms/(?P<page>[\w.-]+\.md)")
#: Equation references inside the pages ("eq. 12", "eqs. 3, 4"), or links to one on a page
#: ("[eq. 12](rollout.md#entropy-adaptive-branching)"; the page is left out for the same page).
INTERNAL_REFERENCE = re.compile(
    r"(?P<open>\[)?\beqs?\.[ \t]*(?P<numbers>" + _NUMBERS + r")"
    r"(?:\](?:\((?P<target>[\w.-]*\.md)?(?P<anchor>#[^)\s]*)?\))?)?"
)
#: A link from a page to a page of the folder or to an anchor ("](credit.md#grpo)", "](#masks)").
LINK = re.compile(r"\]\((?P<target>[\w.-]+\.md)?(?P<anchor>#[^)\s]*)?\)")
#: A row of index.md's table of pages: | [title](page.md) | parts | equations |
TABLE_ROW = re.compile(
    r"^\|[ \t]*\[[^\]]+\]\((?P<page>[\w.-]+\.md)\)[ \t]*\|(?P<parts>[^|]*)\|(?P<equations>[^|]*)\|[ \t]*$"
)
#: The pages in mkdocs.yml's nav ("- Losses: algorithms/losses.md").
NAV_ENTRY = re.compile(r"^[ \t]*-[^\n]*?:[ \t]*algorithms/(?P<page>[\w.-]+\.md)[ \t]*$")


def slugify(text: str) -> str:
    """The anchor MkDocs gives a heading (mkdocs.yml keeps the toc extension's default slugify):
    ``"AT²PO turn-wise credit"`` -> ``at2po-turn-wise-credit``."""
    return toc.slugify(text, "-")


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


# ---- the pages --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Page:
    name: str  # "credit.md"
    equations: list[tuple[int, int]]  # (equation number, line number), in page order
    malformed_equations: list[tuple[int, str]]  # (line number, line)
    headings: list[tuple[str, int]]  # (heading text, line number)
    prose: list[tuple[int, str]]  # (line number, line) outside code fences and equation lines
    sections: dict[int, str]  # equation number -> anchor of the heading above it

    @property
    def path(self) -> str:
        return f"{FOLDER_NAME}/{self.name}"

    def anchors(self) -> set[str]:
        return {slugify(text) for text, _ in self.headings}


@dataclass(frozen=True)
class TableRow:
    page: str
    parts: tuple[str, ...]
    equations: str  # "6–18", "57", or "none"
    line: int


@dataclass(frozen=True)
class Document:
    pages: tuple[Page, ...]  # in the order of index.md's table; pages it does not list follow, sorted
    table: tuple[TableRow, ...]
    files: tuple[str, ...]  # the .md files of the folder

    def page(self, name: str | None) -> Page | None:
        return next((page for page in self.pages if page.name == name), None)

    def equation_page(self) -> dict[int, str]:
        return {number: page.name for page in self.pages for number, _ in page.equations}

    def heading_page(self) -> dict[str, str]:
        return {text: page.name for page in self.pages for text, _ in page.headings}

    def names(self) -> str:
        return ", ".join(page.name for page in self.pages)


def parse_page(name: str, text: str) -> Page:
    equations, malformed, headings, prose = [], [], [], []
    sections: dict[int, str] = {}
    section = ""
    in_fence = False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        heading = HEADING.match(line)
        if heading:
            headings.append((heading.group(2), number))
            section = slugify(heading.group(2))
        equation = EQUATION_LINE.match(line)
        labels = EQUATION_LABEL.findall(line)
        if equation and len(labels) == 1:
            equations.append((int(equation.group(1)), number))
            sections.setdefault(int(equation.group(1)), section)
            continue
        if labels:
            malformed.append((number, line))
        prose.append((number, line))
    return Page(name, equations, malformed, headings, prose, sections)


def parse_table(index_text: str) -> list[TableRow]:
    rows = []
    for number, line in enumerate(index_text.splitlines(), start=1):
        row = TABLE_ROW.match(line)
        if row:
            parts = tuple(part.strip() for part in row.group("parts").split(",") if part.strip())
            rows.append(TableRow(row.group("page"), parts, row.group("equations").strip(), number))
    return rows


def make_document(texts: dict[str, str]) -> Document:
    """The document from its pages' texts (name -> text), ordered by the table of ``texts["index.md"]``."""
    table = parse_table(texts.get(INDEX, ""))
    order = [INDEX] + [row.page for row in table if row.page != INDEX]
    order = list(dict.fromkeys(name for name in order if name in texts))
    order += sorted(name for name in texts if name not in order)
    pages = tuple(parse_page(name, texts[name]) for name in order)
    return Document(pages, tuple(table), tuple(sorted(texts)))


@functools.cache
def document() -> Document:
    assert FOLDER.is_dir(), f"{FOLDER_NAME}/ is missing"
    texts = {path.name: path.read_text(encoding="utf-8") for path in sorted(FOLDER.glob("*.md"))}
    assert INDEX in texts, f"{FOLDER_NAME}/{INDEX} is missing"
    return make_document(texts)


def table_problems(doc: Document) -> list[str]:
    """index.md's table lists every page once, itself first, with its parts and its equations."""
    where = f"{FOLDER_NAME}/{INDEX}"
    if not doc.table:
        return [f"{where}: no table of the pages (rows | [Title](page.md) | parts | equations |)"]
    problems = []
    listed = [row.page for row in doc.table]
    if listed[0] != INDEX:
        problems.append(f"{where}:{doc.table[0].line}: the table's first row is {listed[0]}; it must be {INDEX}")
    seen: set[str] = set()
    for row in doc.table:
        if row.page in seen:
            problems.append(f"{where}:{row.line}: {row.page} is listed twice")
            continue
        seen.add(row.page)
        page = doc.page(row.page)
        if page is None or row.page not in doc.files:
            problems.append(f"{where}:{row.line}: {row.page} is listed but {FOLDER_NAME}/{row.page} does not exist")
            continue
        numbers = [number for number, _ in page.equations]
        if not numbers:
            expected = "none"
        elif numbers[0] == numbers[-1]:
            expected = str(numbers[0])
        else:
            expected = f"{numbers[0]}–{numbers[-1]}"
        if row.equations != expected:
            problems.append(f"{where}:{row.line}: the equations of {row.page} are {expected!r}, not {row.equations!r}")
        headings = {text for text, _ in page.headings}
        for part in row.parts:
            if part not in headings:
                problems.append(f"{where}:{row.line}: {row.page} has no heading {part!r}")
    for name in doc.files:
        if name not in listed:
            problems.append(f"{where}: {FOLDER_NAME}/{name} is not in the table of the pages")
    return problems


def numbering_problems(doc: Document) -> list[str]:
    """Equations run 1, 2, 3, … across the pages in the table's order, without gaps or repeats."""
    flat = [(number, f"{page.path}:{line}") for page in doc.pages for number, line in page.equations]
    if not flat:
        return [f"{FOLDER_NAME}/ has no equation line (**(1)** `formula`)"]
    problems = []
    seen: dict[int, str] = {}
    for number, where in flat:
        if number in seen:
            problems.append(f"{where}: equation ({number}) repeats the one at {seen[number]}")
        seen.setdefault(number, where)
    # The first place where the numbering leaves 1, 2, 3, …; later ones follow from it.
    for position, (number, where) in enumerate(flat, start=1):
        if number != position:
            previous = f"after ({flat[position - 2][0]}) at {flat[position - 2][1]}" if position > 1 else "as the first"
            problems.append(
                f"{where}: equation ({number}) {previous}; expected ({position}): numbers run 1, 2, 3, … "
                f"across the pages in the order of {INDEX}'s table, without gaps or repeats (an equation "
                "line that does not start with **(N)** is not counted)"
            )
            break
    return problems


def label_problems(doc: Document) -> list[str]:
    return [
        f"{page.path}:{line}: an equation label must start its line, followed by a space and the formula "
        f"in backticks, e.g. **(3)** `A_i = …`, alone on the line: {text!r}"
        for page in doc.pages
        for line, text in page.malformed_equations
    ]


def heading_problems(doc: Document) -> list[str]:
    """No empty heading, and no two headings of the pages with one title."""
    first: dict[str, str] = {}
    problems = []
    for page in doc.pages:
        if not page.headings:
            problems.append(f"{page.path}: no headings")
        for text, line in page.headings:
            where = f"{page.path}:{line}"
            if not text:
                problems.append(f"{where}: empty heading")
            elif text in first:
                problems.append(f"{where}: heading {text!r} repeats the one at {first[text]}")
            first.setdefault(text, where)
    return problems


def reference_problems(doc: Document) -> list[str]:
    """``eq. N`` in a page's prose names an equation of that page, or links to the page and section holding it."""
    located = doc.equation_page()
    last = max(located, default=0)
    problems = []
    for page in doc.pages:
        for line, text in page.prose:
            for match in INTERNAL_REFERENCE.finditer(INLINE_CODE.sub("", text)):
                where = f"{page.path}:{line}: {match.group(0)!r}"
                numbers = expand_numbers(match.group("numbers"))
                missing = [n for n in numbers if n not in located]
                if missing:
                    problems.append(f"{where} refers to no equation {missing[0]} (the document has 1..{last})")
                    continue
                linked = match.group("open") and (
                    match.group("target") is not None or match.group("anchor") is not None
                )
                target = doc.page(match.group("target") or page.name) if linked else page
                if target is None:
                    problems.append(f"{where} links to {match.group('target')}, which is not a page ({doc.names()})")
                    continue
                elsewhere = [n for n in numbers if located[n] != target.name]
                if elsewhere:
                    n = elsewhere[0]
                    holder = doc.page(located[n])
                    assert holder is not None
                    link = f"[eq. {n}]({holder.name}#{holder.sections[n]})"
                    problems.append(
                        f"{where}: equation {n} is on {holder.path}, not on {target.path}; "
                        + (f"link it: {link}" if not linked else f"link to {holder.name}")
                    )
                    continue
                if linked:
                    section = target.sections[numbers[0]]
                    if match.group("anchor") != f"#{section}":
                        problems.append(
                            f"{where}: the anchor must be the section that holds equation {numbers[0]}, #{section}"
                        )
    return problems


def link_problems(doc: Document) -> list[str]:
    """Every link of a page to a page of the folder, or to an anchor, resolves."""
    problems = []
    for page in doc.pages:
        for line, text in page.prose:
            for match in LINK.finditer(text):
                target = doc.page(match.group("target") or page.name)
                where = f"{page.path}:{line}: link {match.group(0)!r}"
                if target is None:
                    problems.append(f"{where}: no page {match.group('target')} ({doc.names()})")
                elif match.group("anchor") and match.group("anchor")[1:] not in target.anchors():
                    problems.append(f"{where}: {target.name} has no heading with the anchor {match.group('anchor')}")
    return problems


# ---- citations --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Citation:
    path: str
    line: int
    text: str  # the citation as written
    page: str  # the page it names, "credit.md"
    equations: tuple[int, ...] = ()
    heading: str | None = None

    def where(self) -> str:
        return f"{self.path}:{self.line}: {self.text!r}"


def citation_for(doc: Document, equations: tuple[int, ...] = (), heading: str | None = None) -> str:
    """How to cite equations (one citation per page) or a heading; "" where the document has none of them."""
    if heading is not None:
        page = doc.heading_page().get(heading)
        return f'{FOLDER_NAME}/{page} "{heading}"' if page else ""
    located = doc.equation_page()
    if any(n not in located for n in equations):
        return ""
    by_page: dict[str, list[int]] = {}
    for n in equations:
        by_page.setdefault(located[n], []).append(n)
    return " and ".join(
        f"{FOLDER_NAME}/{page} eq. {ns[0]}" if len(ns) == 1 else f"{FOLDER_NAME}/{page} eqs. {', '.join(map(str, ns))}"
        for page, ns in by_page.items()
    )


def scan_citations(relative: str, text: str, doc: Document) -> tuple[list[Citation], list[str]]:
    """The citations in one file's text, and the malformed ones (old path and unknown pages included) as errors."""
    citations, errors = [], []
    form = f'{FOLDER_NAME}/PAGE.md eq. N, {FOLDER_NAME}/PAGE.md eqs. N, M or {FOLDER_NAME}/PAGE.md "Heading text"'
    for number, line in enumerate(text.splitlines(), start=1):
        if FOLDER_NAME not in line:
            continue
        found: dict[int, Citation] = {}
        old: dict[int, str] = {}  # citations of the old single page, with their new text
        for match in EQ_CITATION.finditer(line):
            numbers = expand_numbers(match.group("numbers"))
            if match.group("page") is None:  # keyed by where the path starts, after any backticks
                old[match.start() + match.group(0).index("docs/")] = citation_for(doc, equations=numbers)
            else:
                found[match.start()] = Citation(
                    relative, number, match.group(0), match.group("page"), equations=numbers
                )
        for match in HEADING_CITATION.finditer(line):
            heading = match.group("heading")
            if match.group("page") is None:
                old[match.start() + match.group(0).index("docs/")] = citation_for(doc, heading=heading)
            else:
                found[match.start()] = Citation(relative, number, match.group(0), match.group("page"), heading=heading)
        for match in re.finditer(re.escape(OLD_DOC), line):
            suggestion = old.get(match.start())
            errors.append(
                f"{relative}:{number}: names {OLD_DOC}, which is now the folder {FOLDER_NAME}/ with one page "
                f"per part; cite the page: " + (suggestion if suggestion else f"{form} (the pages: {doc.names()})")
            )
        for match in CITATION_ATTEMPT.finditer(line):
            if match.group("page") is not None and match.start() not in found:
                tail = line[match.start() : match.start() + 60]
                errors.append(f"{relative}:{number}: malformed citation {tail!r}; write {form}")
        for match in PAGE_MENTION.finditer(line):
            if doc.page(match.group("page")) is None:
                errors.append(
                    f"{relative}:{number}: names {FOLDER_NAME}/{match.group('page')}, which is not a page "
                    f"(the pages: {doc.names()})"
                )
        citations += found.values()
    return citations, errors


def citation_problems(citations: list[Citation], doc: Document) -> list[str]:
    """Each citation's page exists and holds every equation, or the heading, it cites."""
    located = doc.equation_page()
    holders = doc.heading_page()
    last = max(located, default=0)
    problems = []
    for citation in citations:
        page = doc.page(citation.page)
        if page is None:
            continue  # scan_citations reports the page
        numbers = {number for number, _ in page.equations}
        for number in citation.equations:
            if number not in located:
                problems.append(f"{citation.where()}: no equation {number} (the document has 1..{last})")
            elif number not in numbers:
                problems.append(
                    f"{citation.where()}: equation {number} is on {FOLDER_NAME}/{located[number]}, not on "
                    f"{page.path}; cite {citation_for(doc, equations=citation.equations)}"
                )
        if citation.heading is not None and citation.heading not in {text for text, _ in page.headings}:
            if citation.heading in holders:
                problems.append(
                    f"{citation.where()}: heading {citation.heading!r} is on {FOLDER_NAME}/{holders[citation.heading]}, "
                    f"not on {page.path}"
                )
            else:
                close = [h for h in holders if h.lower() == citation.heading.lower()]
                hint = f"; did you mean {close[0]!r}?" if close else ""
                problems.append(f"{citation.where()}: no heading {citation.heading!r} in {FOLDER_NAME}/{hint}")
    return problems


def _files(folders: tuple[str, ...]) -> list[Path]:
    return [
        path
        for folder in folders
        for path in sorted((ROOT / folder).rglob("*"))
        if path.is_file() and path.suffix in TEXT_SUFFIXES and "__pycache__" not in path.parts
    ]


def cited_files() -> list[Path]:
    """Every text file of the product folders and the tests (this one aside), the README, and the pages themselves."""
    files = [path for path in _files(CITING_DIRS) if path.resolve() != THIS_FILE]
    return files + ([README] if README.is_file() else []) + sorted(FOLDER.glob("*.md"))


def product_text_files() -> list[Path]:
    return _files(CODE_DIRS) + ([README] if README.is_file() else [])


def all_citations() -> tuple[list[Citation], list[str]]:
    citations, errors = [], []
    for path in cited_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        found, bad = scan_citations(path.relative_to(ROOT).as_posix(), text, document())
        citations += found
        errors += bad
    return citations, errors


def _file_and_line(problem: str) -> tuple[str, int]:
    path, _, rest = problem.partition(":")
    line = rest.split(":", 1)[0]
    return path, int(line) if line.isdigit() else 0


# ---- the document -----------------------------------------------------------------------------


def test_the_index_lists_every_page_in_order():
    assert not table_problems(document()), "\n".join(table_problems(document()))


def test_the_site_nav_lists_the_pages_in_the_index_order():
    nav = [m.group("page") for line in MKDOCS.read_text(encoding="utf-8").splitlines() if (m := NAV_ENTRY.match(line))]
    table = [row.page for row in document().table]
    assert nav == table, f"mkdocs.yml's Algorithms section lists {nav}; {FOLDER_NAME}/{INDEX}'s table, {table}"


def test_equations_are_numbered_one_to_n_across_the_pages():
    problems = numbering_problems(document())
    assert not problems, "\n".join(problems)


def test_equation_labels_only_start_equation_lines():
    problems = label_problems(document())
    assert not problems, "\n".join(problems)


def test_headings_are_unique_across_the_pages():
    problems = heading_problems(document())
    assert not problems, "\n".join(problems)


def test_equation_references_inside_the_document_resolve():
    problems = reference_problems(document())
    assert not problems, "\n".join(problems)


def test_links_between_the_pages_resolve():
    problems = link_problems(document())
    assert not problems, "\n".join(problems)


# ---- citations in the product -----------------------------------------------------------------


def test_every_citation_in_the_code_resolves():
    citations, problems = all_citations()
    problems += citation_problems(citations, document())
    assert not problems, "\n".join(sorted(problems, key=_file_and_line))


def test_the_agents_package_cites_the_document():
    agents = [c for c in all_citations()[0] if c.path.startswith("agents/")]
    assert agents, (
        f'no file under agents/ cites {FOLDER_NAME}/ (PAGE.md eq. N or PAGE.md "Heading"), so the citation check '
        "above proves nothing"
    )


def test_no_product_file_names_the_shared_spec():
    problems = []
    for path in product_text_files():
        relative = path.relative_to(ROOT).as_posix()
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
            if SHARED_SPEC in line:
                problems.append(
                    f"{relative}:{number}: names {SHARED_SPEC}; cite {FOLDER_NAME}/ instead: {line.strip()!r}"
                )
    assert not problems, "\n".join(problems)


# ---- the checks themselves, on planted documents and files -------------------------------------

_INDEX = """# Title

## Pages

| page | parts | equations |
|---|---|---|
| [Title](index.md) | Pages, Vocabulary | 1–2 |
| [Credit](credit.md) | Credit | 3 |

## Vocabulary

**(1)** `a = 1`

**(2)** `b = 2`

See [eq. 3](credit.md#group).
"""
_CREDIT = """# Credit

## Group

**(3)** `z = (x − μ) / σ`

As eq. 3 says, with the notation of [eq. 1](index.md#vocabulary).
"""


def _planted(**pages: str) -> Document:
    texts = {INDEX: _INDEX, "credit.md": _CREDIT}
    texts.update({name.removesuffix("_md") + ".md": text for name, text in pages.items()})
    return make_document({name: text for name, text in texts.items() if text})


def test_a_well_formed_planted_document_passes_every_check():
    doc = _planted()
    assert [page.name for page in doc.pages] == ["index.md", "credit.md"]
    for check in (
        table_problems,
        numbering_problems,
        label_problems,
        heading_problems,
        reference_problems,
        link_problems,
    ):
        assert check(doc) == [], check.__name__
    citations, errors = scan_citations("agents/x.py", "# docs/algorithms/credit.md eq. 3", doc)
    assert errors == [] and citation_problems(citations, doc) == []
    assert citations == [Citation("agents/x.py", 1, "docs/algorithms/credit.md eq. 3", "credit.md", equations=(3,))]


def test_the_old_path_fails_with_the_citation_to_write_instead():
    doc = _planted()
    text = 'x = 1  # docs/algorithms.md eqs. 1, 3\ny = 2  # `docs/algorithms.md` "Group"\nsee docs/algorithms.md.'
    citations, errors = scan_citations("agents/x.py", text, doc)
    assert citations == []
    assert errors == [
        "agents/x.py:1: names docs/algorithms.md, which is now the folder docs/algorithms/ with one page per part; "
        "cite the page: docs/algorithms/index.md eq. 1 and docs/algorithms/credit.md eq. 3",
        "agents/x.py:2: names docs/algorithms.md, which is now the folder docs/algorithms/ with one page per part; "
        'cite the page: docs/algorithms/credit.md "Group"',
        "agents/x.py:3: names docs/algorithms.md, which is now the folder docs/algorithms/ with one page per part; "
        "cite the page: docs/algorithms/PAGE.md eq. N, docs/algorithms/PAGE.md eqs. N, M or docs/algorithms/PAGE.md "
        '"Heading text" (the pages: index.md, credit.md)',
    ]


def test_a_page_that_does_not_exist_fails():
    doc = _planted()
    citations, errors = scan_citations("agents/x.py", "# docs/algorithms/credits.md eq. 3", doc)
    assert errors == [
        "agents/x.py:1: names docs/algorithms/credits.md, which is not a page (the pages: index.md, credit.md)"
    ]
    assert citation_problems(citations, doc) == []  # reported once, by the scan


def test_a_citation_of_the_wrong_page_fails():
    doc = _planted()
    text = (
        '# docs/algorithms/credit.md eqs. 1, 3\n# docs/algorithms/index.md "Group"\n# docs/algorithms/credit.md eq. 9'
    )
    citations, errors = scan_citations("agents/x.py", text, doc)
    assert errors == []
    assert citation_problems(citations, doc) == [
        "agents/x.py:1: 'docs/algorithms/credit.md eqs. 1, 3': equation 1 is on docs/algorithms/index.md, not on "
        "docs/algorithms/credit.md; cite docs/algorithms/index.md eq. 1 and docs/algorithms/credit.md eq. 3",
        "agents/x.py:2: 'docs/algorithms/index.md \"Group\"': heading 'Group' is on docs/algorithms/credit.md, "
        "not on docs/algorithms/index.md",
        "agents/x.py:3: 'docs/algorithms/credit.md eq. 9': no equation 9 (the document has 1..3)",
    ]


def test_malformed_citations_and_unknown_headings_fail():
    doc = _planted()
    text = '# docs/algorithms/credit.md eq 3\n# docs/algorithms/credit.md “Group”\n# docs/algorithms/credit.md "group"'
    citations, errors = scan_citations("agents/x.py", text, doc)
    form = 'docs/algorithms/PAGE.md eq. N, docs/algorithms/PAGE.md eqs. N, M or docs/algorithms/PAGE.md "Heading text"'
    assert errors == [
        f"agents/x.py:1: malformed citation 'docs/algorithms/credit.md eq 3'; write {form}",
        f"agents/x.py:2: malformed citation 'docs/algorithms/credit.md “Group”'; write {form}",
    ]
    assert citation_problems(citations, doc) == [
        "agents/x.py:3: 'docs/algorithms/credit.md \"group\"': no heading 'group' in docs/algorithms/; "
        "did you mean 'Group'?"
    ]


def test_numbering_must_increase_across_the_pages_in_the_table_order():
    later = "# Later\n\n**(3)** `c`\n"
    index = _INDEX.replace(
        "| [Credit](credit.md) | Credit | 3 |",
        "| [Later](later.md) | Later | 3 |\n| [Credit](credit.md) | Credit | 3 |",
    )
    doc = _planted(index_md=index, later_md=later)
    assert [page.name for page in doc.pages] == ["index.md", "later.md", "credit.md"]
    assert numbering_problems(doc) == [
        "docs/algorithms/credit.md:5: equation (3) repeats the one at docs/algorithms/later.md:3",
        "docs/algorithms/credit.md:5: equation (3) after (3) at docs/algorithms/later.md:3; expected (4): numbers "
        "run 1, 2, 3, … across the pages in the order of index.md's table, without gaps or repeats (an equation "
        "line that does not start with **(N)** is not counted)",
    ]


def test_the_table_must_match_the_pages():
    index = _INDEX.replace("| Credit | 3 |", "| Credit, Sums | 3–4 |")
    doc = _planted(index_md=index, extra_md="# Extra\n")
    assert table_problems(doc) == [
        "docs/algorithms/index.md:8: the equations of credit.md are '3', not '3–4'",
        "docs/algorithms/index.md:8: credit.md has no heading 'Sums'",
        "docs/algorithms/index.md: docs/algorithms/extra.md is not in the table of the pages",
    ]


def test_headings_must_be_unique_across_the_pages():
    doc = _planted(credit_md=_CREDIT.replace("## Group", "## Vocabulary"))
    assert heading_problems(doc) == [
        "docs/algorithms/credit.md:3: heading 'Vocabulary' repeats the one at docs/algorithms/index.md:10"
    ]


def test_a_reference_to_another_page_must_link_to_its_section():
    credit = (
        _CREDIT.replace("[eq. 1](index.md#vocabulary)", "eq. 1")
        + "And [eq. 1](index.md#title), [eq. 3](index.md#title).\n"
    )
    doc = _planted(credit_md=credit)
    assert reference_problems(doc) == [
        "docs/algorithms/credit.md:7: 'eq. 1': equation 1 is on docs/algorithms/index.md, not on "
        "docs/algorithms/credit.md; link it: [eq. 1](index.md#vocabulary)",
        "docs/algorithms/credit.md:8: '[eq. 1](index.md#title)': the anchor must be the section that holds equation 1, "
        "#vocabulary",
        "docs/algorithms/credit.md:8: '[eq. 3](index.md#title)': equation 3 is on docs/algorithms/credit.md, not on "
        "docs/algorithms/index.md; link to credit.md",
    ]


def test_links_must_name_a_page_and_a_heading():
    doc = _planted(credit_md=_CREDIT + "See [this](rollout.md) and [that](index.md#nowhere).\n")
    assert link_problems(doc) == [
        "docs/algorithms/credit.md:8: link '](rollout.md)': no page rollout.md (index.md, credit.md)",
        "docs/algorithms/credit.md:8: link '](index.md#nowhere)': index.md has no heading with the anchor #nowhere",
    ]


def test_slugify_matches_the_site_anchors():
    assert slugify("AT²PO turn-wise credit") == "at2po-turn-wise-credit"
    assert slugify("KL penalty (k3)") == "kl-penalty-k3"
    assert slugify("Known defects of the reference code we do not copy") == (
        "known-defects-of-the-reference-code-we-do-not-copy"
    )


def test_equation_labels_must_start_an_equation_line():
    doc = _planted(credit_md=_CREDIT.replace("**(3)** `z = (x − μ) / σ`", "Then **(3)** `z = (x − μ) / σ`"))
    assert label_problems(doc) == [
        "docs/algorithms/credit.md:5: an equation label must start its line, followed by a space and the formula "
        "in backticks, e.g. **(3)** `A_i = …`, alone on the line: 'Then **(3)** `z = (x − μ) / σ`'"
    ]
    assert numbering_problems(doc) == []  # a line that does not start with its label is no equation: 1..2 remain
    assert reference_problems(doc) == [
        "docs/algorithms/index.md:16: '[eq. 3](credit.md#group)' refers to no equation 3 (the document has 1..2)",
        "docs/algorithms/credit.md:7: 'eq. 3' refers to no equation 3 (the document has 1..2)",
    ]
